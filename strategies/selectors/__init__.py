"""Layer selectors: which sub-layers the draft skips, or where it exits."""

from strategies.selectors import clasp_dp, del_tpl, selfsd_bo, static, swift  # noqa: F401
