"""``layer_skip``: draft with the target model itself, skipping the plan's sub-layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from framework.interfaces import Draft, Drafter, LayerPlan, LengthController
from framework.registry import register_drafter


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
        want_conf = state.need_confidence
        want_probs = state.need_draft_probs
        top_k = state.draft_top_k
        tokens, confs, probs, top_toks, top_ps = [], [], [], [], []
        x = state.pending
        for step in range(max_tokens):
            logits = state.forward_draft(x, plan, logits_at="last").logits[:, -1]  # (B, V)
            conf = None
            if state.draft_sampler is not None:  # sampling: same warping as the verifier's target
                tok, p = state.draft_sampler(logits)  # p: warped q (B, V)
                top_p = p.max(dim=-1).values  # Draft & Verify Alg. 4: max_x q(x)
            elif want_conf or want_probs or top_k:
                p = torch.softmax(logits.float(), dim=-1)
                top_p, tok = p.max(dim=-1)
            else:
                p, top_p, tok = None, None, logits.argmax(dim=-1)
            if p is not None:
                if want_probs:
                    probs.append(p)
                if top_k:
                    vals, idx = p.topk(top_k, dim=-1)  # (B, k), sorted; idx[:, 0] is the argmax
                    top_toks.append(idx)
                    top_ps.append(vals)
                confs.append(top_p)
                conf = float(top_p[0])
            tokens.append(tok)
            if step + 1 >= max_tokens or not length.should_continue(step + 1, conf):
                break
            x = tok[:, None]
        return Draft(
            tokens=torch.stack(tokens, dim=1),
            plan=plan,
            confidences=torch.stack(confs, dim=1) if confs else None,
            probs=torch.stack(probs, dim=1) if probs else None,
            top_tokens=torch.stack(top_toks, dim=1) if top_toks else None,
            top_probs=torch.stack(top_ps, dim=1) if top_ps else None,
        )
