"""One CUDA graph per forward (``--cuda-graphs``, the ``forward`` route; issue 38, items 1 and 2).

What a forward computes is a `ForwardSpec`: its layer plan, its number of rows, its attention span
(the used length rounded up to a power of two), which logits it returns, whether it returns every
block's residual, whether its rows form a token tree, and which weights it runs. `ForwardGraphs`
runs a forward of a given spec as ONE graph, from the token ids to the logits:

    embedding -> rotary -> every mask of the forward -> the plan's blocks -> final norm -> LM head

recorded on first use (counted and timed in ``BranchGraphs.captures`` / ``capture_seconds``: the
decoders report the captures inside each timed generation) and replayed after that. Why: on a GPU
at batch 1 a forward's cost is its launches. The branch route (one graph per attention or MLP
branch, `framework.kernels.graphs`) still launches about 120 eager kernels and 60 replays a step of
a 30-block model and did the KV cache's bookkeeping per layer on the host; one graph of the whole
forward took 3.20 ms a step of the SmolLM2-135M shape on an H200 where the branch route took 3.80
(docs/performance.md, "Fourth GPU session").

The KV cache keeps its books once per forward, outside the graph: `KVCache.begin` declares the
layers written (the attention layers the plan runs), the graph writes each of them at the slots
given by a per-layer first-slot vector on the device (one small host-to-device copy a forward), and
`KVCache.end` advances the pointers. Masks are computed inside the graph from that vector: causal
rows see every slot up to their own; tree rows see every slot before the block and, inside it, the
rows the tree mask allows (copied into a static buffer).

What takes the route: forwards of one sequence of 1 to ``max_tokens`` rows on the graphs' KV pool
that write after the slots they see (plain steps, draft steps of any plan, chain and tree
verifications). Prefills, scratch passes that hide part of the prefix (SWIFT's scoring, CLaSp's
block evaluations), verifications that start inside the model (early-exit reuse) and models split
across devices take the branch route or run eagerly. A reduced draft head runs eagerly after the
graph (it grows between rounds); the blocks before it are still one graph.

A strategy's own per-round device work (DEL's statistics over the verified chain) can take the
route too: `ForwardGraphs.run_work` records a strategy's function (`framework.view.RoundView.compute`)
as one graph per key the engine derived (`framework.engine.work`), its model work included (DEL's
shadow tokens; CLaSp's dynamic programme, whose L block calls run on candidate states of a
committed position against the pool, and their glue).

Graphs live in a bounded cache (`max_graphs`, least recently used dropped first): plans that
change every round (SWIFT's search, CLaSp, DEL) record a graph per new plan, and a bound keeps
their number finite. A dropped graph stays alive while others live (their cuBLAS workspace,
`framework.kernels.graphs`); once as many are retired as the bound, every graph is dropped and the
pool starts anew.

``capture=False`` runs the same static function without capturing it: on a CPU this is how the
tests check the route's arithmetic and books; a stand-in recorder checks the cache's bookkeeping.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from framework.engine.architecture import Architecture
from framework.engine.kv_cache import KVCache
from framework.engine.work import Draw, RandomStream, StaticOps, outputs_of
from framework.kernels.graphs import BranchGraphs, _SlotCache
from framework.types import GreedyCheck, LayerPlan, Picked, TokenPick, greedy_check, pick_tokens

#: Whole-forward graphs kept at once (`ForwardGraphs.max_graphs`).
MAX_GRAPHS = 256
#: The shortest attention span of a whole forward; longer ones grow by 4x (`ForwardGraphs.span`).
#: Coarse, because a span costs little: on an H200 a step of the SmolLM2 shape read 2,048 slots in
#: 4.6% more time than 256 (docs/performance.md), while every span is one more graph per spec.
MIN_SPAN = 2048


@dataclass(frozen=True)
class ForwardSpec:
    """What one forward computes: the key of its graph.

    Attributes:
        plan: the layer plan (``None``: every sub-layer).
        rows: T, the tokens of the forward.
        span: the attention span (slots read), a power of two.
        logits: ``"all"`` (every row's; a caller's ``"last"`` or positions are taken from them
            after the graph) or ``"none"`` (no LM head in the graph: a reduced draft head runs
            after it).
        hidden: return every block's residual (index 0: the embedding).
        tree: the rows form a token tree (a tree mask), else a causal chain.
        weights: ``"model"`` or a draft's low-bit format (`framework.kernels.lowbit`).
        pick: the token chosen from the last row's logits in the graph
            (`framework.types.TokenPick`), or ``None``.
        check: the greedy verification of the block's own tokens in the graph
            (`framework.types.greedy_check`).
    """

    plan: LayerPlan | None
    rows: int
    span: int
    logits: str = "all"
    hidden: bool = False
    tree: bool = False
    weights: str = "model"
    pick: TokenPick | None = None
    check: bool = False


class ForwardGraphs:
    """Forwards of an architecture, each as one graph on a `BranchGraphs` store's KV pool.

    Args:
        arch: the model's architecture.
        store: the graph store: the KV pool, the recorder and the counters.
        max_graphs: whole-forward graphs kept (least recently used dropped first).

    Attributes:
        forwards: forwards run through this route.
        static_runs: strategies' own functions run through it (`run_work`).
        evicted: graphs dropped for the bound.
        resets: times every graph was dropped because too many were retired.
    """

    def __init__(self, arch: Architecture, store: BranchGraphs, *, max_graphs: int = MAX_GRAPHS) -> None:
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.arch = arch
        self.store = store
        self.max_graphs = max_graphs
        self.forwards = 0
        self.evicted = 0
        self.resets = 0
        self._used: OrderedDict[ForwardSpec | tuple, None] = OrderedDict()
        #: `run_work`'s graphs: ("work", key) -> the static input buffers and draw buffers
        self._static: dict[tuple, tuple[tuple, tuple[torch.Tensor, ...]]] = {}
        self.static_runs = 0
        dev, n = store.device, arch.num_layers
        with torch.inference_mode(False):
            self._first = torch.zeros(n, dtype=torch.long, device=dev)  # each layer's first slot
            self._at = torch.zeros(2, dtype=torch.long, device=dev)  # `run_work`'s block position, slot
            self._offsets = torch.arange(store.max_tokens, device=dev)
        self._ids: dict[int, torch.Tensor] = {}
        self._pos: dict[int, torch.Tensor] = {}
        self._tree: dict[int, torch.Tensor] = {}
        self._arange: torch.Tensor | None = None

    # ---- which forwards --------------------------------------------------------------------
    def spec(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        *,
        plan: LayerPlan | None,
        start: int,
        stop: int | None,
        logits_at: Any,
        capture_hidden: bool,
        base: int | None,
        visible: int | None,
        tree_mask: torch.Tensor | None,
        persist: bool,
        head: Any,
        weights: str = "model",
        pick: TokenPick | None = None,
        check: bool = False,
    ) -> ForwardSpec | None:
        """The spec of this forward if it can take a whole graph, else ``None`` (see the module's
        docstring for what can)."""
        b, t = input_ids.shape
        store = self.store
        if b != 1 or not 1 <= t <= store.max_tokens or cache.empty or not store.holds(cache):
            return None
        default_stop = self.arch.num_layers if plan is None else plan.blocks_run
        if start != 0 or (stop is not None and stop != default_stop) or not persist:
            return None
        if visible is not None and visible != base:
            return None
        end = (base if base is not None else max(cache.lengths, default=0)) + t
        if end > store.capacity:
            return None
        if head is not None or logits_at is None:
            logits = "none"  # a reduced draft head runs after the graph (and its caller picks)
            pick = None
        else:
            logits = "all"  # "last" and positions: taken from every row's logits after the graph
        return ForwardSpec(
            plan,
            t,
            self.span(end),
            logits,
            capture_hidden,
            tree_mask is not None,
            weights,
            pick,
            check and logits == "all",
        )

    def span(self, end: int) -> int:
        """The attention span of a forward whose new tokens end at slot ``end``: `MIN_SPAN`, times
        4 until it holds ``end``, at most the pool's capacity."""
        cap = self.store.capacity
        span = min(cap, MIN_SPAN)
        while span < end and span < cap:
            span = min(cap, span * 4)
        return span

    def spans(self) -> list[int]:
        """Every span a forward on the current pool can use."""
        out = [self.span(1)]
        while out[-1] < self.store.capacity:
            out.append(self.span(out[-1] + 1))
        return out

    def precapture(
        self,
        chain: Iterable[int] = (),
        tree: Iterable[int] = (),
        hidden: bool = False,
        checked: Iterable[int] = (),
    ) -> None:
        """Record, on the current pool, the full model's forwards of these token counts at every
        span (`spans`): causal ones for ``chain`` (plain steps, chain verifications), token trees
        for ``tree``, their logits at every row (a plain step's "last" is its one row), and every
        block's residual too with ``hidden`` (a selector that reads them), and the ``checked``
        chain sizes once more with the greedy check inside (a greedy verifier's). Draft steps
        record on first use: their plans, heads and picks are the strategies' (a warm-up decode
        records them before timing). The recording forwards write garbage into the pool's slots,
        so the pool must not be lent (between generations)."""
        fits = lambda ts: sorted({t for t in ts if 1 <= t <= self.store.max_tokens})  # noqa: E731
        kinds = [(False, False, t) for t in fits(chain)] + [(False, True, t) for t in fits(checked)]
        kinds += [(True, False, t) for t in fits(tree)]
        for is_tree, check, t in kinds:
            ids, pos = self._inputs(t)
            ids.zero_()
            for span in self.spans():
                pos.copy_(torch.arange(span - t, span, device=self.store.device)[None])
                self._first.fill_(span - t)
                if is_tree:
                    self._tree_buffer(t).copy_(torch.ones(t, t, dtype=torch.bool).tril())
                spec = ForwardSpec(None, t, span, "all", hidden, is_tree, "model", check=check)
                self.store.run(("forward", spec), lambda spec=spec: self._forward(spec))
                self._touch(spec)

    # ---- running one -----------------------------------------------------------------------
    def run(
        self,
        spec: ForwardSpec,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        *,
        base: int | None,
        tree_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, Picked | None, GreedyCheck | None]:
        """Run ``spec``'s graph on these inputs, keeping ``cache``'s books.

        Returns:
            ``(logits, hidden_states, last_hidden, picked, checked)``: logits (1, T or 1, V) or
            ``None`` when the spec's are ``"none"``, hidden states (stop + 1, 1, T, d) or
            ``None``, the residual (1, T, d) where the forward stopped, the token the spec's
            ``pick`` chose and the greedy verification its ``check`` asked for (or ``None``);
            copies (the graph's own outputs are overwritten by its next replay).
        """
        t, plan = spec.rows, spec.plan
        n = self.arch.num_layers
        stop = n if plan is None else plan.blocks_run
        writes = [i for i in range(stop) if plan is None or plan.runs_attn(i)]
        ids, pos = self._inputs(t)
        ids.copy_(input_ids, non_blocking=True)
        pos.copy_(position_ids, non_blocking=True)
        if spec.tree:
            self._tree_buffer(t).copy_(tree_mask, non_blocking=True)
        cache.begin(t, base=base, tree_mask=tree_mask, writes=writes)
        try:
            first = cache.first_slots()
            self._first.copy_(torch.tensor(first, dtype=torch.long), non_blocking=True)
            out = self.store.run(("forward", spec), lambda: self._forward(spec))
        finally:
            cache.end()
        self.forwards += 1
        self._touch(spec)
        logits = out["logits"]
        hidden = out["hidden"]
        picked = checked = None
        if "pick.tokens" in out:
            picked = Picked(**{f.name: out[f"pick.{f.name}"] for f in fields(Picked)}).clone()
        if "check.target" in out:
            checked = GreedyCheck(**{f.name: out[f"check.{f.name}"] for f in fields(GreedyCheck)}).clone()
        return (
            None if logits is None else logits.clone(),
            None if hidden is None else hidden.clone(),
            out["last"].clone(),
            picked,
            checked,
        )

    def run_work(
        self,
        key: Hashable,
        fn: Callable[..., Any],
        inputs: tuple[torch.Tensor | None, ...],
        params: Mapping[str, Any],
        *,
        draws: tuple[Draw, ...],
        random: RandomStream | None,
        top1: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        position: int | None = None,
        cache: KVCache | None = None,
    ) -> Any:
        """A strategy's device function ``fn(ops, *inputs, **params)`` as one graph
        (`framework.engine.work.DeviceWork.execute`, which derived ``key``).

        The graph is keyed by ``key`` (which holds the inputs' shapes), recorded on first use
        (counted and timed with the forwards' in ``BranchGraphs.captures``) and bounded with them
        (`max_graphs`, least recently used dropped first). Each call copies the inputs into the
        graph's static buffers, draws ``draws`` from ``random`` into its draw buffers (in order:
        what the eager function draws), and returns copies of its outputs.

        With a committed ``position``, ``ops.block(b, states)`` runs block b on n candidate states
        of that position against the pool: each attends to the slots before ``position`` and to
        its own key and value, written in scratch slots after every layer's end (left unclaimed:
        the cache's books do not change). The position and the scratch slot are device inputs;
        the attention span, which covers the most candidates a forward may have, is part of the key.

        Returns:
            the copies, or ``None`` when the pool cannot serve ``cache`` for ``position`` (run it
            eagerly then).
        """
        store = self.store
        block = None
        if position is not None:
            assert cache is not None
            base, rows = max(cache.lengths), store.max_tokens
            if not (store.holds(cache) and 0 <= position < cache.committed) or base + rows > store.capacity:
                return None
            span = self.span(base + rows)
            key = ("blocks", key, span)
            self._at.copy_(torch.tensor([position, base], dtype=torch.long), non_blocking=True)
            block = functools.partial(self._static_block, span=span)
        spec = ("work", key)
        bufs = self._static.get(spec)
        if bufs is None:
            with torch.inference_mode(False):
                ins = tuple(None if t is None else torch.zeros_like(t) for t in inputs)
                drawn = tuple(torch.zeros(d.shape, dtype=d.dtype, device=store.device) for d in draws)
            bufs = self._static[spec] = (ins, drawn)
        ins, drawn = bufs
        for buf, t in zip(ins, inputs, strict=True):
            if buf is not None:
                buf.copy_(t, non_blocking=True)
        if draws:
            if random is None:
                raise RuntimeError("this generation has no random stream (the verifier declares none)")
            for buf, d in zip(drawn, draws, strict=True):
                random.fill(d.kind, buf)
        out = store.run(spec, lambda: fn(StaticOps(top1, block, drawn), *ins, **params))
        self.static_runs += 1
        self._touch(spec)
        return outputs_of(out)

    def _static_block(self, b: int, states: torch.Tensor, *, span: int) -> torch.Tensor:
        """Block ``b`` on candidate states (n, d) at the position in ``_at[0]``, their keys and
        values written from slot ``_at[1]`` on: the static form of `DecodeState.forward_block`."""
        a, store = self.arch, self.store
        assert store.keys is not None and store.values is not None
        n = states.shape[0]
        h = states[None]  # (1, n, d): one sequence of n candidates
        pos_emb = a.rotary(h, self._at[:1].expand(1, n))
        slots = self._at[1] + self._offsets[:n]  # (n,)
        ar = self._slots_arange()[:span]
        hidden_slots = (ar[None, :] >= self._at[0]) & (ar[None, :] != slots[:, None])  # (n, span)
        dtype = store.keys.dtype
        mask = torch.zeros(hidden_slots.shape, dtype=dtype, device=store.device)
        mask = mask.masked_fill(hidden_slots, torch.finfo(dtype).min)
        kv = _SlotCache(store.keys, store.values, slots, span)
        h = h + a.attention_branch(b, h, pos_emb, mask[None, None], kv)
        h = h + a.mlp_branch(b, h)
        return h[0]

    def _touch(self, spec: ForwardSpec | tuple) -> None:
        """Mark ``spec`` (a forward's, or a static function's key) used; drop the least recently
        used graph beyond the bound."""
        used = self._used
        if spec in used:
            used.move_to_end(spec)
            return
        used[spec] = None
        if len(used) <= self.max_graphs:
            return
        old, _ = used.popitem(last=False)
        if isinstance(old, ForwardSpec):
            self.store.drop([("forward", old)])
        else:
            self.store.drop([old])
            self._static.pop(old, None)
        self.evicted += 1
        if self.store.retired >= self.max_graphs:  # retired graphs hold memory: start anew
            self.store.clear()
            used.clear()
            self._static.clear()
            self.resets += 1

    def _inputs(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self._ids.get(t)
        if ids is None:
            dev = self.store.device
            with torch.inference_mode(False):
                ids = self._ids[t] = torch.zeros(1, t, dtype=torch.long, device=dev)
                self._pos[t] = torch.zeros(1, t, dtype=torch.long, device=dev)
        return ids, self._pos[t]

    def _tree_buffer(self, t: int) -> torch.Tensor:
        buf = self._tree.get(t)
        if buf is None:
            with torch.inference_mode(False):
                buf = self._tree[t] = torch.zeros(t, t, dtype=torch.bool, device=self.store.device)
        return buf

    def _slots_arange(self) -> torch.Tensor:
        cap = self.store.capacity
        if self._arange is None or self._arange.shape[0] != cap:
            with torch.inference_mode(False):
                self._arange = torch.arange(cap, device=self.store.device)
        return self._arange

    def _forward(self, spec: ForwardSpec) -> dict[str, torch.Tensor | None]:
        """The static forward of ``spec``: reads only the static inputs and the KV pool."""
        a, store = self.arch, self.store
        assert store.keys is not None and store.values is not None
        t, plan, span = spec.rows, spec.plan, spec.span
        stop = a.num_layers if plan is None else plan.blocks_run
        ids, pos = self._inputs(t)
        h = a.embed(ids)
        pos_emb = a.rotary(h, pos)
        first = self._first[:stop]
        slots = first[:, None] + self._offsets[:t][None, :]  # (stop, T): each layer's write slots
        ar = self._slots_arange()[:span]
        if spec.tree:  # every slot before the block, and the tree's own pattern inside it
            rel = ar[None, :] - first[:, None]  # (stop, span)
            inside = (rel >= 0) & (rel < t)
            among = self._tree_buffer(t)[:, rel.clamp(0, t - 1)].permute(1, 0, 2)  # (stop, T, span)
            hidden_slots = ~((rel < 0)[:, None, :] | (among & inside[:, None, :]))
        else:  # causal: every slot up to the row's own
            hidden_slots = ar[None, None, :] > slots[:, :, None]  # (stop, T, span)
        dtype = store.keys.dtype
        masks = torch.zeros(hidden_slots.shape, dtype=dtype, device=store.device)
        masks = masks.masked_fill(hidden_slots, torch.finfo(dtype).min)
        captured = [h] if spec.hidden else None
        for i in range(stop):
            if plan is None or plan.runs_attn(i):
                kv = _SlotCache(store.keys, store.values, slots[i], span)
                h = h + a.attention_branch(i, h, pos_emb, masks[i][None, None], kv)
            if plan is None or plan.runs_mlp(i):
                h = h + a.mlp_branch(i, h)
            if captured is not None:
                captured.append(h)
        logits = None
        if spec.logits != "none":
            logits = a.lm_head(a.final_norm(h))
        out = {
            "logits": logits,
            "hidden": None if captured is None else torch.stack(captured),
            "last": h,
        }
        if spec.pick is not None and logits is not None:  # the graph's outputs: tensors
            picked = pick_tokens(logits[:, -1], spec.pick)
            out.update({f"pick.{f.name}": getattr(picked, f.name) for f in fields(Picked)})
        if spec.check and logits is not None:
            checked = greedy_check(ids, logits)
            out.update({f"check.{f.name}": getattr(checked, f.name) for f in fields(GreedyCheck)})
        return out
