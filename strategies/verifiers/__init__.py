"""Verifiers: which draft tokens are accepted."""

from strategies.verifiers import greedy, sampling, tree  # noqa: F401
