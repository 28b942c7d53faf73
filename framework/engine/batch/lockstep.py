"""Rows that decode in lockstep: each row runs its one-sequence decoder, and their forwards merge.

Each row of a batch runs the one-sequence code (`framework.engine.decoding`) with its own decode
state and its own strategy instances, in a thread of its own. Only one thread runs at a time (a
baton passes between them and the scheduler), so nothing the rows share is touched concurrently
and a run is deterministic. When a row calls the adapter for a forward (`RowAdapter.forward`), it
hands the scheduler a `ForwardRequest` and waits. When every running row waits, the scheduler
runs their requests, merged where `merge_key` allows (`run_merged`), in this order:

1. what cannot merge (a prefill, a tree, a scratch pass: alone, as at batch 1);
2. draft steps and other appending forwards, one forward per key;
3. verifications, only once no row is drafting: the rows that stopped drafting early wait for
   the others, so a round's verification is one forward for the batch.

A row whose generation ends leaves: its thread returns, and no later forward holds it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from framework.engine.batch.merge import ForwardRequest, merge_key, run_alone, run_merged
from framework.engine.batch.rows import BatchCache, RowCache


class _Failed:
    """A forward's error, handed to each row that asked for it (raised in that row's thread)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Lockstep:
    """Runs one callable per row cooperatively and merges their forwards.

    Args:
        executor: the model's executor (`ModelAdapter.executor`).
        cache: the batch's KV buffers.
    """

    def __init__(self, executor: Any, cache: BatchCache) -> None:
        self.executor, self.cache = executor, cache
        self._cv = threading.Condition()
        self._turn: int | None = None  # the row that runs; None: the scheduler
        self._pending: dict[int, ForwardRequest] = {}
        self._answers: dict[int, Any] = {}
        #: forwards run, and rows they held (merged forwards count once)
        self.forwards = 0
        self.row_forwards = 0
        self.verifications = 0  # forwards that verified (a round's: one for the batch)
        self.prefill_seconds = 0.0  # spent in the rows' prefills (each alone, before the rows decode)

    def forward(self, req: ForwardRequest) -> Any:
        """Called in row ``req.row``'s thread: wait for the scheduler to run ``req``."""
        with self._cv:
            self._pending[req.row] = req
            self._turn = None
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._turn == req.row)
            answer = self._answers.pop(req.row)
        if isinstance(answer, _Failed):
            raise answer.error
        return answer

    def run(self, tasks: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``tasks[r]`` as row r until every one has returned; their results in order.

        Raises:
            the first row's error (by row), after every row has finished.
        """
        results: list[Any] = [None] * len(tasks)
        errors: dict[int, BaseException] = {}
        done: set[int] = set()

        def worker(row: int) -> None:
            with self._cv:
                self._cv.wait_for(lambda: self._turn == row)
            try:
                with torch.inference_mode():
                    results[row] = tasks[row]()
            except BaseException as e:  # handed to the caller below
                errors[row] = e
            with self._cv:
                done.add(row)
                self._turn = None
                self._cv.notify_all()

        threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(len(tasks))]
        for t in threads:
            t.start()
        for row in range(len(tasks)):
            self._resume(row)
        while self._pending:
            for group in self._next_groups():
                answers = self._execute(group)
                for req, answer in zip(group, answers, strict=False):
                    del self._pending[req.row]
                    self._answers[req.row] = answer
                for req in group:
                    self._resume(req.row)
        for t in threads:
            t.join()
        if errors:
            raise errors[min(errors)]
        return results

    def _resume(self, row: int) -> None:
        """Hand row ``row`` the baton and wait until it asks for a forward or returns."""
        with self._cv:
            self._turn = row
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._turn is None)

    def _next_groups(self) -> list[list[ForwardRequest]]:
        """The forwards to run now (module docstring's order), each a list of requests."""
        pending = sorted(self._pending.values(), key=lambda r: r.row)
        alone = [[r] for r in pending if merge_key(r) is None]
        if alone:
            return alone
        drafting = [r for r in pending if not r.verifies]
        chosen = drafting or pending
        keys: dict[Any, list[ForwardRequest]] = {}
        for r in chosen:
            keys.setdefault(merge_key(r), []).append(r)
        return list(keys.values())

    def _execute(self, group: list[ForwardRequest]) -> list[Any]:
        self.forwards += 1
        self.row_forwards += len(group)
        self.verifications += group[0].verifies
        try:
            with torch.inference_mode():
                if len(group) == 1:
                    prefill = group[0].cache.empty
                    t0 = time.perf_counter()
                    out = [run_alone(self.executor, group[0])]
                    if prefill:
                        self.prefill_seconds += time.perf_counter() - t0
                    return out
                return run_merged(self.executor, self.cache, group)
        except Exception as e:  # each row raises it where it asked
            return [_Failed(e)] * len(group)


class RowAdapter:
    """The model adapter as row ``row`` of a batch sees it: its forwards go through the lockstep
    (and merge with the other rows'), its cache is the row's `RowCache`; everything else is the
    adapter's."""

    def __init__(self, adapter: Any, row: int, lockstep: Lockstep) -> None:
        self._adapter, self.row, self._lockstep = adapter, row, lockstep

    def __getattr__(self, name: str) -> Any:
        return getattr(self._adapter, name)

    def forward(self, input_ids, position_ids, cache, plan=None, **options):  # type: ignore[no-untyped-def]
        return self._lockstep.forward(
            ForwardRequest(self.row, True, input_ids, position_ids, cache, plan, options)
        )

    def forward_from(self, hidden, position_ids, cache, plan=None, **options):  # type: ignore[no-untyped-def]
        return self._lockstep.forward(
            ForwardRequest(self.row, False, hidden, position_ids, cache, plan, options)
        )

    def new_cache(self, capacity: int, batch: int = 1) -> RowCache:
        cache = self._lockstep.cache.rows[self.row]
        if capacity > cache.capacity or batch != 1:
            raise ValueError(
                f"row {self.row} asked for {capacity} KV slots, the batch holds {cache.capacity}"
            )
        cache.committed, cache.lengths = 0, [0] * cache.num_layers  # a fresh generation of the row
        return cache
