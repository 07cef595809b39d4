"""Image-text task kits, each file named for the half it holds.

Both recipes: `data` (image folders with metadata.jsonl, `datasets`, the digits with generated captions; dataset
and collator), `towers` (tower and per-tower training arguments, vision presets) and `collectives` (gathers with and
without gradients, distinct ids). The CLIP-style dual encoder: `dual_encoder` (DualEncoder, towers, param groups),
`contrastive_loss` (InfoNCE over the global batch with GradCache) and `contrastive_metrics` (retrieval and
zero-shot). Cross-attention fusion with an image-text matching head: `fusion_model` (FusionEncoder,
CrossModalFusion, vision_tokens), `fusion_loss` (multi-task loss with hard negatives over the global batch, fixed /
uncertainty weights) and `fusion_metrics` (ITM accuracy / ROC-AUC, re-ranking of ITC candidates)."""
