"""One CUDA graph per forward (``--cuda-graphs``, the ``forward`` route; issue 38, items 1 and 2).

`ForwardGraphs` runs a forward whose `framework.engine.execution.route.choose_route` says
``whole`` as ONE graph, from the token ids to the logits:

    embedding -> rotary -> every mask of the forward -> the plan's blocks -> final norm -> LM head
    [-> the token pick of a draft step, or the verifier's acceptance rule]

keyed by its `framework.engine.execution.spec.GraphKey`, recorded on first use and replayed after
that (`framework.engine.execution.store`). Why: on a GPU at batch 1 a forward's cost is its
launches; one graph of the whole forward took 3.20 ms a step of the SmolLM2-135M shape on an H200
where the branch route took 3.80 (docs/performance.md, "Fourth GPU session").

The KV cache keeps its books once per forward, outside the graph: `KVCache.begin` declares the
layers written (the attention layers the plan runs), the graph writes each of them at the slots
given by a per-layer first-slot vector on the device (one small host-to-device copy a forward), and
`KVCache.end` advances the pointers. Masks are computed inside the graph from that vector: causal
rows see every slot up to their own; tree rows see every slot before the block and, inside it, the
rows the tree mask allows. A reduced draft head runs eagerly after the graph (it grows between
rounds); the blocks before it are still one graph.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import fields
from typing import Any

import torch

from framework.engine.execution.blocks import run_blocks
from framework.engine.execution.branches import BranchGraphs
from framework.engine.execution.spec import ForwardSpec, GraphKey, RuleCall
from framework.engine.execution.store import span, spans
from framework.engine.execution.work import Draw, StaticOps, outputs_of
from framework.engine.kv_cache import KVCache
from framework.types import AcceptanceRule, Picked, pick_tokens


class ForwardGraphs:
    """Whole forwards of an architecture, each one graph on the branch graphs' store and pool.

    Attributes:
        forwards: forwards run through this route.
    """

    def __init__(
        self, branches: BranchGraphs, top1: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self.branches, self._top1 = branches, top1
        self.arch, self.store, self.pool = branches.arch, branches.store, branches.pool
        self.forwards = 0
        dev = branches.device
        with torch.inference_mode(False):
            self._first = torch.zeros(
                self.arch.num_layers, dtype=torch.long, device=dev
            )  # each layer's first slot
        self._ids: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def precapture(
        self,
        chain: Iterable[int] = (),
        tree: Iterable[int] = (),
        hidden: bool = False,
        checked: Iterable[int] = (),
        rule: tuple[AcceptanceRule, Hashable] | None = None,
    ) -> None:
        """Record, on the current pool, the full model's forwards of these token counts at every
        span: causal ones for ``chain`` (plain steps, chain verifications), token trees for
        ``tree``, their logits at every row, every block's residual too with ``hidden`` (a
        selector that reads them), and the ``checked`` chain sizes once more with the acceptance
        ``rule`` inside (a verifier's: the function and its derived key), which the trees hold too. Draft steps record on first use: their plans, heads and picks
        are the strategies' (a warm-up decode records them before timing). The recording forwards
        write garbage into the pool's slots, so the pool must not be lent."""
        fits = lambda ts: sorted({t for t in ts if 1 <= t <= self.branches.max_tokens})  # noqa: E731
        kinds = [(False, False, t) for t in fits(chain)]
        kinds += [(False, True, t) for t in fits(checked) if rule is not None]
        kinds += [(True, rule is not None, t) for t in fits(tree)]  # a tree is a verification
        for is_tree, ruled, t in kinds:
            ids, pos = self._inputs(t)
            ids.zero_()
            for s in spans(self.pool.capacity):
                pos.copy_(torch.arange(s - t, s, device=self.pool.device)[None])
                self._first.fill_(s - t)
                mask = None
                if is_tree:
                    mask = self.branches.tree_buffer(t)
                    mask.copy_(torch.ones(t, t, dtype=torch.bool).tril())
                fn, rkey = rule if ruled and rule is not None else (None, None)
                # the verification's own description, keyed as every forward is (never by hand)
                key = ForwardSpec(None, capture_hidden=hidden, tree_mask=mask).graph_key(
                    t, s, "model", rule=rkey
                )
                self.store.run(("forward", key), lambda key=key, fn=fn: self._forward(key, fn, (), ()))

    def run(
        self,
        spec: ForwardSpec,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        weights: str,
        rule: tuple[Hashable, tuple[Draw, ...]] | None = None,
        head: Hashable | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, Picked | None, dict | None]:
        """Run ``spec``'s graph on these inputs, keeping ``cache``'s books; with ``rule`` (the key
        of ``spec.rule`` and the draws it makes), the acceptance rule inside the graph: its inputs
        copied into static buffers and its draws made from the generation's stream before the
        replay (in order: what the eager rule draws).

        Returns:
            ``(logits, hidden_states, last_hidden, picked, ruled)``: logits (1, T, V) or ``None``
            when the graph has no head, hidden states (stop + 1, 1, T, d) or ``None``, the
            residual (1, T, d) where the forward stopped, the token its ``pick`` chose and what
            the rule returned (or ``None``); copies (the graph's own outputs are overwritten by
            its next replay).
        """
        t, plan = input_ids.shape[1], spec.plan
        base = spec.base if spec.base is not None else max(cache.lengths, default=0)
        key = spec.graph_key(t, span(base + t, self.pool.capacity), weights, rule, head)
        stop = spec.end(self.arch.num_layers)
        writes = [i for i in range(stop) if plan is None or plan.runs_attn(i)]
        ids, pos = self._inputs(t)
        ids.copy_(input_ids, non_blocking=True)
        pos.copy_(position_ids, non_blocking=True)
        if key.tree:
            self.branches.tree_buffer(t).copy_(spec.tree_mask, non_blocking=True)
        fn, ins, drawn = None, (), ()
        if rule is not None and key.rule is not None and spec.rule is not None:
            fn, ins, drawn = self._rule_inputs(key, spec.rule, rule[1])
        cache.begin(t, base=spec.base, tree_mask=spec.tree_mask, writes=writes)
        try:
            self._first.copy_(torch.tensor(cache.first_slots(), dtype=torch.long), non_blocking=True)
            head = None if spec.head is None else spec.head.fixed()
            out = self.store.run(("forward", key), lambda: self._forward(key, fn, ins, drawn, head))
        finally:
            cache.end()
        self.forwards += 1
        logits, hidden = out["logits"], out["hidden"]
        picked = None
        if "pick.tokens" in out:
            picked = Picked(**{f.name: out[f"pick.{f.name}"] for f in fields(Picked)}).clone()
        return (
            None if logits is None else logits.clone(),
            None if hidden is None else hidden.clone(),
            out["last"].clone(),
            picked,
            outputs_of(out["rule"]) if "rule" in out else None,
        )

    def _rule_inputs(
        self, key: GraphKey, call: RuleCall, draws: tuple[Draw, ...]
    ) -> tuple[AcceptanceRule, tuple, tuple[torch.Tensor, ...]]:
        """The rule's static inputs and draw buffers of ``key``'s graph, filled for this call."""
        dev = self.pool.device

        def make() -> tuple[tuple, tuple[torch.Tensor, ...]]:
            ins = tuple(None if x is None else torch.zeros_like(x) for x in call.inputs)
            return ins, tuple(torch.zeros(d.shape, dtype=d.dtype, device=dev) for d in draws)

        ins, drawn = self.store.buffers(("forward", key), make)
        for buf, x in zip(ins, call.inputs, strict=True):
            if buf is not None:
                buf.copy_(x, non_blocking=True)
        if draws:
            if call.random is None:
                raise RuntimeError("this generation has no random stream (the verifier declares none)")
            for buf, d in zip(drawn, draws, strict=True):
                call.random.fill(d.kind, buf)
        return call.fn, ins, drawn

    def _inputs(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        bufs = self._ids.get(t)
        if bufs is None:
            with torch.inference_mode(False):
                dev = self.pool.device
                bufs = self._ids[t] = (
                    torch.zeros(1, t, dtype=torch.long, device=dev),
                    torch.zeros(1, t, dtype=torch.long, device=dev),
                )
        return bufs

    def _forward(
        self,
        key: GraphKey,
        rule: AcceptanceRule | None,
        ins: tuple,
        drawn: tuple[torch.Tensor, ...],
        head: Any = None,
    ) -> dict[str, Any]:
        """The static forward of ``key``: reads only the static inputs and the KV pool; ``rule``
        (with its static inputs and draws) after the LM head, and the reduced draft ``head``
        instead of it, when the key holds them."""
        a, pool = self.arch, self.pool
        assert pool.arange is not None
        t, plan, s = key.rows, key.plan, key.span
        stop = a.num_layers if plan is None else plan.blocks_run
        ids, pos = self._inputs(t)
        h = a.embed(ids)
        pos_emb = a.rotary(h, pos)
        first = self._first[:stop]
        slots = first[:, None] + self.branches._offsets[:t][None, :]  # (stop, T): each layer's write slots
        ar = pool.arange[:s]
        if key.tree:  # every slot before the block, and the tree's own pattern inside it
            rel = ar[None, :] - first[:, None]  # (stop, span)
            inside = (rel >= 0) & (rel < t)
            among = self.branches.tree_buffer(t)[:, rel.clamp(0, t - 1)].permute(1, 0, 2)  # (stop, T, span)
            hidden_slots = ~((rel < 0)[:, None, :] | (among & inside[:, None, :]))
        else:  # causal: every slot up to the row's own
            hidden_slots = ar[None, None, :] > slots[:, :, None]  # (stop, T, span)
        masks = pool.mask(hidden_slots)

        def attention(i: int, x: torch.Tensor) -> torch.Tensor:
            return x + a.attention_branch(i, x, pos_emb, masks[i][None, None], pool.slots(slots[i], s))

        captured = [h] if key.hidden else None
        h = run_blocks(h, 0, stop, plan, attention, lambda i, x: x + a.mlp_branch(i, x), captured=captured)
        logits = None
        if key.logits == "all":
            logits = a.lm_head(a.final_norm(h))
        elif key.logits == "head":
            logits = head.logits(a.final_norm(h))
        out: dict[str, Any] = {
            "logits": logits,
            "hidden": None if captured is None else torch.stack(captured),
            "last": h,
        }
        if key.pick is not None and logits is not None:  # the graph's outputs: tensors
            picked = pick_tokens(logits[:, -1], key.pick, head if key.logits == "head" else None)
            out.update({f"pick.{f.name}": getattr(picked, f.name) for f in fields(Picked)})
        if key.rule is not None and rule is not None and logits is not None:
            out["rule"] = rule(StaticOps(self._top1, None, drawn), ids, logits, *ins)
        return out
