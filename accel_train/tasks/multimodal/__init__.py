"""Image-text task kits: the pairs (`data`: image folders with metadata.jsonl, `datasets`, the digits with generated
captions; dataset and collator), the CLIP-style dual encoder (`model`), the contrastive loss over the global batch
with GradCache (`loss`) and retrieval / zero-shot metrics (`metrics`)."""
