"""A site's examples on disk: the dataset format, image decoding, synthetic tasks (no model)."""
