"""Task kits: what recipes reuse, one sub-package per field, on top of the core.

    tasks/text/classification/   text classification data (files, `datasets`, the embedded tweets), labels,
                                 tokenization, metrics, the test split's predictions
    tasks/text/generation/       text generation data, chats, collators, packing, models, generation and its scores
    tasks/vision/                image data, on-device transforms, SmallResNet, classification metrics
    tasks/vision/dense/          detection and segmentation: generated canvases, COCO / mask data, box- and
                                 mask-aware augmentation, CenterNet, U-Net, prediction plots
    tasks/multimodal/            image-text pairs, the CLIP-style dual encoder, contrastive loss, retrieval metrics
    tasks/metrics.py             `load_metric`: the `evaluate` modules shipped in tasks/metric_modules/, offline
    tasks/model_config.py        --config_overrides, one parser for every recipe

A kit imports the core (the loss contract, evaluation helpers), never the observer; the core never imports a kit.
"""
