"""Drafters: how draft tokens are produced from the target's own layers."""

from strategies.drafters import early_exit, layer_skip  # noqa: F401
