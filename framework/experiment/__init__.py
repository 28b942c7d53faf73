"""Experiments: run configuration, presets, model loading, data, the Lightning runner, tracking,
metrics and plots. The composition root that loads the built-in strategies lives here."""
