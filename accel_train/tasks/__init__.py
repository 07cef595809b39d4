"""Task kits: what recipes reuse, one sub-package per field, on top of the core.

    tasks/text/         text classification data (files, `datasets`, the embedded tweets), labels, tokenization;
                        text generation data, collators, models, generation and its scores
    tasks/vision/       image data, on-device transforms, SmallResNet, classification metrics
    tasks/multimodal/   image-text pairs, the CLIP-style dual encoder, contrastive loss, retrieval metrics
    tasks/metrics.py    `load_metric`: the `evaluate` modules shipped in tasks/metric_modules/, offline
    tasks/model_config.py   --config_overrides, one parser for every recipe

A kit imports the core (the loss contract, evaluation helpers), never the observer; the core never imports a kit.
"""
