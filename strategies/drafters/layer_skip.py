"""``layer_skip``: draft with the target model itself, skipping the plan's sub-layers."""

from __future__ import annotations

from dataclasses import dataclass

from framework import Draft, Drafter, LayerPlan, LengthController, register_drafter
from framework.engine.drafting import DraftBuilder


@dataclass(frozen=True)
class LayerSkipDrafterConfig:
    pass


@register_drafter("layer_skip", config=LayerSkipDrafterConfig)
class LayerSkipDrafter(Drafter):
    """Draft with the target itself, skipping the plan's attention and MLP sub-layers.

    The drafting of Draft & Verify (Zhang et al., ACL 2024), SWIFT (Xia et al., ICLR 2025) and
    CLaSp (Chen et al., 2025).

    The draft reuses the committed target KV; its own KV goes only into the layers it runs and
    is discarded by verification. An early-exit plan (``exit_layer``) also works here.
    """

    def draft(self, state, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        out = DraftBuilder(state)
        x = state.pending
        for step in range(max_tokens):
            logits = state.forward_draft(x, plan, logits_at="last").logits[:, -1]  # (B, V)
            tok, conf = out.add(logits)
            if step + 1 >= max_tokens or not length.should_continue(step + 1, conf):
                break
            x = tok[:, None]
        return out.build(plan)
