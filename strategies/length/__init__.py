"""Length controllers: how many tokens to draft and when to stop drafting."""

from strategies.length import confidence, fixed  # noqa: F401
