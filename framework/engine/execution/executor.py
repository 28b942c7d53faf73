"""The executor of one model: runs a `ForwardSpec` by the route `choose_route` picks, through the
one block loop, and keeps the counters of the work done (forwards, block evaluations, layers
loaded, the LM head's time). The CUDA graphs it may replay (`Graphs`: the store, the KV pool, the
branch graphs, whole forwards and strategies' device work) are set up here too
(`Executor.set_cuda_graphs`); what it runs with (the architecture, the fused CPU branches, a
draft's compressed weights, exact mode's attention backend, the placement) is the model adapter's
(`framework.engine.adapter.ModelAdapter`, its ``resources``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from framework.engine.batch.rows import MergedRows
from framework.engine.execution.blocks import run_blocks
from framework.engine.execution.branches import BranchGraphs
from framework.engine.execution.forward_graph import ForwardGraphs
from framework.engine.execution.pool import KVPool
from framework.engine.execution.route import Route, choose_route
from framework.engine.execution.sizes import ForwardSizes
from framework.engine.execution.spec import ForwardSpec, RuleCall, seen_ids
from framework.engine.execution.store import MAX_GRAPHS, GraphStore
from framework.engine.execution.work import (
    Draw,
    EagerOps,
    Learned,
    Unkeyable,
    WorkGraphs,
    learned_of,
    warn_eager,
    work_key,
)
from framework.engine.kv_cache import KVCache
from framework.kernels.fused import FusedBlocks
from framework.kernels.lowbit import LowBitLinears
from framework.kernels.protocols import DraftWeights
from framework.types import AcceptanceRule, ForwardOutput, LayerPlan, pick_tokens
from framework.utils import no_clock, synced_clock

if TYPE_CHECKING:
    from framework.engine.architecture import Architecture
    from framework.engine.draft_head import DraftHead
    from framework.engine.placement import BlockPlacement

#: What one CUDA graph holds (`Executor.set_cuda_graphs`): a whole forward or one branch.
GRAPH_ROUTES = ("forward", "branch")


class Resources(Protocol):
    """What the executor runs with (`framework.engine.adapter.ModelAdapter`)."""

    arch: Architecture
    placement: BlockPlacement
    fused: FusedBlocks | None

    def backend(self) -> Any: ...


@dataclass
class Graphs:
    """The CUDA graphs of one model: the store (recording, bound, counters), the KV pool, the
    branch graphs, and on the ``forward`` route whole forwards and strategies' device work."""

    store: GraphStore
    pool: KVPool
    branches: BranchGraphs
    forwards: ForwardGraphs | None
    work: WorkGraphs | None
    max_tokens: int

    def serves(self, cache: KVCache, batch: int, rows: int) -> bool:
        """Whether a forward of ``batch`` x ``rows`` tokens on ``cache`` can take the branch
        graphs: one sequence of at most `max_tokens` tokens on a cache that holds the pool."""
        return batch == 1 and 1 <= rows <= self.max_tokens and self.pool.holds(cache)


class Executor:
    """Runs one model's forwards.

    Args:
        resources: the model adapter (the architecture and what forwards run with).

    Attributes:
        graphs: the CUDA graphs (`set_cuda_graphs`), or ``None``: eager.
        forward_calls: forwards run.
        block_evals: blocks entered x tokens, for the layer-cost accounting.
        layer_loads: blocks entered per call, whatever the number of tokens (DEL's "layers
            loaded" cost model, in which a memory-bound forward of n blocks costs n).
        lm_head_seconds: wall time in final norm + LM head, counted while `times_lm_head`.
        time_lm_head: ``True`` / ``False`` turn that timer on or off; ``None`` (the default): on
            for a synchronous device (CPU) only (on CUDA it waits for the device twice a forward).
    """

    def __init__(self, resources: Resources) -> None:
        self.resources = resources
        self.arch = resources.arch
        self.graphs: Graphs | None = None
        self.forward_calls = self.block_evals = self.layer_loads = 0
        self.lm_head_seconds = 0.0
        self.time_lm_head: bool | None = None
        #: strategies' device constants (`framework.engine.state.DecodeState.constant`), by key
        self.constants: dict[Hashable, torch.Tensor] = {}
        #: the token counts of the forwards run after prefills while graphs are on (`prepare_graphs`)
        self.seen = ForwardSizes()
        self.placed()

    @property
    def times_lm_head(self) -> bool:
        """Whether forwards add their final norm + LM head time to ``lm_head_seconds``."""
        return self.time_lm_head if self.time_lm_head is not None else self.arch.device.type == "cpu"

    def placed(self) -> None:
        """Note where the final norm and the LM head live (after the model is placed)."""
        _, outputs = self.arch.edge_modules()
        devs = [next(m.parameters()).device for m in outputs if any(True for _ in m.parameters())]
        out = self.resources.placement.output_device
        self._head_devices = (devs[0] if devs else out, devs[-1] if devs else out)

    # ---- CUDA graphs -------------------------------------------------------------------------
    def set_cuda_graphs(
        self,
        enabled: bool,
        *,
        capture: bool | None = None,
        max_tokens: int = 64,
        route: str = "branch",
        max_graphs: int = MAX_GRAPHS,
        recorder: Any = None,
    ) -> Graphs | None:
        """Run short forwards (draft steps, plain steps, verifications of chains and token trees of
        up to ``max_tokens`` tokens) through CUDA graphs, or eagerly again. Prefills run eagerly.

        Args:
            enabled: turn the graphs on or off.
            capture: ``None`` captures graphs on CUDA; ``False`` runs the same static code without
                capturing it (any device: how the CPU tests check it).
            max_tokens: the longest forward that takes the graphs.
            route: ``"forward"``: one graph per forward (forwards it cannot take use the
                branches); ``"branch"``: one graph per attention or MLP branch.
            max_graphs: graphs of whole forwards and device work kept at once.
            recorder: a stand-in for CUDA's graph recording (tests).

        Raises:
            ValueError: ``capture=True`` on a device that is not CUDA (without a recorder), a model
                split across devices, an unknown route, or ``max_tokens`` < 1.
        """
        if route not in GRAPH_ROUTES:
            raise ValueError(f"the CUDA graph route must be one of {list(GRAPH_ROUTES)}, got {route!r}")
        if enabled and self.resources.placement.split:
            raise ValueError("CUDA graphs need the model on one device (it is split: --device-map)")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.graphs = None
        if enabled:
            store = GraphStore(self.arch.device, capture=capture, recorder=recorder, max_graphs=max_graphs)
            pool = KVPool(self.arch, on_grow=store.clear)
            branches = BranchGraphs(self.arch, store, pool, max_tokens)
            whole = route == "forward"
            self.graphs = Graphs(
                store,
                pool,
                branches,
                ForwardGraphs(branches, self._rule_top1) if whole else None,
                WorkGraphs(branches) if whole else None,
                max_tokens,
            )
        return self.graphs

    def prepare_graphs(
        self,
        capacity: int,
        *,
        chain: Iterable[int] = (),
        tree: Iterable[int] = (),
        mlp: Iterable[int] = (),
        weights: DraftWeights | None = None,
        hidden: bool = False,
        checked: Iterable[int] = (),
        rule: AcceptanceRule | None = None,
    ) -> tuple[int, float]:
        """Before timing: size the KV pool for ``capacity`` slots and record every graph forwards
        of these token counts can use, so that no generation records one; with a draft's low-bit
        ``weights``, the branch graphs that run them (the fused CPU branches take no graphs).

        On the ``forward`` route the full model's forwards of ``chain`` and ``tree`` tokens are
        recorded whole (with every block's residual when ``hidden``; the ``checked`` chain sizes
        also with the verifier's acceptance ``rule`` inside, when it has no inputs and draws
        nothing), the ``mlp`` sizes (scratch passes) as branches; draft
        steps, whose plans and heads are the strategies', record whole on first use (a warm-up
        decode: the runner's and the benchmark's). A no-op without graphs.

        Returns:
            ``(graphs recorded, seconds)``.

        Raises:
            RuntimeError: the pool is lent to a live cache.
        """
        g = self.graphs
        if g is None:
            return 0, 0.0
        if g.pool.lent:
            raise RuntimeError("precapture needs the KV pool back (a cache still holds it)")
        g.pool.reserve(capacity)
        d, dev, dtype = self.arch.hidden_size, self.arch.device, self.arch.dtype

        def rotary(t: int) -> Any:
            h = torch.zeros(1, t, d, dtype=dtype, device=dev)
            return self.arch.rotary(h, torch.arange(t, device=dev)[None])

        n0, s0 = g.store.captures, g.store.capture_seconds
        lowbit = weights.active() if isinstance(weights, LowBitLinears) else None
        if weights is not None and lowbit is None:
            return 0, 0.0
        with torch.inference_mode(), lowbit or nullcontext(), self.resources.backend():
            if g.forwards is None:
                g.branches.precapture(rotary, chain=chain, tree=tree, mlp=mlp)
            else:
                g.branches.precapture(rotary, mlp=mlp)
                if weights is None:
                    g.forwards.precapture(
                        chain, tree, hidden=hidden, checked=checked, rule=self._precapture_rule(rule)
                    )
        return g.store.captures - n0, g.store.capture_seconds - s0

    def graph_counts(self) -> tuple[int, float]:
        """``(graphs recorded, seconds)`` so far (0 without graphs): what a generation adds to it
        is what it recorded while it ran."""
        g = self.graphs
        return (0, 0.0) if g is None else (g.store.captures, g.store.capture_seconds)

    # ---- forwards ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        plan: LayerPlan | None = None,
        **options: Any,
    ) -> ForwardOutput:
        """`run` from token ids (B, T) with positions (B, T) (absolute, for RoPE); ``options`` are
        the other fields of `ForwardSpec` (``logits_at`` defaults to ``"all"``). A forward that
        `choose_route` sends whole runs as one graph, with its acceptance rule inside once the
        rule's first (eager) call showed what it draws; elsewhere the rule runs right after."""
        spec = ForwardSpec(plan, **options)
        spec.validate(self.arch.num_layers)
        if self.graphs is not None and not cache.empty:
            self.seen.note(spec, input_ids.shape[1])
        route = choose_route(self, spec, input_ids, cache, from_ids=True)
        if route.whole:
            out = self._whole(spec, input_ids, position_ids, cache)
        else:
            out = self._run(self.arch.embed(input_ids), position_ids, cache, spec)
        if spec.rule is not None and out.ruled is None:  # not in a graph: the same rule, here
            out = replace(out, ruled=self.apply_rule(spec.rule, input_ids, out.logits))
        return out

    def _rule_key(self, call: RuleCall | None) -> tuple[Hashable, tuple[Draw, ...]] | None:
        """The key under which ``call``'s rule runs inside a whole-forward graph and the draws
        it makes, or ``None``: no rule, one that cannot be keyed (it runs eagerly, with one
        warning), one not learned yet (its first call runs eagerly), or one that cannot be a graph."""
        if call is None:
            return None
        key = work_key(call.fn, call.inputs, {})
        if isinstance(key, Unkeyable):
            warn_eager(call.fn, key)
            return None
        learned = learned_of(self.resources).get(key)
        return None if learned is None else (key, learned.draws)

    def apply_rule(self, call: RuleCall, ids: torch.Tensor, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """``call``'s acceptance rule on a forward's ``ids`` and ``logits``, eagerly (its draws
        straight from the stream); the first call of a keyed rule notes its draws, so that later
        whole forwards hold it in their graph."""
        ops = EagerOps(self._rule_top1, None, call.random, logits.device)
        if call.fed is not None:  # rows that reused a draft's blocks: what they saw
            ids = seen_ids(ids, call.fed)
        out = call.fn(ops, ids, logits, *call.inputs)
        if self.graphs is not None and self.graphs.forwards is not None:
            key = work_key(call.fn, call.inputs, {})
            if not isinstance(key, Unkeyable):
                learned_of(self.resources).setdefault(key, Learned(tuple(ops.draws)))
        return out

    def _precapture_rule(self, rule: AcceptanceRule | None) -> tuple[AcceptanceRule, Hashable] | None:
        """``rule`` and the key a whole forward holds it under, for recording before timing: a
        rule without inputs and draws only (others record on first use)."""
        if rule is None:
            return None
        key = work_key(rule, (), {})
        if isinstance(key, Unkeyable):
            return None
        learned = learned_of(self.resources).setdefault(key, Learned(()))
        return None if learned.draws else (rule, (key, learned.draws))

    def _rule_top1(
        self, hidden: torch.Tensor, *, draft_head: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``ops.top1`` inside an acceptance rule: the full LM head."""
        return self.top1_from_hidden(hidden)

    @torch.inference_mode()
    def forward_from(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        plan: LayerPlan | None = None,
        *,
        start: int,
        **options: Any,
    ) -> ForwardOutput:
        """`run` from residuals (B, T, d) that went through blocks ``< start``; ``options`` are
        the other fields of `ForwardSpec` (``logits_at`` defaults to ``None``: no LM head)."""
        options.setdefault("logits_at", None)
        return self.run(hidden, position_ids, cache, ForwardSpec(plan, start=start, **options))

    def _whole(
        self, spec: ForwardSpec, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache
    ) -> ForwardOutput:
        """``spec`` as one graph of the whole forward; a reduced draft head runs after it."""
        g = self.graphs
        assert g is not None and g.forwards is not None
        lowbit = spec.weights if isinstance(spec.weights, LowBitLinears) else None
        rule = self._rule_key(spec.rule)
        head = None if spec.head is None else spec.head.graph_key
        with lowbit.active() if lowbit is not None else nullcontext(), self.resources.backend():
            logits, hidden, last, picked, ruled = g.forwards.run(
                spec,
                input_ids,
                position_ids,
                cache,
                "model" if lowbit is None else lowbit.weights,
                rule,
                head,
            )
        stop = spec.end(self.arch.num_layers)
        self.forward_calls += 1
        self.block_evals += stop * input_ids.shape[1]
        self.layer_loads += stop
        at = spec.logits_at
        if at is not None:
            if spec.head is not None:  # a growing head's graph scores its room too: the head's columns
                logits = logits[..., : spec.head.size]
            if not isinstance(at, str):
                logits = logits.index_select(1, at.to(logits.device))
            elif at == "last":
                logits = logits[:, -1:]
        return ForwardOutput(logits, hidden, last, spec.head if logits is not None else None, picked, ruled)

    @torch.inference_mode()
    def run(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, cache: KVCache, spec: ForwardSpec
    ) -> ForwardOutput:
        """Run blocks ``spec.start .. stop-1`` of the (partial) model on ``hidden`` (B, T, d),
        reading and writing ``cache``, block by block by the route `choose_route` picks.

        Returns:
            ForwardOutput whose ``hidden_states`` are (stop - start + 1, B, T, d) with
            ``spec.capture_hidden``.

        Raises:
            ValueError: a plan of the wrong length, a block range outside ``[0, L]``, or a bad
                ``logits_at``.
        """
        spec.validate(self.arch.num_layers)
        if self.graphs is not None and not cache.empty:
            self.seen.note(spec, hidden.shape[1])
        return self._run(hidden, position_ids, cache, spec)

    def _run(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, cache: KVCache, spec: ForwardSpec
    ) -> ForwardOutput:
        """`run` of a spec already validated."""
        stop = spec.end(self.arch.num_layers)
        self.forward_calls += 1
        captured = [hidden] if spec.capture_hidden else None
        pos_emb = self.arch.rotary(hidden, position_ids)
        route = choose_route(self, spec, hidden, cache, from_ids=False)
        h = hidden.contiguous() if route.fused is not None else hidden
        cache.begin(
            h.shape[1], base=spec.base, visible=spec.visible, tree_mask=spec.tree_mask, persist=spec.persist
        )
        try:
            if route.branches and self.graphs is not None:
                self.graphs.branches.set_rotary(pos_emb)
            lowbit = spec.weights if isinstance(spec.weights, LowBitLinears) else None
            with lowbit.active() if lowbit is not None else nullcontext(), self.resources.backend():
                h = self._blocks(h, pos_emb, cache, spec, stop, route, captured)
        finally:
            cache.end()
        self.block_evals += (stop - spec.start) * h.shape[1]
        self.layer_loads += stop - spec.start
        logits = self._logits(h, spec) if spec.logits_at is not None else None
        if route.split:  # everything back on the input device
            logits = None if logits is None else logits.to(hidden.device)
            h = h.to(hidden.device)
            captured = None if captured is None else [c.to(hidden.device) for c in captured]
        hidden_states = torch.stack(captured) if captured is not None else None
        picked = ruled = None
        if spec.pick is not None and logits is not None:
            picked = pick_tokens(logits[:, -1], spec.pick, spec.head)
        if spec.rule is not None and spec.rule.ids is not None and logits is not None:  # from residuals
            ruled = self.apply_rule(spec.rule, spec.rule.ids, logits)
        return ForwardOutput(
            logits, hidden_states, h, spec.head if logits is not None else None, picked, ruled
        )

    def _blocks(
        self,
        h: torch.Tensor,
        pos_emb: Any,
        cache: KVCache,
        spec: ForwardSpec,
        stop: int,
        route: Route,
        captured: list | None,
    ) -> torch.Tensor:
        """The block loop with the branches ``route`` supplies: the branch graphs, the fused
        branches, the model's modules, or the modules across devices."""
        arch = self.arch
        if route.split:  # each shard's position embeddings moved there once
            placement, on_device = self.resources.placement, {h.device: pos_emb}

            def enter(i: int, x: torch.Tensor) -> torch.Tensor:
                dev = placement.device_of(i)
                if dev not in on_device:
                    on_device[dev] = tuple(e.to(dev) for e in pos_emb)
                return x if x.device == dev else x.to(dev)

            def split_attention(i: int, x: torch.Tensor) -> torch.Tensor:
                return x + arch.attention_branch(i, x, on_device[x.device], cache.attention_mask(i), cache)

            return run_blocks(
                h,
                spec.start,
                stop,
                spec.plan,
                split_attention,
                lambda i, x: x + arch.mlp_branch(i, x),
                enter=enter,
                captured=captured,
            )
        fused = route.fused
        graphs = self.graphs.branches if route.branches and self.graphs is not None else None
        cos, sin = (e.contiguous() for e in pos_emb) if fused is not None else (None, None)
        if isinstance(cache, MergedRows):  # several rows of a batch, each at its own slots
            return run_blocks(
                h, spec.start, stop, spec.plan, *cache.branches(arch, fused, pos_emb), captured=captured
            )

        def attention(i: int, x: torch.Tensor) -> torch.Tensor:
            if graphs is not None:
                whole, tree = cache.block_mask(i)
                if whole:
                    return x + graphs.attention(i, x, cache.claim(i)[2], tree)
            if fused is not None and fused.attn[i] is not None:
                return fused.attention(i, x, cos, sin, cache)
            return x + arch.attention_branch(i, x, pos_emb, cache.attention_mask(i), cache)

        def mlp(i: int, x: torch.Tensor) -> torch.Tensor:
            if graphs is not None:
                return x + graphs.mlp(i, x)
            if fused is not None and fused.mlp[i] is not None:
                return fused.mlp_branch(i, x)
            return x + arch.mlp_branch(i, x)

        return run_blocks(h, spec.start, stop, spec.plan, attention, mlp, captured=captured)

    # ---- the LM head -------------------------------------------------------------------------
    def _head(
        self, x: torch.Tensor, head: DraftHead | None, weights: DraftWeights | None = None
    ) -> torch.Tensor:
        """Final norm and LM head (or ``head``) of ``x`` (..., d), on their devices when the model
        is split, the logits back on ``x``'s device. A draft whose ``weights`` are a compressed copy
        of the fused branches scores ``head`` in their `FusedBlocks.head` format (`DraftHead.logits`)."""
        fmt = weights.head if isinstance(weights, FusedBlocks) else None
        if not self.resources.placement.split:
            normed = self.arch.final_norm(x)
            return self.arch.lm_head(normed) if head is None else head.logits(normed, fmt)
        norm_dev, head_dev = self._head_devices
        normed = self.arch.final_norm(x.to(norm_dev)).to(head_dev)
        logits = self.arch.lm_head(normed) if head is None else head.logits(normed, fmt)
        return logits.to(x.device)

    def _logits(self, h: torch.Tensor, spec: ForwardSpec) -> torch.Tensor:
        """Final norm and LM head (or ``spec.head``) at ``spec.logits_at``, timed while `times_lm_head`."""
        timed = self.times_lm_head
        clock = synced_clock(self.arch.device) if timed else no_clock
        t0 = clock()
        at = spec.logits_at
        if isinstance(at, torch.Tensor):
            sel = h.index_select(1, at.to(h.device))
        else:
            sel = h[:, -1:] if at == "last" else h
        logits = self._head(sel, spec.head, spec.weights)
        if timed:
            self.lm_head_seconds += clock() - t0
        return logits

    def logits_from_hidden(
        self, hidden: torch.Tensor, head: DraftHead | None = None, weights: DraftWeights | None = None
    ) -> torch.Tensor:
        """Final norm + LM head (or ``head``, scored as a draft with ``weights`` scores it) on
        pre-norm residuals of any shape (..., d) (shadow predictions, the cost model's head
        timing), on the norm's and head's own devices when the model is split; the logits come back
        on ``hidden``'s device."""
        with torch.inference_mode():
            return self._head(hidden, head, weights)

    @torch.inference_mode()
    def top1_from_hidden(
        self, hidden: torch.Tensor, chunk: int = 256, head: DraftHead | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The LM head's greedy token and its probability for each pre-norm residual.

        DEL's "shadow tokens": what an exit after each layer would predict. Rows go through the
        final norm and LM head ``chunk`` at a time, so that N x V logits never exist at once. The
        time is not added to ``lm_head_seconds`` (which counts the heads of forwards).

        Args:
            hidden: FloatTensor (..., d).
            chunk: rows per head call.
            head: a reduced draft head (the token and probability among its K tokens, as a draft
                with that head would see them); ``None``: the full LM head.

        Returns:
            (tokens LongTensor (...), probs FloatTensor (...) in float32): argmax and top-1
            softmax probability.
        """
        flat = hidden.reshape(-1, hidden.shape[-1])
        toks, probs = [], []
        for lo in range(0, flat.shape[0], chunk):
            logits = self._head(flat[lo : lo + chunk], head).float()  # (n, V or K)
            top, idx = logits.max(dim=-1)
            toks.append(idx if head is None else head.tokens(idx).to(idx.device))
            probs.append(torch.exp(top - torch.logsumexp(logits, dim=-1)))
        shape = hidden.shape[:-1]
        if not toks:
            return (
                torch.zeros(shape, dtype=torch.long, device=hidden.device),
                torch.zeros(shape, dtype=torch.float32, device=hidden.device),
            )
        if len(toks) == 1:  # one chunk: nothing to join
            return toks[0].reshape(shape), probs[0].reshape(shape)
        return torch.cat(toks).reshape(shape), torch.cat(probs).reshape(shape)
