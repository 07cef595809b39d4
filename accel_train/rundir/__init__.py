"""Everything that names a file in a run's output directory: the layout, checkpoints (atomic, verified, rotated),
the output-directory checks, the metrics history and the exported model. Below the core: it imports nothing of
the loop, so the loop, the observer and the command line agree on one layout."""
