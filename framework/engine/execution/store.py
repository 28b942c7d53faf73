"""The graph store: every CUDA graph of one model, recorded once and replayed after that, with
the span policy and the bound (least recently used dropped first) written once for all of them.

Three kinds of graphs live here, each keyed by a tuple whose first item says its kind: one branch
(``"attn"``, ``"tree"``, ``"mlp"``: `framework.engine.execution.branches`), one whole forward
(``"forward"``: `framework.engine.execution.forward_graph`) and one strategy's device work
(``"work"``, ``"blocks"``: `framework.engine.execution.work`). Whole forwards and device work are
bounded: plans that change every round (SWIFT's search, CLaSp, DEL) record a graph per new plan. A
model's branch graphs are a finite set (blocks x token counts x spans) and are not.

Capturing costs time, so a timed run records none: before timing, the runner and the benchmark
size the pool and record every graph the method can use (`Executor.prepare_graphs`);
`captures` and `capture_seconds` count what was recorded, and the decoders report the captures
inside each generation. ``capture=False`` runs the same static functions without capturing them
(on a CPU: how the tests check the static code's arithmetic); a stand-in ``recorder`` checks the
bookkeeping (`framework.testing.graphs.StandInRecorder`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch

#: Graphs of whole forwards and device work kept at once (`GraphStore.max_graphs`).
MAX_GRAPHS = 256
#: The shortest attention span a graph reads; longer ones grow by 4x (`span`). Coarse, because a
#: span costs little: on an H200 a step of the SmolLM2 shape read 2,048 slots in 4.6% more time
#: than 256 (docs/performance.md), while every span is one more graph per forward.
MIN_SPAN = 2048
#: The kinds of keys that are not bounded (a model's branch graphs).
UNBOUNDED = ("attn", "tree", "mlp")


def span(end: int, capacity: int) -> int:
    """The attention span of a forward whose new tokens end at slot ``end`` on a pool of
    ``capacity`` slots: `MIN_SPAN`, times 4 until it holds ``end``, at most ``capacity``."""
    s = min(capacity, MIN_SPAN)
    while s < end and s < capacity:
        s = min(capacity, s * 4)
    return s


def spans(capacity: int) -> list[int]:
    """Every span a forward on a pool of ``capacity`` slots can use."""
    out = [span(1, capacity)]
    while out[-1] < capacity:
        out.append(span(out[-1] + 1, capacity))
    return out


class GraphStore:
    """Graphs keyed by tuples, recorded on first use and replayed after that.

    Args:
        device: the model's device.
        capture: record CUDA graphs (``None``: when the device is CUDA or a ``recorder`` is
            given); ``False`` runs each static function as it is.
        recorder: ``fn -> (graph, outputs)``, a stand-in for CUDA's recording (tests).
        max_graphs: bounded graphs kept (least recently used dropped first).

    Attributes:
        replays: calls served (replays, or static calls without capture).
        captures: graphs recorded (without capture: first uses, where a capture would happen).
        capture_seconds: wall time spent recording them.
        evicted: bounded graphs dropped for the bound.
        resets: times every graph was dropped because too many were retired.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        capture: bool | None = None,
        recorder: Callable[[Callable[[], Any]], tuple[Any, Any]] | None = None,
        max_graphs: int = MAX_GRAPHS,
    ) -> None:
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.device = device
        self.capture = (device.type == "cuda" or recorder is not None) if capture is None else capture
        if self.capture and device.type != "cuda" and recorder is None:
            raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {device}")
        self._recorder = recorder if recorder is not None else self._record
        self.max_graphs = max_graphs
        self.replays = self.captures = self.evicted = self.resets = 0
        self.capture_seconds = 0.0
        self._graphs: dict[tuple, tuple[Any, Any] | None] = {}  # key -> (graph, outputs); None uncaptured
        self._used: OrderedDict[tuple, None] = OrderedDict()  # bounded keys, least recently used first
        self._buffers: dict[tuple, Any] = {}  # a graph's static inputs, dropped with it
        self._pool = None  # the private memory pool every graph records into
        self._stream: Any = None  # the side stream that warms graphs up and records them
        self._retired: list[Any] = []  # dropped while others live (`_drop_graphs`)

    def run(self, key: tuple, fn: Callable[[], Any]) -> Any:
        """Replay the graph recorded under ``key``, recording ``fn`` first if there is none (counted
        in `captures`, timed in `capture_seconds`); without capture, run ``fn`` itself. ``fn``
        reads static inputs only, and its outputs are the graph's: the next replay overwrites
        them. A bounded key is marked used (`max_graphs`)."""
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
            out = fn()
        else:
            entry[0].replay()
            out = entry[1]
        if key[0] not in UNBOUNDED:
            self._touch(key)
        return out

    def buffers(self, key: tuple, make: Callable[[], Any]) -> Any:
        """The static inputs of ``key``'s graph, made by ``make`` on first use and dropped with it."""
        bufs = self._buffers.get(key)
        if bufs is None:
            with torch.inference_mode(False):
                bufs = self._buffers[key] = make()
        return bufs

    def recorded(self, key: tuple) -> bool:
        """Whether a graph (or, without capture, its first use) is recorded under ``key``."""
        return key in self._graphs

    def keys(self, kind: str) -> list[tuple]:
        """The keys recorded of one kind (their first item)."""
        return [k for k in self._graphs if k[0] == kind]

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

    def _touch(self, key: tuple) -> None:
        """Mark ``key`` used; drop the least recently used bounded graph beyond the bound, and
        every graph once as many are retired as the bound."""
        used = self._used
        if key in used:
            used.move_to_end(key)
            return
        used[key] = None
        if len(used) <= self.max_graphs:
            return
        old, _ = used.popitem(last=False)
        self.drop([old])
        self.evicted += 1
        if self.retired >= self.max_graphs:  # retired graphs hold memory: start anew
            self.clear()
            self.resets += 1

    def _drop_graphs(self, keep: Callable[[tuple], bool]) -> None:
        """Forget the graphs whose key ``keep`` refuses.

        Graphs recorded on one stream share cuBLAS's workspace for that stream, and destroying one
        clears it while the others may still use it (pytorch/pytorch#193402). So a graph dropped
        while others live is kept alive (unused) until all are dropped. Once none is left, PyTorch
        frees their private pool, whose id can then never record again (an internal assert of
        its caching allocator, seen on an H100): the next recording starts a new pool on a new
        stream."""
        kept = {k: v for k, v in self._graphs.items() if keep(k)}
        for k in [k for k in self._buffers if not keep(k)]:
            del self._buffers[k]
        for k in [k for k in self._used if not keep(k)]:
            del self._used[k]
        if len(kept) == len(self._graphs):
            return
        if kept:
            self._retired.extend(v for k, v in self._graphs.items() if k not in kept and v is not None)
        else:
            self._retired.clear()
            self._pool = self._stream = None
        self._graphs = kept

    def _record(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """Warm ``fn`` up, then capture it, both on this store's side stream (one per pool). The
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
