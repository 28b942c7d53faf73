"""``early_exit``: draft with the first E blocks + final norm + LM head, reusing them in verification."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from framework import (
    Draft,
    Drafter,
    LayerPlan,
    LengthController,
    ModelInfo,
    RoundView,
    Verification,
    register_drafter,
)
from framework.config import ConfigError, check_choice, check_range, param
from framework.drafting.builder import DraftBuilder
from framework.drafting.draft_vocab import DraftVocab, DraftVocabConfig


@dataclass(frozen=True)
class EarlyExitDrafterConfig(DraftVocabConfig):
    exit_layer: int | None = param(
        None,
        help="exit layer E used when the plan sets none (a selector such as static); in [1, L-1]. "
        "None derives E from exit_ratio",
    )
    exit_ratio: float = param(
        0.25,
        help="E = round(exit_ratio * L), clamped to [1, L-1], when exit_layer is None; in (0, 1). "
        "0.25 is LayerSkip's E = 8 of 32 on LLaMA-2-7B",
    )
    reuse_kv: bool = param(
        True,
        help="verification keeps the draft's KV and hidden states of blocks < E and computes only "
        "blocks >= E for the drafted positions (LayerSkip's shared cache); false recomputes them. "
        "Off whatever is set here when draft_weights is compressed (those blocks are not the target's)",
    )
    on_stop: Literal["keep", "drop"] = param(
        "keep",
        help="'keep': the token after which the length controller stopped drafting is verified "
        "(D&V / SWIFT code, this framework's convention); 'drop': it is discarded, as DEL's "
        "Algorithm 1 breaks before appending (a round may then draft nothing)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.exit_layer is not None:
            check_range("exit_layer", self.exit_layer, 1, None, integer=True)
        check_range("exit_ratio", self.exit_ratio, 0.0, 1.0, lo_open=True, hi_open=True)
        check_choice("reuse_kv", self.reuse_kv, (True, False))
        check_choice("on_stop", self.on_stop, ("keep", "drop"))


def default_exit_layer(num_layers: int, exit_layer: int | None, exit_ratio: float) -> int:
    """E from the config: ``exit_layer`` or ``round(exit_ratio * L)``, within ``[1, L-1]``."""
    if exit_layer is not None:
        return exit_layer
    return max(1, min(num_layers - 1, round(exit_ratio * num_layers)))


@register_drafter("early_exit", config=EarlyExitDrafterConfig)
class EarlyExitDrafter(DraftVocab, Drafter):
    """Draft with the first E blocks of the target, then its final norm and LM head.

    LayerSkip's self-speculation (Elhoushi et al., ACL 2024) and the drafting of DEL (Entezari
    Zarch et al., 2025). E is the plan's ``exit_layer`` (set by ``del_tpl``), else the config's
    default. The plan's skip bits are ignored: the draft is always the unchanged prefix, so that
    its blocks compute exactly what the target computes.

    With ``reuse_kv`` the draft steps are declared reusable (``DecodeState.forward_draft``): the
    chain verification keeps the draft's KV and hidden states of blocks ``0..E-1`` for the drafted
    positions and runs blocks ``E..L-1`` only there (all blocks for a position never fed to the
    draft, usually the last draft token). Tree verification always recomputes. With ``draft_vocab``
    K the draft scores only the model's K most frequent tokens (`framework.drafting.draft_vocab`).
    """

    def __init__(self, config: EarlyExitDrafterConfig | None = None) -> None:
        super().__init__(config)
        self._default_exit = 1
        self._num_layers = 0
        self._reuse: dict[str, int] | None = None  # the generation's reuse counters, after a round
        self._counts = {"rounds": 0, "draft_steps": 0, "dropped": 0}

    def setup(self, info: ModelInfo) -> None:
        c, n = self.config, info.num_layers
        if n < 2:
            raise ConfigError("--drafter", "early_exit", f"a model with at least 2 blocks (it has {n})")
        if c.exit_layer is not None and not 1 <= c.exit_layer < n:
            raise ConfigError(
                "--drafter.exit_layer", c.exit_layer, f"in [1, {n - 1}] (the model has {n} blocks)"
            )
        self._num_layers = n
        self._default_exit = default_exit_layer(n, c.exit_layer, c.exit_ratio)

    def reset(self) -> None:
        self._reuse = None
        self._counts = {"rounds": 0, "draft_steps": 0, "dropped": 0}

    def exit_layer(self, plan: LayerPlan) -> int:
        """The E this round drafts with (the plan's, else the configured default)."""
        n = plan.num_layers
        if plan.exit_layer is None:
            if not self._num_layers:  # not set up: derive from the plan's depth
                return default_exit_layer(n, self.config.exit_layer, self.config.exit_ratio)
            return self._default_exit
        if not 1 <= plan.exit_layer < n:
            raise ValueError(
                f"early_exit: the plan's exit_layer must be in [1, {n - 1}], got {plan.exit_layer}"
            )
        return plan.exit_layer

    def draft(self, state: RoundView, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        e = self.exit_layer(plan)
        prefix = state.prefix_plan(e)
        reuse = self.config.reuse_kv and not state.compressed_drafts  # int8 blocks are not the target's
        out = DraftBuilder(state)
        self._counts["rounds"] += 1
        x = state.pending
        for step in range(max_tokens):
            fwd = state.forward_draft(x, prefix, logits_at="last", reusable=reuse)
            self._counts["draft_steps"] += 1
            tok, conf = out.add(fwd.logits[:, -1], fwd.head)  # logits (B, V), or (B, K) over the head
            if step + 1 >= max_tokens:
                break
            if not length.should_continue(step + 1, conf):
                if self.config.on_stop == "drop":
                    # DEL: break before appending. The step's blocks < E ran on the last kept
                    # token, so the verification still reuses them for that position.
                    out.drop_last(conf)  # raises for a sampled token dropped by its own probability
                    self._counts["dropped"] += 1
                break
            x = tok[:, None]
        return out.build(prefix)

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        self.follow_head(state)
        stats = state.stats
        self._reuse = {
            "verify_blocks_saved": stats.verify_blocks_saved,
            "reused_positions": stats.reused_positions,
        }

    def summary(self) -> dict[str, Any]:
        return {
            "default_exit_layer": self._default_exit,
            **self._counts,
            **(self._reuse or {}),
            **self.head_summary(),
        }
