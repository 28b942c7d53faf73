"""Counting the host work of a decoding round outside its forwards (issue 38, item 3).

On a GPU every tensor operation the decode loop dispatches outside the model's forwards is an
eager kernel launch (about 35 us of host time each on an H200's host), and every device-to-host
read a synchronisation. `count_host_work` counts both on any device, CPU included, so that a CPU
test can hold every preset to a budget per round:

- operations: every ATen operator dispatched inside the block (a ``TorchDispatchMode``), except
  inside the model's forwards (`Executor.forward`, ``run``, ``forward_from``: what the
  executor owns, one graph each on the forward route) and a strategy's keyed device functions
  (`framework.engine.execution.work.DeviceWork.execute`: one graph each on that route too; a function the
  engine could not key runs eagerly there too, and its operations count; its random numbers count
  too, one operation a draw: they are drawn before its graph replays), by operator and by the
  line of project code that dispatched it;
- host reads: `framework.testing.syncs.count_host_reads`, outside the forwards too.

    with count_host_work() as work:
        res = decoder.generate(prompt, stop)
    rounds = len(res.accept_lengths)
    print(work.ops / rounds, work.reads / rounds, work.by_site.most_common(5))

Metadata-only operators (views, ``detach``, size queries) launch no kernel on a GPU and are not
counted (`FREE`), nor is a ``.to()`` that returns its input (`IF_NEW`). ``torch.tensor`` from host
data dispatches one ``aten.detach_``: it stays counted, standing for the host-to-device copy
(`framework.utils.upload`) that the same line makes on a GPU.
"""

from __future__ import annotations

import collections
import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from framework.engine.adapter import adapter_for
from framework.engine.decoding import SpeculativeDecoder, StopCondition
from framework.engine.draft_steps import DraftSteps
from framework.engine.execution.executor import Executor
from framework.engine.execution.work import EAGER_RUNS, DeviceWork
from framework.testing.stubs import default_strategy_instance, prepare_context, random_prompt
from framework.testing.syncs import HostReads, _site, count_host_reads
from framework.testing.tiny import tiny_model
from framework.types import RandomStream

T = TypeVar("T")

#: ATen operators that launch no kernel (views and metadata): not counted as work.
FREE = frozenset(
    {
        "aten.view",
        "aten._unsafe_view",
        "aten.slice",
        "aten.select",
        "aten.unsqueeze",
        "aten.squeeze",
        "aten.expand",
        "aten.permute",
        "aten.transpose",
        "aten.t",
        "aten.detach",
        "aten.alias",
        "aten.as_strided",
        "aten.unbind",
        "aten.split",
        "aten.split_with_sizes",
        "aten.chunk",
        "aten.narrow",
        "aten.reshape",
        "aten.sym_size",
        "aten.sym_stride",
        "aten.sym_numel",
        "aten.sym_storage_offset",
        "aten.is_same_size",
        "aten.lift_fresh",
        "aten._local_scalar_dense",  # the host read itself (counted as a read)
        "aten.item",
        "aten.resolve_conj",  # ``tolist``'s: a view unless the tensor is complex and conjugated
        "aten.resolve_neg",
        "aten.promote_types",  # a dtype computed on the host
    }
)
#: Operators that launch a kernel only when they produce a new tensor: ``.to()`` to the dtype and
#: device a tensor already has returns it as is.
IF_NEW = frozenset({"aten.to"})

#: The methods whose work is the forward's or a graph's (excluded): the adapter's forwards and the
#: keyed device functions strategies hand the engine. The adapter's LM-head services for
#: strategies called outside those (``logits_from_hidden``, ``top1_from_hidden``) are round work.
FORWARDS = (
    (Executor, "forward"),
    (Executor, "run"),
    (Executor, "forward_from"),
    (DeviceWork, "execute"),
)


@dataclass
class HostWork:
    """What `count_host_work` saw outside the forwards.

    Attributes:
        by_op: operations by ATen operator.
        by_site: operations by the line of project code that dispatched them.
        host_reads: device-to-host reads (`HostReads`, by site).
        rounds: speculative rounds run (``SpeculativeDecoder._round`` calls).
        round_ops: operations dispatched inside those rounds.
        round_reads: host reads made inside those rounds.
        draft_steps: tokens drafted step by step (`DraftSteps.add` calls).
        step_ops: operations inside those steps (choosing each draft token: argmax, or softmax and
            top-1 and top-k, or the sampler's warping), part of ``round_ops``.
        step_reads: host reads inside them (a stop rule's read of each step's confidence), part
            of ``round_reads``.
    """

    by_op: Counter = field(default_factory=Counter)
    by_site: Counter = field(default_factory=Counter)
    host_reads: HostReads = field(default_factory=HostReads)
    rounds: int = 0
    round_ops: int = 0
    round_reads: int = 0
    draft_steps: int = 0
    step_ops: int = 0
    step_reads: int = 0
    #: draft tokens proposed in the block (filled by the caller from its generations)
    drafted: int = 0

    @property
    def ops(self) -> int:
        """Operations dispatched outside the forwards (each an eager launch on a GPU)."""
        return sum(self.by_op.values())

    @property
    def reads(self) -> int:
        """Device-to-host reads outside the forwards."""
        return self.host_reads.total

    def per_round(self) -> tuple[float, float]:
        """``(operations, host reads)`` per speculative round, inside the rounds (a generation's
        prefill and its last bookkeeping are not a round's)."""
        n = max(1, self.rounds)
        return self.round_ops / n, self.round_reads / n

    def per_round_outside_steps(self) -> tuple[float, float]:
        """``(operations, host reads)`` per round outside the draft steps (`DraftSteps.add`):
        the round's own work, whatever its draft length."""
        n = max(1, self.rounds)
        return (self.round_ops - self.step_ops) / n, (self.round_reads - self.step_reads) / n


def _same_storage(out: object, src: object) -> bool:
    """``out`` is ``src``'s data as is (no kernel made it)."""
    return (
        isinstance(out, torch.Tensor)
        and isinstance(src, torch.Tensor)
        and out.dtype == src.dtype
        and out.device == src.device
        and out.data_ptr() == src.data_ptr()
    )


class _Counting(TorchDispatchMode):
    def __init__(self, work: HostWork, inside: list[int]) -> None:
        super().__init__()
        self.work, self.inside = work, inside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside[0]:
            name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
            if name not in FREE:
                out = func(*args, **(kwargs or {}))
                if name not in IF_NEW or not _same_storage(out, args[0] if args else None):
                    self.work.by_op[name] += 1
                    site = _site()
                    if site is not None:
                        self.work.by_site[site] += 1
                return out
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_work(device_type: str | None = None) -> Iterator[HostWork]:
    """Count the operations and host reads of project code inside the block, the model's forwards
    excluded (see the module docstring). Not thread-safe: it patches the adapter's methods and
    `torch.Tensor`'s readers for the duration of the block.

    Args:
        device_type: count only host reads of tensors on this device type (``None``: all).
    """
    work = HostWork()
    inside = [0]
    saved = {(cls, name): getattr(cls, name) for cls, name in FORWARDS}
    round_fn, add_fn, fill_fn = SpeculativeDecoder._round, DraftSteps.add, RandomStream.fill

    def tallied(original, count, ops_field: str, reads_field: str):
        """``original`` with the work done inside each call added to two of ``work``'s fields."""

        def call(self, *args, **kwargs):
            ops, reads = work.ops, work.reads
            try:
                return original(self, *args, **kwargs)
            finally:
                setattr(work, count, getattr(work, count) + 1)
                setattr(work, ops_field, getattr(work, ops_field) + work.ops - ops)
                setattr(work, reads_field, getattr(work, reads_field) + work.reads - reads)

        return call

    def excluded(original):
        def call(self, *args, **kwargs):
            inside[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                inside[0] -= 1

        return call

    def included(original):
        """Counted even inside an excluded call: a device function's random numbers are drawn
        before its graph replays, one launch each (`RandomStream.fill`)."""

        def call(self, *args, **kwargs):
            held, inside[0] = inside[0], 0
            try:
                return original(self, *args, **kwargs)
            finally:
                inside[0] = held

        return call

    try:
        for (cls, name), original in saved.items():
            setattr(cls, name, excluded(original))
        SpeculativeDecoder._round = tallied(round_fn, "rounds", "round_ops", "round_reads")  # type: ignore[method-assign]
        DraftSteps.add = tallied(add_fn, "draft_steps", "step_ops", "step_reads")  # type: ignore[method-assign]
        RandomStream.fill = included(fill_fn)  # type: ignore[method-assign]
        with count_host_reads(device_type, skip=lambda: inside[0] > 0) as reads, _Counting(work, inside):
            work.host_reads = reads  # reads made inside the forwards are the executor's: not counted
            yield work
    finally:
        for (cls, name), original in saved.items():
            setattr(cls, name, original)
        SpeculativeDecoder._round = round_fn  # type: ignore[method-assign]
        DraftSteps.add = add_fn  # type: ignore[method-assign]
        RandomStream.fill = fill_fn  # type: ignore[method-assign]


#: The engine's limits on a round's host work outside its forwards (issue 38): operations (each an
#: eager launch on a GPU) and device-to-host reads besides a stop rule's reads of each drafted
#: token's confidence (each read a synchronisation).
ROUND_OPS_LIMIT, ROUND_READS_LIMIT = 20, 1.0


@dataclass
class HostWorkReport:
    """What `measure_host_work` saw, per speculative round, against the engine's limits.

    Attributes:
        rounds: speculative rounds decoded.
        ops: operations a round outside the forwards and keyed device functions.
        reads: host reads a round.
        reads_outside_steps: host reads a round besides the draft steps' (a stop rule's).
        eager: the warnings of device work the engine could not key (it ran eagerly).
        work: the full count (`HostWork`: by operator, by line, the reads by site).
    """

    rounds: int
    ops: float
    reads: float
    reads_outside_steps: float
    eager: list[str]
    work: HostWork

    @property
    def within_limits(self) -> bool:
        """At most `ROUND_OPS_LIMIT` operations and `ROUND_READS_LIMIT` reads (besides a stop
        rule's) a round, and no device work left eager."""
        return (
            self.ops <= ROUND_OPS_LIMIT and self.reads_outside_steps <= ROUND_READS_LIMIT and not self.eager
        )

    def describe(self, top: int = 5) -> str:
        """A few lines for a person: the numbers against the limits, then where the work was."""
        verdict = "within the limits" if self.within_limits else "OVER the limits"
        lines = [
            f"{self.rounds} rounds: {self.ops:.1f} operations a round (limit {ROUND_OPS_LIMIT}), "
            f"{self.reads_outside_steps:.2f} host reads a round besides a stop rule's (limit "
            f"{ROUND_READS_LIMIT:g}; {self.reads:.2f} in all): {verdict}"
        ]
        rounds = max(1, self.rounds)
        lines += [f"  {n / rounds:5.1f} a round at {site}" for site, n in self.work.by_site.most_common(top)]
        lines += [
            f"  reads: {n / rounds:.2f} a round at {site[1]} ({site[0]})"
            for site, n in self.work.host_reads.by_site.most_common(top)
        ]
        lines += [f"  eager: {w}" for w in self.eager]
        return "\n".join(lines)

    def busiest_sites(self, top: int = 3) -> list[tuple[str, float, str]]:
        """``[(site, per round, what), ...]``: the ``top`` lines doing the most work a round,
        operations and reads apart, lines outside ``framework/`` (a strategy's) first."""
        rounds = max(1, self.rounds)
        sites = [(site, n / rounds, "operations") for site, n in self.work.by_site.items()]
        sites += [
            (site, n / rounds, f"reads ({how})") for (how, site), n in self.work.host_reads.by_site.items()
        ]
        sites.sort(key=lambda t: (t[0].startswith("framework/"), -t[1], t[0]))
        return sites[:top]

    def summary(self) -> dict[str, Any]:
        """The numbers for a run's metadata (JSON)."""
        return {
            "rounds": self.rounds,
            "ops": round(self.ops, 2),
            "reads": round(self.reads_outside_steps, 3),
            "within_limits": self.within_limits,
            "sites": [{"site": s, "per_round": round(n, 3), "what": w} for s, n, w in self.busiest_sites()],
            "eager": self.eager,
        }

    def line(self, label: str) -> str:
        """One line of a run's report for method ``label``: its work a round against the
        limits, and the lines of its strategies that did the most (over the limits, the busiest
        lines, the engine's included)."""
        text = (
            f"{label}: {self.ops:.1f} operations and {self.reads_outside_steps:.2f} host reads a round "
            f"outside the forwards ({self.rounds} rounds)"
        )
        text += (
            ": within the limits"
            if self.within_limits
            else f": OVER the limits ({ROUND_OPS_LIMIT} operations, {ROUND_READS_LIMIT:g} read)"
        )
        sites = [
            t for t in self.busiest_sites() if not self.within_limits or not t[0].startswith("framework/")
        ]
        if sites:  # a strategy's lines always; the engine's only when over
            text += "; most at " + ", ".join(f"{s} ({n:.2f} {w} a round)" for s, n, w in sites)
        if self.eager:
            text += f"; device work left eager: {self.eager[0]}"
        return text


def counted(decode: Callable[[], T]) -> tuple[T, HostWorkReport]:
    """``decode()``'s result and the host work of its rounds (`count_host_work`, under
    ``torch.inference_mode``), as a `HostWorkReport`."""
    before = collections.Counter(EAGER_RUNS)
    with torch.inference_mode(), count_host_work() as work:
        out = decode()
    ops, reads = work.per_round()
    eager = sorted(EAGER_RUNS - before)
    return out, HostWorkReport(work.rounds, ops, reads, work.per_round_outside_steps()[1], eager, work)


def measure_host_work(
    selector: Any = "static",
    length: Any = "fixed",
    drafter: Any = "layer_skip",
    verifier: Any = "greedy",
    *,
    model: Any = None,
    prompts: list[torch.Tensor] | None = None,
    max_new_tokens: int = 32,
) -> HostWorkReport:
    """Decode a few prompts with these strategies and count the host work of each round outside
    the forwards (`count_host_work`): is a strategy fast on a GPU, measured on a CPU?

    Args:
        selector: a registered name (default config) or an instance.
        length: a registered name (default config) or an instance.
        drafter: a registered name (default config) or an instance.
        verifier: a registered name (default config) or an instance.
        model: an HF causal LM (default: a random 8-block Llama built in-process, float64).
        prompts: LongTensor (1, P) prompts (default: two random ones of 12 tokens).
        max_new_tokens: new tokens per prompt.

    Returns:
        the `HostWorkReport` (``within_limits``, ``describe()``).
    """

    def instance(kind: str, s: Any) -> Any:
        return default_strategy_instance(kind, s) if isinstance(s, str) else s

    if model is None:
        model = tiny_model("llama", num_layers=8, seed=0)
    vocab = int(model.config.vocab_size)
    if prompts is None:
        prompts = [random_prompt(12, vocab, seed=seed) for seed in (0, 1)]
    adapter = adapter_for(model)
    dec = SpeculativeDecoder(
        adapter,
        instance("selector", selector),
        instance("length", length),
        instance("drafter", drafter),
        instance("verifier", verifier),
    )
    dec.prepare(prepare_context(adapter))
    _, report = counted(lambda: [dec.generate(prompt, StopCondition(max_new_tokens)) for prompt in prompts])
    return report
