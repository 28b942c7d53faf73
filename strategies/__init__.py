"""Registered strategies, one file per name, grouped by interface.

Importing this package registers every shipped strategy (explicit imports, no directory scan).
"""

from strategies import drafters, length, selectors, verifiers  # noqa: F401
