"""``early_exit``: draft with the first E blocks + final norm + LM head, reusing them in verification."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Literal

from framework import (
    Draft,
    Drafter,
    DraftView,
    LayerPlan,
    LengthController,
    ModelInfo,
    RoundView,
    Verification,
    register_drafter,
)
from framework.config_fields import ConfigError, check_range, param
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
    checkpoint_exit: bool = param(
        True,
        help="on a LayerSkip checkpoint (facebook/layerskip-*, recognised by its name: "
        "LAYERSKIP_EXITS), exit where the papers did instead of at exit_ratio; an explicit "
        "exit_layer still wins",
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


@dataclass(frozen=True)
class CheckpointExit:
    """Where the papers exit on one LayerSkip checkpoint (Elhoushi et al., ACL 2024, trained for
    early exit with layer dropout and an early-exit loss).

    Attributes:
        num_layers: the checkpoint's depth L (a model of another depth is not that checkpoint).
        exit_layer: E.
        draft_length: the gamma used with it.
        source: which paper and table chose it.
    """

    num_layers: int
    exit_layer: int
    draft_length: int
    source: str


#: The LayerSkip checkpoints and the exit the papers used, by the checkpoint's name (lower case,
#: the part after ``layerskip-``). Where LayerSkip's own choice is known (DEL's ``LS†``,
#: Entezari Zarch et al. 2025, App. B: HumanEval on LLaMA-2-7B and -13B) it is used; elsewhere
#: DEL's grid-searched LayerSkip baseline (Table 1).
LAYERSKIP_EXITS: dict[str, CheckpointExit] = {
    "llama2-7b": CheckpointExit(
        32, 8, 6, "LayerSkip's E8-gamma6 (HumanEval; 8-12 for summarisation), DEL App. B"
    ),
    "llama2-13b": CheckpointExit(40, 7, 4, "LayerSkip's E7-gamma4 (HumanEval; E15 for XSUM), DEL App. B"),
    "llama2-70b": CheckpointExit(80, 9, 6, "DEL Table 1, grid-searched LayerSkip baseline E9-gamma6"),
    "codellama-7b": CheckpointExit(32, 7, 6, "DEL Table 1, grid-searched LayerSkip baseline E7-gamma6"),
    "codellama-34b": CheckpointExit(48, 9, 6, "DEL Table 1, grid-searched LayerSkip baseline E9-gamma6"),
    "llama3-8b": CheckpointExit(32, 3, 6, "DEL Table 1, grid-searched LayerSkip baseline E3-gamma6"),
    "llama3.2-1b": CheckpointExit(16, 3, 6, "DEL Table 1, grid-searched LayerSkip baseline E3-gamma6"),
}


def layerskip_checkpoint(name: str, num_layers: int) -> CheckpointExit | None:
    """The `LAYERSKIP_EXITS` entry of a model named ``name`` (a hub id such as
    ``facebook/layerskip-llama2-7B`` or a local directory of that name), if its depth matches;
    else ``None``."""
    m = re.search(r"layerskip-([a-z0-9.\-]+?)(?:-hf)?$", PurePath(name.rstrip("/")).name.lower())
    entry = LAYERSKIP_EXITS.get(m.group(1)) if m else None
    return entry if entry is not None and entry.num_layers == num_layers else None


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
        #: the LayerSkip checkpoint recognised at set-up (its paper's exit), or ``None``
        self.checkpoint: CheckpointExit | None = None
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
        self.checkpoint = layerskip_checkpoint(info.name, n) if c.checkpoint_exit else None
        if self.checkpoint is not None and c.exit_layer is None:
            self._default_exit = self.checkpoint.exit_layer
        else:
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

    def draft(self, state: DraftView, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        e = self.exit_layer(plan)
        prefix = state.prefix_plan(e)
        reuse = self.config.reuse_kv and not state.compressed_drafts  # int8 blocks are not the target's
        self._counts["rounds"] += 1
        x = state.pending
        for step in range(max_tokens):
            tok, conf = state.draft_step(x, prefix, reusable=reuse)  # the engine chooses the token (B,)
            self._counts["draft_steps"] += 1
            if step + 1 >= max_tokens:
                break
            if not length.should_continue(step + 1, conf):
                if self.config.on_stop == "drop":
                    # DEL: break before appending. The step's blocks < E ran on the last kept
                    # token, so the verification still reuses them for that position.
                    state.drop_draft_step(conf)  # raises for a sampled token dropped by its own probability
                    self._counts["dropped"] += 1
                break
            x = tok[:, None]
        return state.drafted(prefix)

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
            **({"checkpoint_exit": self.checkpoint.source} if self.checkpoint is not None else {}),
            **self._counts,
            **(self._reuse or {}),
            **self.head_summary(),
        }
