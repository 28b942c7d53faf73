"""``static``: one fixed skip set for the whole run, uniform at a ratio or given explicitly."""

from __future__ import annotations

from dataclasses import dataclass

from framework import LayerPlan, LayerSelector, ModelInfo, RoundView, register_selector
from framework.config_fields import ConfigError, check_range, check_types, param


@dataclass(frozen=True)
class StaticSelectorConfig:
    skip_ratio: float = param(
        0.2,
        help="fraction of the eligible attention+MLP sub-layers to skip, spread uniformly; in [0, 1). "
        "Ignored when skip_attn or skip_mlp is given.",
    )
    skip_attn: tuple[int, ...] = param((), help="explicit block indices whose attention sub-layer is skipped")
    skip_mlp: tuple[int, ...] = param((), help="explicit block indices whose MLP sub-layer is skipped")
    keep_first_last: bool = param(
        True, help="never skip the first and last block in uniform mode (SWIFT's convention)"
    )

    def __post_init__(self) -> None:
        check_types(self)
        check_range("skip_ratio", self.skip_ratio, 0.0, 1.0, hi_open=True)
        for name in ("skip_attn", "skip_mlp"):
            idx = getattr(self, name)
            if any(not isinstance(i, int) or i < 0 for i in idx):
                raise ConfigError(name, idx, "non-negative block indices")

    @property
    def explicit(self) -> bool:
        return bool(self.skip_attn or self.skip_mlp)


def spread(n: int, slots: list[int], offset: float) -> list[int]:
    """``n`` items of ``slots`` spread evenly, the k-th at fraction (k + offset) / n."""
    if n <= 0:
        return []
    m = len(slots)
    return sorted({slots[min(m - 1, int((k + offset) * m / n))] for k in range(n)})


def uniform_plan(num_layers: int, ratio: float, keep_first_last: bool = True) -> LayerPlan:
    """Skip ``floor(ratio * 2 * L_eff)`` sub-layers spread evenly over the eligible blocks.

    Attention and MLP sub-layers are spread separately (attention gets the odd one), the MLP picks
    offset by half a step so that the two kinds interleave instead of emptying the same blocks.
    With ``keep_first_last`` the eligible blocks are ``1..L-2`` (L_eff = L - 2), as in SWIFT.
    """
    eligible = (
        list(range(1, num_layers - 1)) if keep_first_last and num_layers > 2 else list(range(num_layers))
    )
    n = int(ratio * 2 * len(eligible))
    n_attn, n_mlp = (n + 1) // 2, n // 2
    attn = spread(n_attn, eligible, 0.5)
    mlp = spread(n_mlp, eligible, 0.0 if n_mlp != n_attn else 0.25)
    return LayerPlan.from_indices(num_layers, attn=attn, mlp=mlp)


@register_selector("static", config=StaticSelectorConfig)
class StaticSelector(LayerSelector):
    """A fixed skip set: uniform at ``skip_ratio`` over attention and MLP sub-layers, or explicit.

    The baseline every adaptive selector is compared with; an explicit set reproduces a published
    skip set (e.g. Draft & Verify's released LLaMA-2 sets) on a new model.
    """

    shares_plan = True  # one plan for every row of a batch

    def setup(self, info: ModelInfo) -> None:
        c, n = self.config, info.num_layers
        if c.explicit:
            for name in ("skip_attn", "skip_mlp"):
                bad = [i for i in getattr(c, name) if i >= n]
                if bad:
                    raise ConfigError(
                        f"--selector.{name}", getattr(c, name), f"block indices in [0, {n - 1}]"
                    )
            self._plan = LayerPlan.from_indices(n, attn=c.skip_attn, mlp=c.skip_mlp)
        else:
            self._plan = uniform_plan(n, c.skip_ratio, c.keep_first_last)
        if self._plan.num_skipped == 2 * n:
            raise ConfigError(
                "--selector", self._plan.describe(), "a skip set that leaves at least one sub-layer"
            )

    def plan(self, state: RoundView) -> LayerPlan:
        return self._plan

    def summary(self) -> dict:
        return {"plan": self._plan.describe()}
