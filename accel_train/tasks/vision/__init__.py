"""Vision tasks beyond classification: generated multi-digit canvases and a user's own annotated images
(`canvases`, `annotated`), box- and mask-aware augmentation (`augment`), object detection (`detection`),
semantic segmentation (`segmentation`) and plots of their predictions (`prediction_plots`)."""
