"""Hyper-parameter sweeps from W&B sweep YAML, with or without a W&B server."""
