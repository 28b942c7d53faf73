"""``layer_skip``: draft with the target model itself, skipping the plan's sub-layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework import Draft, Drafter, LayerPlan, LengthController, Verification, register_drafter
from framework.engine.drafting import DraftBuilder
from framework.policies.draft_vocab import DraftVocab, DraftVocabConfig


@dataclass(frozen=True)
class LayerSkipDrafterConfig(DraftVocabConfig):
    pass


@register_drafter("layer_skip", config=LayerSkipDrafterConfig)
class LayerSkipDrafter(DraftVocab, Drafter):
    """Draft with the target itself, skipping the plan's attention and MLP sub-layers.

    The drafting of Draft & Verify (Zhang et al., ACL 2024), SWIFT (Xia et al., ICLR 2025) and
    CLaSp (Chen et al., 2025).

    The draft reuses the committed target KV; its own KV goes only into the layers it runs and
    is discarded by verification. An early-exit plan (``exit_layer``) also works here. With
    ``draft_vocab`` K the draft scores only the model's K most frequent tokens
    (`framework.policies.draft_vocab`).
    """

    def draft(self, state, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        out = DraftBuilder(state)
        x = state.pending
        for step in range(max_tokens):
            fwd = state.forward_draft(x, plan, logits_at="last")
            tok, conf = out.add(fwd.logits[:, -1], fwd.head)  # logits (B, V), or (B, K) over the head
            if step + 1 >= max_tokens or not length.should_continue(step + 1, conf):
                break
            x = tok[:, None]
        return out.build(plan)

    def observe(self, state, draft: Draft, result: Verification) -> None:
        self.follow_head(state)

    def summary(self) -> dict[str, Any]:
        return self.head_summary()
