"""Length controllers: how many tokens to draft and when to stop drafting."""

from strategies.length import adaptive_confidence, confidence, del_dynamic, finite_state, fixed  # noqa: F401
