"""Counting the host work of a decoding round outside its forwards (issue 38, item 3).

On a GPU every tensor operation the decode loop dispatches outside the model's forwards is an
eager kernel launch (about 35 us of host time each on an H200's host), and every device-to-host
read a synchronisation. `count_host_work` counts both on any device, CPU included, so that a CPU
test can hold every preset to a budget per round:

- operations: every ATen operator dispatched inside the block (a ``TorchDispatchMode``), except
  inside the model's forwards (`ModelAdapter.forward`, ``run``, ``forward_from``: what the
  executor owns, one graph each on the forward route) and a strategy's static functions
  (`ModelAdapter.run_static`, ``run_with_blocks``: one graph each on that route too), by operator
  and by the line of project code that dispatched it;
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

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from framework.drafting.builder import DraftBuilder
from framework.engine.adapter import ModelAdapter
from framework.engine.decoding import SpeculativeDecoder
from framework.testing.syncs import HostReads, _site, count_host_reads

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

#: The adapter's methods whose work is the forward's (excluded). Its LM-head services for
#: strategies (``logits_from_hidden``, ``top1_from_hidden``: DEL's shadow tokens) are round work.
FORWARDS = ("forward", "run", "forward_from", "run_static", "run_with_blocks")


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
        draft_steps: tokens drafted step by step (`DraftBuilder.add` calls).
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
        """``(operations, host reads)`` per round outside the draft steps (`DraftBuilder.add`):
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
    saved = {name: getattr(ModelAdapter, name) for name in FORWARDS}
    round_fn, add_fn = SpeculativeDecoder._round, DraftBuilder.add

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

    try:
        for name, original in saved.items():
            setattr(ModelAdapter, name, excluded(original))
        SpeculativeDecoder._round = tallied(round_fn, "rounds", "round_ops", "round_reads")  # type: ignore[method-assign]
        DraftBuilder.add = tallied(add_fn, "draft_steps", "step_ops", "step_reads")  # type: ignore[method-assign]
        with count_host_reads(device_type, skip=lambda: inside[0] > 0) as reads, _Counting(work, inside):
            work.host_reads = reads  # reads made inside the forwards are the executor's: not counted
            yield work
    finally:
        for name, original in saved.items():
            setattr(ModelAdapter, name, original)
        SpeculativeDecoder._round = round_fn  # type: ignore[method-assign]
        DraftBuilder.add = add_fn  # type: ignore[method-assign]
