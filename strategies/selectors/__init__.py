"""Layer selectors: which sub-layers the draft skips, or where it exits."""

from strategies.selectors import static  # noqa: F401
