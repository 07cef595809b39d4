"""Dense prediction kit (the object_detection and semantic_segmentation recipes), on top of the image basics of
`tasks/vision` (data, transforms, SmallResNet): each file named for what it holds.

Data: `canvases` (generated multi-digit canvases with exact boxes and masks; the dense dataset and collator),
`annotated` (COCO-style JSON, image + mask PNG pairs), `augment` (box- and mask-aware on-device augmentation).
Models: `backbone` (SmallResNet's stem and stages, each stage's output kept), `detection` (CenterNet-style
detector, NMS, COCO mAP), `segmentation` (U-Net, mIoU). `prediction_plots`: pictures of a model's boxes or masks at
the end of training.
"""
