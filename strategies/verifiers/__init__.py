"""Verifiers: which draft tokens are accepted."""

from strategies.verifiers import greedy  # noqa: F401
