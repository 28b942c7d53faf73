"""Drafters: how draft tokens are produced from the target's own layers."""

from strategies.drafters import layer_skip  # noqa: F401
