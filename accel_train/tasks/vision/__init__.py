"""What any image recipe reuses: loading image data, on-device transforms, a small ResNet, and classification
metrics with a confusion-matrix plot.

Submodules: `data` (image folders, `datasets`, the embedded digits, splits), `transforms` (statistics,
augmentation, evaluation transform, mixup / cutmix), `models` (SmallResNet), `classification` (metrics).
"""
