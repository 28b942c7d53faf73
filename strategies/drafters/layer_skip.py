"""``layer_skip``: draft with the target model itself, skipping the plan's sub-layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from framework import (
    Draft,
    Drafter,
    DraftView,
    LayerPlan,
    LengthController,
    RoundView,
    Verification,
    register_drafter,
)
from framework.config_fields import param
from framework.drafting.draft_vocab import DraftVocab, DraftVocabConfig


@dataclass(frozen=True)
class LayerSkipDrafterConfig(DraftVocabConfig):
    on_stop: Literal["keep", "drop"] = param(
        "keep",
        help="'keep': the token after which the length controller stopped drafting is verified "
        "(Draft & Verify's and SWIFT's released code, this framework's convention); 'drop': it is "
        "discarded, breaking before appending (the CLaSp reference's reading of CLaSp's draft-exiting "
        "threshold, which the paper leaves open; as early_exit's 'drop'); a round may then draft nothing",
    )

    def __post_init__(self) -> None:
        super().__post_init__()


@register_drafter("layer_skip", config=LayerSkipDrafterConfig)
class LayerSkipDrafter(DraftVocab, Drafter):
    """Draft with the target itself, skipping the plan's attention and MLP sub-layers.

    The drafting of Draft & Verify (Zhang et al., ACL 2024), SWIFT (Xia et al., ICLR 2025) and
    CLaSp (Chen et al., 2025).

    The draft reuses the committed target KV; its own KV goes only into the layers it runs and
    is discarded by verification. An early-exit plan (``exit_layer``) also works here. With
    ``draft_vocab`` K the draft scores only the model's K most frequent tokens
    (`framework.drafting.draft_vocab`).

    With ``on_stop="drop"`` the token after which the length controller stopped (below a
    confidence threshold) is discarded instead of verified; the token at the cap is always kept.
    """

    def __init__(self, config: LayerSkipDrafterConfig | None = None) -> None:
        super().__init__(config)
        self._dropped = 0

    def reset(self) -> None:
        self._dropped = 0

    def draft(self, state: DraftView, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        x = state.pending
        for step in range(max_tokens):
            tok, conf = state.draft_step(x, plan)  # the engine chooses the token (B,)
            if step + 1 >= max_tokens:
                break
            if not length.should_continue(step + 1, conf):
                if self.config.on_stop == "drop":
                    state.drop_draft_step(conf)  # raises for a sampled token dropped by its own probability
                    self._dropped += 1
                break
            x = tok[:, None]
        return state.drafted(plan)

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        self.follow_head(state)

    def summary(self) -> dict[str, Any]:
        if self.config.on_stop == "drop":
            return {"dropped": self._dropped, **self.head_summary()}
        return self.head_summary()
