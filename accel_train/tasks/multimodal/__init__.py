"""Image-text task kits: the pairs (`data`: image folders with metadata.jsonl, `datasets`, the digits with generated
captions; dataset and collator), the CLIP-style dual encoder (`model`), the flags and helpers both image-text
recipes share for their towers (`towers`: tower and per-tower training arguments, vision presets), the
contrastive loss over the global batch with GradCache (`loss`) and retrieval / zero-shot metrics (`metrics`);
cross-attention fusion with an image-text matching head (`fusion`: FusionEncoder, CrossModalFusion,
vision_tokens), its multi-task loss with hard negatives over the global batch and fixed / uncertainty weights
(`fusion_loss`) and ITM accuracy / ROC-AUC and re-ranking of ITC candidates (`fusion_metrics`)."""
