"""The engine's executor of one Hugging Face causal LM: `ModelAdapter` runs a model's blocks,
through its `framework.engine.architecture.Architecture` (where the pieces are), with any
sub-layer skipped and an early exit, and owns how the forward runs: the CPU kernels and fused
branches (`framework.kernels`), CUDA graphs, compressed draft weights, the LM-head timer and the
counters of the work done.

One forward is one `Pass` (what to run and what to return) over hidden states; `forward` starts
from token ids, `forward_from` from residuals that already went through the first blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from framework.engine.architecture import Architecture, architecture_for
from framework.engine.graphed import MAX_GRAPHS, ForwardGraphs
from framework.engine.kv_cache import KVCache
from framework.engine.placement import BlockPlacement
from framework.kernels import cpu as kernels
from framework.kernels.fused import WEIGHT_FORMATS, FusedBlocks
from framework.kernels.graphs import BranchGraphs
from framework.kernels.lowbit import LOWBIT_FORMATS, LowBitLinears
from framework.kernels.protocols import DraftWeights
from framework.types import (
    ForwardOutput,
    LayerPlan,
    ModelInfo,
    TokenPick,
    greedy_check,
    pick_tokens,
)
from framework.utils import no_clock, synced_clock

if TYPE_CHECKING:
    from framework.engine.draft_head import DraftHead

#: What ``--drafter.draft_weights`` may name: the model's own ("float32"), the CPU kernels' formats
#: and the modules' low-bit formats (`ModelAdapter.draft_branches`).
DRAFT_WEIGHT_FORMATS = ("float32", *LOWBIT_FORMATS)
#: What one CUDA graph holds (`ModelAdapter.set_cuda_graphs`): a whole forward or one branch.
GRAPH_ROUTES = ("forward", "branch")


def adapter_for(model: nn.Module, *, fast_kernels: bool | None = None) -> ModelAdapter:
    """The executor of ``model`` (its registered `Architecture` for ``config.model_type``).

    Args:
        model: an HF causal LM.
        fast_kernels: route the model's linear layers and attention through the batch-invariant
            CPU kernels of `framework.kernels.cpu` (see `ModelAdapter.set_fast_kernels`). ``None``
            (default): yes for a float32 model on a CPU unless ``SELFSPEC_KERNEL=0``.

    Raises:
        ValueError: no architecture is registered for that model type.
    """
    adapter = ModelAdapter(architecture_for(model))
    adapter.set_fast_kernels(fast_kernels)
    return adapter


@dataclass(frozen=True)
class Pass:
    """What one forward runs and returns (`ModelAdapter.run`).

    Attributes:
        plan: sub-layers to skip / the exit layer; ``None`` runs every sub-layer.
        start: the first block to run (``0 <= start <= stop``): residuals that went through blocks
            ``< start`` already (verification completing an early-exit draft's blocks).
        stop: one past the last block; ``None``: ``plan.blocks_run`` (L without a plan).
        logits_at: ``"all"``, ``"last"``, a LongTensor of positions in ``[0, T)``, or ``None``
            (no LM head at all).
        capture_hidden: also return the residual after each block run (index 0: the input).
        base, visible, tree_mask, persist: where the new tokens' KV goes and what they attend to
            (`framework.engine.kv_cache.KVCache.begin`): a scratch pass (``persist=False``) leaves
            the committed cache untouched; a ``tree_mask`` (T, T) verifies a token tree.
        head: a reduced draft head for the logits (``None``: the full LM head).
        weights: a draft's compressed copy of the weights (`ModelAdapter.draft_branches`: the
            fused branches' or the modules' low-bit linear layers) to run instead of the model's
            own (``None``: the model's weights).
        pick: choose a token from the last row's logits inside the forward
            (`framework.types.TokenPick`; part of its graph on the ``forward`` route); ignored with a
            reduced ``head`` (its logits come after the graph: the caller chooses).
        check: check the block's own tokens against the target's argmax (`greedy_check`: a
            greedy verification) inside the forward; needs ``logits_at="all"``, the full LM head
            and token ids (`forward`).
    """

    plan: LayerPlan | None = None
    start: int = 0
    stop: int | None = None
    logits_at: str | torch.Tensor | None = "all"
    capture_hidden: bool = False
    base: int | None = None
    visible: int | None = None
    tree_mask: torch.Tensor | None = None
    persist: bool = True
    head: DraftHead | None = None
    weights: DraftWeights | None = None
    pick: TokenPick | None = None
    check: bool = False


@dataclass(frozen=True)
class _Route:
    """The paths one forward takes (`ModelAdapter._route`)."""

    hidden: torch.Tensor  # contiguous when the fused branches run
    fused: FusedBlocks | None
    graphs: BranchGraphs | None
    cos: torch.Tensor | None
    sin: torch.Tensor | None


class ModelAdapter:
    """The executor of one model: runs its architecture's blocks and owns how they run.

    Args:
        arch: the model's `Architecture`.

    Attributes:
        arch: the architecture mapping (blocks, branches, norms, head).
        lm_head_seconds: wall time spent in final norm + LM head (for time breakdowns), counted
            while `times_lm_head`.
        time_lm_head: ``True`` / ``False`` turn that timer on or off; ``None`` (the default): on
            for a synchronous device (CPU) only, because on CUDA the timer waits for the device
            twice in every forward that computes logits.
        forward_calls: forwards run.
        block_evals: blocks entered x tokens, for the layer-cost accounting.
        layer_loads: blocks entered per call, whatever the number of tokens (DEL's "layers
            loaded" cost model, in which a memory-bound forward of n blocks costs n).
        fast_kernels: whether the model runs through `framework.kernels.cpu` (`set_fast_kernels`).
        fused: the fused branches of `framework.kernels.fused` (``None``: the modules).
        graphs: CUDA graphs of the attention and MLP branches (`set_cuda_graphs`; ``None``: eager).
    """

    def __init__(self, arch: Architecture) -> None:
        self.arch = arch
        self.lm_head_seconds = 0.0
        self.time_lm_head: bool | None = None
        self.forward_calls = 0
        self.block_evals = 0
        self.layer_loads = 0
        self.fast_kernels = kernels.is_installed(arch.model)
        self.fused: FusedBlocks | None = None
        self.graphs: BranchGraphs | None = None
        #: one graph per forward over ``graphs``' pool (`set_cuda_graphs` with ``route="forward"``)
        self.forward_graphs: ForwardGraphs | None = None
        #: exact mode (`set_exact`): plain steps and verifications compute each row the same way
        self.exact = False
        #: the one SDPA backend every forward uses (exact mode on CUDA), or ``None``: the dispatch's
        self.sdpa_backend: Any = None
        #: the KV cache's dtype (float32 for a bfloat16 model in exact mode on a CPU)
        self.kv_dtype: torch.dtype = arch.dtype
        self._draft_branches: dict[str, DraftWeights | None] = {}  # `draft_branches`, per format
        #: where the blocks live (`place`); split across devices, the forwards move the residual
        #: stream at the boundaries and return everything on the input device
        self.placement = BlockPlacement.of_blocks(arch.blocks)
        self._head_devices = self._output_devices()

    # ---- the model's facts (its architecture's) ------------------------------------------------
    @property
    def model(self) -> nn.Module:
        return self.arch.model

    @property
    def config(self) -> Any:
        return self.arch.config

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    @property
    def hidden_size(self) -> int:
        return self.arch.hidden_size

    @property
    def num_kv_heads(self) -> int:
        return self.arch.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.arch.head_dim

    @property
    def max_context(self) -> int:
        return self.arch.max_context

    @property
    def device(self) -> torch.device:
        return self.arch.device

    @property
    def dtype(self) -> torch.dtype:
        return self.arch.dtype

    def info(self, name: str = "") -> ModelInfo:
        return self.arch.info(name)

    def fingerprint(self) -> str:
        return self.arch.fingerprint()

    def place(self, placement: BlockPlacement) -> None:
        """Run the model split as ``placement`` says (``--device-map``): its weights are moved
        there (`Architecture.place`), and its caches get one KV buffer per shard. The CPU kernels'
        fused branches and CUDA graphs serve one device only: a split model runs without them.

        Raises:
            ValueError: CUDA graphs are on, or the placement is for another depth.
        """
        if placement.split and self.graphs is not None:
            raise ValueError(
                "CUDA graphs need the model on one device: turn --cuda-graphs off with --device-map"
            )
        self.arch.place(placement)
        self.placement = placement
        self._head_devices = self._output_devices()
        self._draft_branches.clear()

    def _output_devices(self) -> tuple[torch.device, torch.device]:
        """The final norm's and the LM head's devices."""
        _, outputs = self.arch.edge_modules()
        devs = [next(m.parameters()).device for m in outputs if any(True for _ in m.parameters())]
        out = self.placement.output_device
        return (devs[0] if devs else out, devs[-1] if devs else out)

    @property
    def times_lm_head(self) -> bool:
        """Whether forwards add their final norm + LM head time to ``lm_head_seconds``."""
        return self.time_lm_head if self.time_lm_head is not None else self.device.type == "cpu"

    # ---- how it runs -----------------------------------------------------------------------------
    def set_fast_kernels(self, enabled: bool | None = None) -> bool:
        """Route the model's linear layers and attention through `framework.kernels.cpu`, or back.

        The kernels make a forward over a few tokens cost about as much as over one on a CPU, and
        make each position's logits bit-identical whatever the number of tokens in the forward
        (so greedy verification reproduces plain greedy decoding exactly in float32). They apply to
        float32 tensors on a CPU; anything else takes the stock path, so the model keeps working
        everywhere. The model itself is changed (the classes of its ``nn.Linear`` and RMSNorm
        modules and its attention implementation; parameters untouched): every adapter and
        ``model.generate`` see it.

        Args:
            enabled: ``True`` installs, ``False`` restores the stock modules, ``None`` installs for
                a float32 model on a CPU unless ``SELFSPEC_KERNEL=0`` (and otherwise changes nothing).

        With the kernels installed, the blocks `build_fused` can fuse run one compiled call per
        attention or MLP branch (`fused`; ``adapter.fused = None`` turns that off alone).

        Returns:
            Whether the kernels are installed now (``False`` if they could not be built: a
            one-line notice on stderr says why).
        """
        if enabled is None:
            if kernels.enabled_by_env() and self.device.type == "cpu" and self.dtype == torch.float32:
                kernels.install(self.model)
        elif enabled:
            kernels.install(self.model)
        else:
            kernels.uninstall(self.model)
        self.fast_kernels = kernels.is_installed(self.model)
        self.fused = self.arch.build_fused() if self.fast_kernels else None
        self._draft_branches.clear()
        return self.fast_kernels

    def set_exact(self, enabled: bool) -> bool:
        """Exact mode: plain steps and verifications compute every row the same way, so greedy
        speculative output equals this engine's own plain greedy output token for token, in any
        supported dtype (docs/performance.md, "Numerics").

        - On a CPU: the batch-invariant kernels (`set_fast_kernels`) for float32 and bfloat16
          models. A bfloat16 model's linear layers stream its bfloat16 weights through the kernel
          with float32 sums rounded to bfloat16, and its KV cache is kept in float32 (the same
          values, which the float32 attention kernel reads as they are).
        - On CUDA: every forward's attention through SDPA's memory-efficient backend, which made
          a 9-token verification's logits bit-identical to 9 one-token steps on an H200, where
          the default dispatch did not (`docs/measurements/h200-2026-11-28-probe/`). The matrix
          products were row-invariant there up to 16 rows with the default settings.

        Call it before any cache is made (the cache's dtype follows it). ``False`` turns it off
        (the kernels stay as `set_fast_kernels` left them).

        Returns:
            Whether exact mode is on.

        Raises:
            ValueError: a model split across devices, a CPU model in a dtype other than float32 or
                bfloat16, kernels that could not be built, or another device type.
        """
        self.exact, self.sdpa_backend, self.kv_dtype = False, None, self.dtype
        if not enabled:
            return False
        if self.placement.split:
            raise ValueError("exact mode serves a model on one device (it is split: --device-map)")
        dev = self.device.type
        if dev == "cpu":
            if self.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(
                    f"exact mode on a CPU needs float32 or bfloat16 weights, the model is {self.dtype}"
                )
            if not self.fast_kernels and not self.set_fast_kernels(True):
                raise ValueError(
                    f"exact mode on a CPU needs the batch-invariant kernels, which are unavailable: "
                    f"{kernels.unavailable_reason}"
                )
            self.kv_dtype = torch.float32
        elif dev == "cuda":
            from torch.nn.attention import SDPBackend

            self.sdpa_backend = SDPBackend.EFFICIENT_ATTENTION
        else:
            raise ValueError(f"exact mode runs on a CPU or CUDA, the model is on {self.device}")
        self.exact = True
        return True

    def _backend(self) -> Any:
        """The context every forward runs in: the exact mode's SDPA backend, or nothing."""
        if self.sdpa_backend is None:
            return nullcontext()
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(self.sdpa_backend)

    def draft_branches(self, fmt: str) -> DraftWeights | None:
        """The model's weights in ``fmt`` for drafts, built once per format: with the CPU kernels'
        fused branches, ``"bfloat16"``, ``"int8"`` and ``"int4"`` are their compressed copies
        (`FusedBlocks.compressed`); every other case (``"fp8"``, another device or dtype,
        ``SELFSPEC_KERNEL=0``) compresses the blocks' linear layers and runs them through the
        modules (`framework.kernels.lowbit.LowBitLinears`). ``"float32"``: ``fused`` (the model's
        own). ``None``: nothing to compress (``"bfloat16"`` on a bfloat16 model), drafts run the
        model's own weights.

        Raises:
            ValueError: an unknown format.
        """
        if fmt not in DRAFT_WEIGHT_FORMATS:
            raise ValueError(f"draft weight format must be one of {list(DRAFT_WEIGHT_FORMATS)}, got {fmt!r}")
        if fmt == "float32":
            return self.fused
        if fmt not in self._draft_branches:
            if self.fused is not None and fmt in WEIGHT_FORMATS:
                self._draft_branches[fmt] = self.fused.compressed(fmt)
            else:
                self._draft_branches[fmt] = LowBitLinears.build(self.arch, fmt)
        return self._draft_branches[fmt]

    def set_cuda_graphs(
        self,
        enabled: bool,
        *,
        capture: bool | None = None,
        max_tokens: int = 64,
        route: str = "branch",
        max_graphs: int = MAX_GRAPHS,
        recorder: Any = None,
    ) -> BranchGraphs | None:
        """Run short forwards (draft steps, plain steps, verifications of chains and token trees of
        up to ``max_tokens`` tokens) through CUDA graphs, or eagerly again. Prefills run eagerly.

        Args:
            enabled: turn the graphs on or off.
            capture: ``None`` captures graphs on CUDA; ``False`` runs the same static code without
                capturing it (any device: how the CPU tests check it).
            max_tokens: the longest forward that takes the graphs.
            route: ``"forward"``: one graph per forward (`framework.engine.graphed`; forwards it
                cannot take use the branches); ``"branch"``: one graph per attention or MLP branch
                (`framework.kernels.graphs`).
            max_graphs: whole-forward graphs kept at once (the ``forward`` route).
            recorder: a stand-in for CUDA's graph recording (`BranchGraphs`; tests).

        Raises:
            ValueError: ``capture=True`` on a device that is not CUDA (without a recorder), a model
                split across devices (`place`), or an unknown route.
        """
        if route not in GRAPH_ROUTES:
            raise ValueError(f"the CUDA graph route must be one of {list(GRAPH_ROUTES)}, got {route!r}")
        if enabled and self.placement.split:
            raise ValueError("CUDA graphs need the model on one device (it is split: --device-map)")
        self.graphs = (
            BranchGraphs(self.arch, capture=capture, max_tokens=max_tokens, recorder=recorder)
            if enabled
            else None
        )
        self.forward_graphs = (
            ForwardGraphs(self.arch, self.graphs, max_graphs=max_graphs)
            if self.graphs is not None and route == "forward"
            else None
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
    ) -> tuple[int, float]:
        """Before timing: size the CUDA graphs' KV pool for ``capacity`` slots and record every
        graph forwards of these token counts can use (`BranchGraphs.precapture`), so that no
        generation records one; with a draft's low-bit ``weights``, the graphs that run them
        (the fused CPU branches take no graphs). A no-op without graphs.

        With the ``forward`` route (`set_cuda_graphs`), the full model's forwards of ``chain`` and
        ``tree`` tokens are recorded whole (`ForwardGraphs.precapture`, with every block's residual
        when ``hidden``; the ``checked`` chain sizes also with the greedy check inside), the
        ``mlp`` sizes (scratch passes) as branches; draft steps, whose plans
        and heads are the strategies', record whole on first use (a warm-up decode: the runner's
        and the benchmark's), counted in each generation's ``graph_captures``.

        Returns:
            ``(graphs recorded, seconds)``.
        """
        g = self.graphs
        if g is None:
            return 0, 0.0
        g.reserve(capacity)
        d, dev = self.hidden_size, self.device

        def rotary(t: int) -> Any:
            h = torch.zeros(1, t, d, dtype=self.dtype, device=dev)
            return self.arch.rotary(h, torch.arange(t, device=dev)[None])

        n0, s0 = g.captures, g.capture_seconds
        lowbit = weights.active() if isinstance(weights, LowBitLinears) else None
        if weights is not None and lowbit is None:
            return 0, 0.0
        fg = self.forward_graphs
        with torch.inference_mode(), lowbit or nullcontext(), self._backend():
            if fg is None:
                g.precapture(rotary, chain=chain, tree=tree, mlp=mlp)
            else:
                g.precapture(rotary, mlp=mlp)
                if weights is None:
                    fg.precapture(chain, tree, hidden=hidden, checked=checked)
        return g.captures - n0, g.capture_seconds - s0

    def graph_counts(self) -> tuple[int, float]:
        """``(graphs recorded, seconds)`` so far (0 without graphs): what a generation adds to it
        is what it recorded while it ran."""
        g = self.graphs
        return (0, 0.0) if g is None else (g.captures, g.capture_seconds)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        """A KV cache of ``capacity`` slots: the CUDA graphs' pool when they are on and it is free,
        else buffers of its own."""
        if self.placement.split:
            return self.arch.new_cache(
                capacity, batch, shards=[(s.blocks, s.device) for s in self.placement.shards]
            )
        graphs = self.graphs
        buffers = graphs.lease(capacity, batch) if graphs is not None else None
        if buffers is None or graphs is None:
            return self.arch.new_cache(capacity, batch, dtype=self.kv_dtype)
        cache = KVCache(
            self.num_layers,
            batch,
            self.num_kv_heads,
            self.head_dim,
            capacity,
            self.dtype,
            self.device,
            buffers=buffers,
            on_release=graphs.give_back,
        )
        graphs.lent_to(cache)
        return cache

    # ---- forwards --------------------------------------------------------------------------
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
        the other fields of `Pass` (``logits_at`` defaults to ``"all"``). With the ``forward``
        graph route, a forward it can take runs as one graph (`_run_graphed`)."""
        p = Pass(plan, **options)
        if p.check and (not isinstance(p.logits_at, str) or p.logits_at != "all" or p.head is not None):
            raise ValueError("check (a greedy verification) needs logits_at='all' and the full LM head")
        out = None
        if self.forward_graphs is not None:
            out = self._run_graphed(input_ids, position_ids, cache, p)
        if out is None:
            out = self.run(self.arch.embed(input_ids), position_ids, cache, p)
        if p.check and out.checked is None:  # not in a graph: the same rule, here
            out = replace(out, checked=greedy_check(input_ids, out.logits))
        return out

    def _run_graphed(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache, p: Pass
    ) -> ForwardOutput | None:
        """``p`` as one graph of the whole forward (`framework.engine.graphed`), or ``None`` when
        it cannot take one (see there); a reduced draft head runs after the graph."""
        fg = self.forward_graphs
        assert fg is not None
        if isinstance(p.weights, FusedBlocks):
            return None
        lowbit = p.weights if isinstance(p.weights, LowBitLinears) else None
        if self.placement.split or (p.plan is not None and p.plan.num_layers != self.num_layers):
            return None
        spec = fg.spec(
            input_ids,
            cache,
            plan=p.plan,
            start=p.start,
            stop=p.stop,
            logits_at=p.logits_at,
            capture_hidden=p.capture_hidden,
            base=p.base,
            visible=p.visible,
            tree_mask=p.tree_mask,
            persist=p.persist,
            head=p.head,
            weights="model" if lowbit is None else lowbit.weights,
            pick=p.pick,
            check=p.check,
        )
        if spec is None:
            return None
        with lowbit.active() if lowbit is not None else nullcontext(), self._backend():
            logits, hidden, last, picked, checked = fg.run(
                spec, input_ids, position_ids, cache, base=p.base, tree_mask=p.tree_mask
            )
        stop = self.num_layers if p.plan is None else p.plan.blocks_run
        self.forward_calls += 1
        self.block_evals += stop * spec.rows
        self.layer_loads += stop
        if p.logits_at is not None:
            if logits is None:  # a reduced draft head: after the graph
                logits = self._logits(last, p)
            elif not isinstance(p.logits_at, str):
                logits = logits.index_select(1, p.logits_at.to(logits.device))
            elif p.logits_at == "last":
                logits = logits[:, -1:]
        return ForwardOutput(logits, hidden, last, p.head if logits is not None else None, picked, checked)

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
        the other fields of `Pass` (``logits_at`` defaults to ``None``: no LM head)."""
        options.setdefault("logits_at", None)
        return self.run(hidden, position_ids, cache, Pass(plan, start=start, **options))

    @torch.inference_mode()
    def run(self, hidden: torch.Tensor, position_ids: torch.Tensor, cache: KVCache, p: Pass) -> ForwardOutput:
        """Run blocks ``p.start .. stop-1`` of the (partial) model on ``hidden`` (B, T, d),
        reading and writing ``cache``.

        Returns:
            ForwardOutput whose ``hidden_states`` are (stop - start + 1, B, T, d) with
            ``p.capture_hidden``.

        Raises:
            ValueError: a plan of the wrong length, a block range outside ``[0, L]``, or a bad
                ``logits_at``.
        """
        plan, n = p.plan, self.num_layers
        if plan is not None and plan.num_layers != n:
            raise ValueError(f"the plan has {plan.num_layers} blocks but the model has {n}")
        stop = p.stop if p.stop is not None else (n if plan is None else plan.blocks_run)
        if not 0 <= p.start <= stop <= n:
            raise ValueError(f"block range must satisfy 0 <= start <= stop <= {n}, got [{p.start}, {stop})")
        self.forward_calls += 1
        captured = [hidden] if p.capture_hidden else None
        pos_emb = self.arch.rotary(hidden, position_ids)
        route = self._route(hidden, cache, p, pos_emb)
        cache.begin(hidden.shape[1], base=p.base, visible=p.visible, tree_mask=p.tree_mask, persist=p.persist)
        try:
            if route.graphs is not None:
                route.graphs.set_rotary(pos_emb)
            with (
                p.weights.active() if isinstance(p.weights, LowBitLinears) else nullcontext(),
                self._backend(),
            ):
                if self.placement.split:
                    h = self._blocks_split(route.hidden, pos_emb, cache, p, stop, captured)
                else:
                    h = self._blocks(route.hidden, pos_emb, cache, p, stop, route, captured)
        finally:
            cache.end()
        self.block_evals += (stop - p.start) * h.shape[1]
        self.layer_loads += stop - p.start
        logits = self._logits(h, p) if p.logits_at is not None else None
        if self.placement.split:  # everything back on the input device
            logits = None if logits is None else logits.to(hidden.device)
            h = h.to(hidden.device)
            captured = None if captured is None else [c.to(hidden.device) for c in captured]
        hidden_states = torch.stack(captured) if captured is not None else None
        picked = None
        if p.pick is not None and p.head is None and logits is not None:
            picked = pick_tokens(logits[:, -1], p.pick)
        return ForwardOutput(logits, hidden_states, h, p.head if logits is not None else None, picked)

    def _route(self, hidden: torch.Tensor, cache: KVCache, p: Pass, pos_emb: Any) -> _Route:
        """Which paths this forward's branches may take: the CUDA graphs (a short forward on the
        graphs' KV pool, never a prefill) and the fused branches (the draft's compressed weights,
        or the model's, where they apply); decided before the cache is written."""
        fused = self.fused if p.weights is None else p.weights if isinstance(p.weights, FusedBlocks) else None
        fused = fused if fused is not None and fused.applies(hidden) and not self.placement.split else None
        cos = sin = None
        if fused is not None:
            hidden = hidden.contiguous()
            cos, sin = (e.contiguous() for e in pos_emb)
        graphs = self.graphs
        if graphs is not None and (cache.empty or not graphs.serves(cache, hidden)):
            graphs = None  # a prefill (each prompt length would be captured once, for one use)
        return _Route(hidden, fused, graphs, cos, sin)

    def _blocks(
        self,
        h: torch.Tensor,
        pos_emb: Any,
        cache: KVCache,
        p: Pass,
        stop: int,
        route: _Route,
        captured: list | None,
    ) -> torch.Tensor:
        """Blocks ``p.start .. stop-1`` over ``h``, each branch the plan runs by ``route``: the CUDA
        graphs, the fused branches, or the model's modules."""
        plan, arch, fused, graphs = p.plan, self.arch, route.fused, route.graphs
        for i in range(p.start, stop):
            if plan is None or plan.runs_attn(i):
                whole, tree = cache.block_mask(i) if graphs is not None else (False, None)
                if whole and graphs is not None:
                    h = h + graphs.attention(i, h, cache.claim(i)[2], tree)
                elif fused is not None and fused.attn[i] is not None:
                    h = fused.attention(i, h, route.cos, route.sin, cache)
                else:
                    h = h + arch.attention_branch(i, h, pos_emb, cache.attention_mask(i), cache)
            if plan is None or plan.runs_mlp(i):
                if graphs is not None:
                    h = h + graphs.mlp(i, h)
                elif fused is not None and fused.mlp[i] is not None:
                    h = fused.mlp_branch(i, h)
                else:
                    h = h + arch.mlp_branch(i, h)
            if captured is not None:
                captured.append(h)
        return h

    def _blocks_split(
        self, h: torch.Tensor, pos_emb: Any, cache: KVCache, p: Pass, stop: int, captured: list | None
    ) -> torch.Tensor:
        """`_blocks` of a model split across devices (`place`): the model's modules only, the
        residual stream and the position embeddings moved to each shard's device as they get there."""
        plan, arch, placement = p.plan, self.arch, self.placement
        on_device: dict[torch.device, Any] = {h.device: pos_emb}
        for i in range(p.start, stop):
            dev = placement.device_of(i)
            if h.device != dev:
                h = h.to(dev)
            if dev not in on_device:
                on_device[dev] = tuple(e.to(dev) for e in pos_emb)
            if plan is None or plan.runs_attn(i):
                h = h + arch.attention_branch(i, h, on_device[dev], cache.attention_mask(i), cache)
            if plan is None or plan.runs_mlp(i):
                h = h + arch.mlp_branch(i, h)
            if captured is not None:
                captured.append(h)
        return h

    def _head(
        self, x: torch.Tensor, head: DraftHead | None, weights: DraftWeights | None = None
    ) -> torch.Tensor:
        """Final norm and LM head (or ``head``) of ``x`` (..., d), on their devices when the model
        is split, the logits back on ``x``'s device. A draft whose ``weights`` are a compressed copy
        of the fused branches scores ``head`` in their `FusedBlocks.head` format (`DraftHead.logits`)."""
        fmt = weights.head if isinstance(weights, FusedBlocks) else None
        if not self.placement.split:
            normed = self.arch.final_norm(x)
            return self.arch.lm_head(normed) if head is None else head.logits(normed, fmt)
        norm_dev, head_dev = self._head_devices
        normed = self.arch.final_norm(x.to(norm_dev)).to(head_dev)
        logits = self.arch.lm_head(normed) if head is None else head.logits(normed, fmt)
        return logits.to(x.device)

    def _logits(self, h: torch.Tensor, p: Pass) -> torch.Tensor:
        """Final norm and LM head (or ``p.head``) at ``p.logits_at``, timed while `times_lm_head`."""
        timed = self.times_lm_head
        clock = synced_clock(self.device) if timed else no_clock
        t0 = clock()
        sel, at = h, p.logits_at
        if isinstance(at, str):
            if at == "last":
                sel = h[:, -1:]
            elif at != "all":
                raise ValueError(f"logits_at must be 'all', 'last', a tensor or None, got {at!r}")
        else:
            sel = h.index_select(1, at.to(h.device))
        logits = self._head(sel, p.head, p.weights)
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
        time is not added to ``lm_head_seconds`` (which counts the heads of forwards); callers
        time it as their own work (a selector's update).

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
