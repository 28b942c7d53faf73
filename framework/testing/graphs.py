"""A stand-in for CUDA's graph recording, so that a CPU test can check what the graph routes keep
(`framework.engine.execution.branches.BranchGraphs`' ``recorder``): a recorded function runs once when
recorded and again at each replay, writing into the outputs of its recording, as a CUDA graph
replays into the same memory (a caller holding a previous output sees it change).

    rec = StandInRecorder()
    adapter.executor.set_cuda_graphs(True, capture=True, route="forward", recorder=rec)
    ...
    assert len(rec.graphs) == 1 and rec.graphs[0].replays == 3
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class StandInGraph:
    """One recorded function: run at recording (its outputs are the graph's) and at each replay."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.replays = fn, 0
        self.out = fn()

    def replay(self) -> None:
        self.replays += 1
        _copy_into(self.out, self.fn())


def _copy_into(out: Any, new: Any) -> None:
    if isinstance(out, torch.Tensor):
        out.copy_(new)
    elif isinstance(out, dict):
        for key, t in out.items():
            _copy_into(t, new[key])
    elif isinstance(out, (tuple, list)):
        for t, n in zip(out, new, strict=True):
            _copy_into(t, n)


class StandInRecorder:
    """``fn -> (graph, outputs)``, as `BranchGraphs`' recorder; keeps every graph it recorded."""

    def __init__(self) -> None:
        self.graphs: list[StandInGraph] = []

    def __call__(self, fn: Callable[[], Any]) -> tuple[StandInGraph, Any]:
        g = StandInGraph(fn)
        self.graphs.append(g)
        return g, g.out
