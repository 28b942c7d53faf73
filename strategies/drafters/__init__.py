"""Drafters: how draft tokens are produced from the target's own layers (or copied from the context)."""

from strategies.drafters import cascade, early_exit, grammar_forced, hybrid, layer_skip, prompt_lookup  # noqa: F401
