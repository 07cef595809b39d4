"""What any image recipe reuses: loading image data, on-device transforms, a small ResNet, and classification
metrics with a confusion-matrix plot.

Submodules: `data` (image folders, `datasets`, the embedded digits, splits), `transforms` (statistics,
augmentation, evaluation transform, mixup / cutmix), `models` (SmallResNet), `classification` (metrics). Dense
prediction is the `dense` sub-package: `canvases` (generated multi-digit canvases with exact boxes and masks),
`annotated` (COCO-style JSON, image + mask PNG pairs), `augment` (box- and mask-aware on-device augmentation),
`backbone`, `detection` (CenterNet-style detector, NMS, COCO mAP), `segmentation` (U-Net, mIoU), `prediction_plots`.
"""
