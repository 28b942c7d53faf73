"""CUDA graphs of each block's attention and MLP branch, for short forwards (``--cuda-graphs``).

Why: at batch 1 a GPU decoding step of a 7B model is bound by kernel launches, not by the device:
an eager Llama block launches about 40 small kernels (two RMSNorms, four projections, RoPE, the
cache write, attention, SiLU, the residual adds), each costing the host a few microseconds of
Python and driver work, while the device needs a few tens of microseconds for the whole block. A
captured CUDA graph replays a branch's kernels with one launch.

A skip plan decides per sub-layer whether a branch runs, so graphs are captured per branch (block
``i``'s attention, block ``i``'s MLP), per weights (the model's own, or a draft's low-bit copy:
`framework.kernels.lowbit`) and per number of tokens T (1 to `BranchGraphs.max_tokens`;
recorded before timing, `precapture`, else when first met), and any plan replays the ones it runs: draft steps of every selector,
plain steps, chain verifications and token-tree verifications share them. Prefills (a forward into
an empty cache: each prompt length would be captured for one use), longer blocks and scratch
evaluations that hide part of the prefix run eagerly.

How a branch becomes static (a graph fixes every address and shape):

- the input (the residual stream), the RoPE cos/sin and the first write slot live in static
  buffers (one set per T) that each call fills before the replay;
- the KV cache is a pool of buffers at a fixed address, which the model adapter's ``new_cache`` lends to one
  KV cache at a time (`BranchGraphs.lease`); the keys/values of the T new tokens are written at
  slots ``pos .. pos + T - 1`` computed inside the graph from a device tensor ``pos``
  (``index_copy_``), and attention reads the first ``span`` slots of the layer under a mask
  computed inside the graph from the same slots (causal, or a token tree's mask copied into a
  static (T, T) buffer), so neither depends on the step. The span is the used length rounded up to
  a power of two (at least `MIN_SPAN`, at most the pool's capacity): one graph per span, so a step
  after a long prompt reads what is used, not the whole pool;
- the branch itself is the model's own modules, called as `ModelAdapter.attention_branch` and
  `ModelAdapter.mlp_branch` call them (no forked modeling code), with a small cache object whose
  ``update`` does the slot write.

Capturing costs time (each graph is recorded once), so a timed run records none: before timing,
the runner and the benchmark size the pool for the run's longest prompt and answer (`reserve`)
and record every graph the method can use (`precapture`: each token count it drafts and verifies,
each span up to the pool's capacity). `captures` and `capture_seconds` count what was recorded;
the decoders report the captures inside each generation.

Numerics: attending over a span under a mask gives the same function as attending to the used
prefix (masked scores are ``finfo.min``, whose softmax weight is exactly 0), but the reduction
runs over more slots, so results agree to rounding, not bit for bit. On CUDA greedy
equality with plain decoding is not guaranteed by construction anyway (docs/performance.md);
plain decoding with ``--cuda-graphs`` takes the same graphs.

``capture=False`` runs the same static branches without capturing them: on a CPU this is how the
tests check the static path's arithmetic (``tests/framework/kernels/test_graphs.py``).
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from framework.kernels.lowbit import active_format
from framework.kernels.protocols import BranchModel, CacheSlots

#: The first item of a branch graph's key (others are a whole forward's or a strategy's work).
BRANCHES = ("attn", "tree", "mlp")
#: Smallest pool capacity (slots); a larger request rounds up to the next power of two.
MIN_CAPACITY = 512
#: Smallest attention span (slots) a graph reads; spans are powers of two up to the pool capacity.
MIN_SPAN = 256


def _pow2(n: int, lo: int) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


class _SlotCache:
    """What an HF attention module needs of a cache: ``update`` writes the new tokens' K/V of one
    layer at ``slots`` (a device tensor) and returns the layer's first ``span`` slots."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, span: int) -> None:
        self.keys, self.values, self.slots, self.span = keys, values, slots, span

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.slots, key)
        v.index_copy_(2, self.slots, value)
        return k[:, :, : self.span], v[:, :, : self.span]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # pragma: no cover - HF compatibility only
        return 0


class BranchGraphs:
    """Static branches of every block for forwards of 1 to ``max_tokens`` tokens, captured as CUDA
    graphs on first use.

    Args:
        arch: the model arch whose blocks are run.
        capture: capture CUDA graphs (``None``: when the model is on CUDA); ``False`` runs the
            static branches eagerly.
        max_tokens: the longest forward served (a chain verification of k drafts has k + 1
            tokens); longer ones run eagerly.

    Attributes:
        replays: branch calls served (graph replays, or static calls without capture).
        captures: graphs recorded so far (each branch, T and span once per pool); without capture,
            the first use of each, where a capture would have happened.
        capture_seconds: wall time spent recording them.
    """

    def __init__(
        self,
        arch: BranchModel,
        *,
        capture: bool | None = None,
        max_tokens: int = 64,
        recorder: Callable[[Callable[[], Any]], tuple[Any, Any]] | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.arch = arch
        self.max_tokens = max_tokens
        self.device = arch.device
        self.capture = (self.device.type == "cuda" or recorder is not None) if capture is None else capture
        if self.capture and self.device.type != "cuda" and recorder is None:
            raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {self.device}")
        #: ``fn -> (graph, outputs)``: records a graph (`_record`: CUDA's); a stand-in with a
        #: ``replay()`` method checks the bookkeeping on a CPU (tests)
        self._recorder = recorder if recorder is not None else self._record
        self.replays = 0
        self.captures = 0
        self.capture_seconds = 0.0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._holder: Callable[[], Any] | None = None
        # (branch, block, T, span, low-bit format or None), or ("forward", spec) for a whole
        # forward (framework.engine.graphed) -> (graph, outputs), None uncaptured
        self._graphs: dict[tuple, tuple[Any, Any] | None] = {}
        self._pool = None  # the private memory pool every graph of this object records into
        self._stream: Any = None  # the side stream that warms graphs up and records them
        self._retired: list[tuple[Any, torch.Tensor]] = []  # dropped while others live (_drop_graphs)
        self._hidden = arch.hidden_size
        with torch.inference_mode(False):
            self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
            self._offsets = torch.arange(max_tokens, device=self.device)
        self._pos_value = -1
        #: per T: the static residual input and RoPE cos/sin
        self._x: dict[int, torch.Tensor] = {}
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._tree: dict[int, torch.Tensor] = {}  # per T: the (T, T) tree mask of a tree forward
        self._arange: torch.Tensor | None = None

    # ------------------------------------------------------------------ the KV pool
    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[3]

    def lease(self, capacity: int, batch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pool's buffers for a new cache of ``capacity`` slots, or ``None`` (the cache then
        allocates its own and runs eagerly): a batch of several sequences, or a pool still lent
        to a live cache that was not `release`d. A larger capacity than the pool's reallocates
        the pool (and drops its graphs)."""
        if batch != 1:
            return None
        if self._holder is not None and self._holder() is not None:
            gc.collect()  # a holder kept alive only by a reference cycle
            if self._holder() is not None:
                return None
        self.reserve(capacity)
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def reserve(self, capacity: int) -> None:
        """Make the pool hold at least ``capacity`` slots (rounded up to a power of two, at least
        `MIN_CAPACITY`). Growing it reallocates the pool and drops every graph recorded on it, so
        a run sizes it before it records any (`precapture`)."""
        if capacity <= self.capacity:
            return
        cap = _pow2(capacity, MIN_CAPACITY)
        a = self.arch
        shape = (a.num_layers, 1, a.num_kv_heads, cap, a.head_dim)
        self._drop_graphs(lambda _key: False)
        self.keys = self.values = None
        with torch.inference_mode(False):
            # zeros, not empty: masked slots still enter the attention product (times 0)
            self.keys = torch.zeros(shape, dtype=a.dtype, device=self.device)
            self.values = torch.zeros(shape, dtype=a.dtype, device=self.device)
            self._arange = torch.arange(cap, device=self.device)

    def span(self, end: int) -> int:
        """The attention span of a forward whose new tokens end at slot ``end``: ``end`` rounded up
        to a power of two, at least `MIN_SPAN`, at most the pool's capacity."""
        return min(self.capacity, _pow2(end, MIN_SPAN))

    def spans(self) -> list[int]:
        """Every span a forward on the current pool can use."""
        out, s = [], min(self.capacity, MIN_SPAN)
        while s < self.capacity:
            out.append(s)
            s *= 2
        return [*out, self.capacity]

    def lent_to(self, cache: CacheSlots) -> None:
        """Record that ``cache`` holds the pool (until it is released or garbage)."""
        self._holder = weakref.ref(cache)

    def give_back(self, cache: CacheSlots) -> None:
        if self._holder is not None and self._holder() is cache:
            self._holder = None

    def holds(self, cache: CacheSlots) -> bool:
        """Whether ``cache`` writes into the pool (a cache that grew past it no longer does)."""
        return self.keys is not None and cache.keys is self.keys

    def serves(self, cache: CacheSlots, hidden: torch.Tensor) -> bool:
        """Whether a forward of ``hidden`` (B, T, d) on ``cache`` can take the graphs: one
        sequence of at most `max_tokens` tokens on a cache that `holds` the pool."""
        b, t = hidden.shape[:2]
        return b == 1 and 1 <= t <= self.max_tokens and self.holds(cache)

    # ------------------------------------------------------------------ one forward
    def set_rotary(self, pos_emb: Any) -> None:
        """Copy this forward's RoPE cos/sin into the static buffers of its T (once per forward)."""
        cos, sin = pos_emb
        t = cos.shape[-2]
        bufs = self._rope.get(t)
        if bufs is None or bufs[0].shape != cos.shape:
            with torch.inference_mode(False):
                bufs = self._rope[t] = (
                    torch.zeros(cos.shape, dtype=cos.dtype, device=self.device),
                    torch.zeros(sin.shape, dtype=sin.dtype, device=self.device),
                )
            self._drop_graphs(lambda key: key[0] not in BRANCHES or key[2] != t)  # branches of T
        bufs[0].copy_(cos)
        bufs[1].copy_(sin)

    def attention(
        self, i: int, hidden: torch.Tensor, slot: int, tree: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Block ``i``'s attention branch output (without the residual) for T tokens written at
        slots ``slot .. slot + T - 1``. Token j attends to every slot before ``slot`` and, among
        the new tokens, to those before it (``tree`` ``None``) or to those ``tree[j]`` allows."""
        if slot != self._pos_value:
            self.pos.fill_(slot)
            self._pos_value = slot
        t = hidden.shape[1]
        span = self.span(slot + t)
        if tree is None:
            return self._run(("attn", i, t, span), hidden, lambda: self._static_attention(i, t, False, span))
        self._tree_buffer(t).copy_(tree, non_blocking=True)
        return self._run(("tree", i, t, span), hidden, lambda: self._static_attention(i, t, True, span))

    def _tree_buffer(self, t: int) -> torch.Tensor:
        buf = self._tree.get(t)
        if buf is None:
            with torch.inference_mode(False):
                buf = self._tree[t] = torch.zeros(t, t, dtype=torch.bool, device=self.device)
        return buf

    def mlp(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """Block ``i``'s MLP branch output (without the residual)."""
        t = hidden.shape[1]
        return self._run(("mlp", i, t, 0), hidden, lambda: self.arch.mlp_branch(i, self._x[t]))

    def _static_attention(self, i: int, t: int, tree: bool, span: int) -> torch.Tensor:
        assert self.keys is not None and self.values is not None and self._arange is not None
        dtype = self.arch.dtype
        slots = self.pos + self._offsets[:t]  # (T,)
        arange = self._arange[:span]
        if tree:  # every slot before pos, and the tree's own pattern over the block's slots
            rel = arange - self.pos  # (span,)
            inside = (rel >= 0) & (rel < t)
            among = self._tree[t].index_select(1, rel.clamp(0, t - 1)) & inside[None, :]
            hidden = ~((rel < 0)[None, :] | among)  # (T, span)
        else:  # causal: beyond each token's own slot
            hidden = arange[None, :] > slots[:, None]
        mask = torch.zeros(hidden.shape, dtype=dtype, device=self.device)
        mask = mask.masked_fill(hidden, torch.finfo(dtype).min)[None, None]
        cache = _SlotCache(self.keys, self.values, slots, span)
        return self.arch.attention_branch(i, self._x[t], self._rope[t], mask, cache)

    def _input(self, t: int) -> torch.Tensor:
        x = self._x.get(t)
        if x is None:
            with torch.inference_mode(False):
                x = self._x[t] = torch.zeros(1, t, self._hidden, dtype=self.arch.dtype, device=self.device)
        return x

    def _run(
        self, key: tuple[str, int, int, int], hidden: torch.Tensor, fn: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        self._input(hidden.shape[1]).copy_(hidden)
        # a draft's low-bit weights record graphs of their own
        return self.run((*key, active_format()), fn)

    def run(self, key: tuple, fn: Callable[[], Any]) -> Any:
        """Replay the graph recorded under ``key``, recording ``fn`` first if there is none (counted
        in `captures` and timed in `capture_seconds`); without capture, run ``fn`` itself. ``fn``
        reads static inputs only, and its outputs are the graph's: the next replay overwrites them."""
        self.replays += 1
        if key not in self._graphs:
            t0 = time.perf_counter()
            self._graphs[key] = self._recorder(fn) if self.capture else None
            if self.capture and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the recording's device work, timed whole
            self.captures += 1
            self.capture_seconds += time.perf_counter() - t0
        entry = self._graphs[key]
        if entry is None:  # not capturing: the static code runs as it is
            return fn()
        graph, out = entry
        graph.replay()
        return out

    def recorded(self, key: tuple) -> bool:
        """Whether a graph (or, without capture, its first use) is recorded under ``key``."""
        return key in self._graphs

    def drop(self, keys: Iterable[tuple]) -> None:
        """Forget the graphs of ``keys`` (`_drop_graphs`: kept alive while others live)."""
        gone = set(keys)
        self._drop_graphs(lambda key: key not in gone)

    def clear(self) -> None:
        """Forget every graph: the retired ones are destroyed too, and the next recording starts
        a new pool on a new stream (`_drop_graphs`)."""
        self._drop_graphs(lambda _key: False)

    @property
    def retired(self) -> int:
        """Graphs dropped while others lived, kept alive until every graph is dropped."""
        return len(self._retired)

    # ------------------------------------------------------------------ before timing
    def precapture(
        self,
        rotary: Callable[[int], Any],
        *,
        chain: Iterable[int] = (),
        tree: Iterable[int] = (),
        mlp: Iterable[int] = (),
    ) -> int:
        """Record, on the current pool, every graph forwards of these token counts can use, so
        that none is recorded while timed: each block's attention for ``chain`` (causal) and
        ``tree`` (a token tree's mask) counts at every span (`spans`), its MLP for all three.
        Counts above `max_tokens` take the eager path and are skipped. The recording forwards
        write garbage into the pool's slots, so the pool must not be lent (between generations).

        Args:
            rotary: ``T -> the (cos, sin) of T positions`` (the architecture's rotary embedding).
            chain: token counts T of causal forwards.
            tree: token counts T of token-tree verifications.
            mlp: token counts T of forwards whose attention runs eagerly (scratch passes).

        Returns:
            The graphs recorded now.

        Raises:
            RuntimeError: the pool is lent to a live cache.
        """
        if self._holder is not None and self._holder() is not None:
            raise RuntimeError("precapture needs the KV pool back (a cache still holds it)")
        self.reserve(MIN_CAPACITY)
        before = self.captures
        fits = lambda ts: sorted({t for t in ts if 1 <= t <= self.max_tokens})  # noqa: E731
        chain_t, tree_t = fits(chain), fits(tree)
        for t in sorted({*chain_t, *tree_t, *fits(mlp)}):
            x = self._input(t)
            self.set_rotary(rotary(t))
            for i in range(self.arch.num_layers):
                self.mlp(i, x)
                for span in self.spans() if t in chain_t or t in tree_t else ():
                    slot = max(0, span - t)  # a forward ending inside this span
                    if t in chain_t:
                        self.attention(i, x, slot)
                    if t in tree_t:
                        self.attention(
                            i, x, slot, torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
                        )
        return self.captures - before

    def _drop_graphs(self, keep: Callable[[tuple], bool]) -> None:
        """Forget the graphs whose key ``keep`` refuses.

        Graphs recorded on one stream share cuBLAS's workspace for that stream, and destroying one
        clears it while the others may still use it (pytorch/pytorch#193402). So a graph dropped
        while others live is kept alive (unused) until all are dropped. Once none is left, PyTorch
        frees their private pool, whose id can then never record again (an internal assert of
        its caching allocator, seen on an H100): the next recording starts a new pool on a new
        stream."""
        kept = {k: v for k, v in self._graphs.items() if keep(k)}
        if len(kept) == len(self._graphs):
            return
        if kept:
            self._retired.extend(v for k, v in self._graphs.items() if k not in kept and v is not None)
        else:
            self._retired.clear()
            self._pool = self._stream = None
        self._graphs = kept

    def _record(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """Warm ``fn`` up, then capture it, both on this object's side stream (one per pool). The
        warm-up runs on the real inputs, so its cache write is the one the replay repeats; on the
        capturing stream it also gives cuBLAS that stream's workspace before the capture."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=side):
            out = fn()
        return graph, out
