"""Which way one forward runs: `choose_route`, with every eligibility rule named in one place.

- **whole**: one CUDA graph from the token ids to the logits
  (`framework.engine.execution.forward_graph`), when every rule of `WHOLE_GRAPH` holds;
- **split**: a model split across devices runs the model's modules, block by block;
- otherwise block by block, each branch through the branch graphs (a short forward on the KV
  pool, never a prefill), the fused CPU branches (the model's or a draft's compressed weights,
  where they apply) or the model's modules, in that order.

`Route.why` names the first whole-graph rule a forward failed, so a test (or a researcher asking
why a forward was slow) reads the reason instead of reconstructing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from framework.engine.execution.spec import ForwardSpec
from framework.kernels.fused import FusedBlocks

if TYPE_CHECKING:
    from framework.engine.kv_cache import KVCache

#: The executor (`framework.engine.execution.executor.Executor`; not imported: it imports this).
Executor = Any


@dataclass(frozen=True)
class _Facts:
    ex: Executor
    spec: ForwardSpec
    batch: int
    rows: int
    cache: KVCache
    from_ids: bool


def _runs_to_plan_end(f: _Facts) -> bool:
    plan, n = f.spec.plan, f.ex.arch.num_layers
    return f.spec.stop is None or f.spec.stop == (n if plan is None else plan.blocks_run)


def _ends_inside_pool(f: _Facts) -> bool:
    base = f.spec.base if f.spec.base is not None else max(f.cache.lengths, default=0)
    return base + f.rows <= f.ex.graphs.pool.capacity  # type: ignore[union-attr]


#: What a forward needs to run as one whole graph, by name, checked in order.
WHOLE_GRAPH: tuple[tuple[str, Any], ...] = (
    ("whole-forward graphs are on", lambda f: f.ex.graphs is not None and f.ex.graphs.forwards is not None),
    ("it starts from token ids", lambda f: f.from_ids),
    (
        "its weights are not the fused branches' compressed copy",
        lambda f: not isinstance(f.spec.weights, FusedBlocks),
    ),
    ("the model is on one device", lambda f: not f.ex.resources.placement.split),
    (
        "its plan has the model's depth",
        lambda f: f.spec.plan is None or f.spec.plan.num_layers == f.ex.arch.num_layers,
    ),
    ("it is one sequence", lambda f: f.batch == 1),
    ("its rows fit a graph", lambda f: 1 <= f.rows <= f.ex.graphs.max_tokens),
    ("it is not a prefill", lambda f: not f.cache.empty),
    ("its cache is the KV pool", lambda f: f.ex.graphs.pool.holds(f.cache)),
    ("it starts at the first block", lambda f: f.spec.start == 0),
    ("it runs to its plan's end", _runs_to_plan_end),
    ("it writes the cache", lambda f: f.spec.persist),
    ("it sees the whole prefix", lambda f: f.spec.visible is None or f.spec.visible == f.spec.base),
    ("it ends inside the pool", _ends_inside_pool),
)


@dataclass(frozen=True)
class Route:
    """How one forward runs.

    Attributes:
        whole: as one whole-forward graph.
        why: the first rule of `WHOLE_GRAPH` it failed (``""`` when ``whole``).
        split: across devices, through the model's modules.
        branches: each branch through the branch graphs.
        fused: the fused CPU branches it runs (the model's, or a draft's compressed copy), or ``None``.
    """

    whole: bool
    why: str = ""
    split: bool = False
    branches: bool = False
    fused: FusedBlocks | None = None


def choose_route(
    ex: Executor, spec: ForwardSpec, hidden: torch.Tensor, cache: KVCache, *, from_ids: bool
) -> Route:
    """The route of a forward of ``spec`` over ``hidden`` (B, T, d) on ``cache`` (token ids (B, T)
    with ``from_ids``: the whole graph or nothing; the caller embeds them and asks again),
    decided before the cache is written."""
    facts = _Facts(ex, spec, hidden.shape[0], hidden.shape[1], cache, from_ids)
    why = next((name for name, holds in WHOLE_GRAPH if not holds(facts)), "")
    if not why:
        return Route(True)
    if from_ids:
        return Route(False, why)
    res = ex.resources
    if res.placement.split:
        return Route(False, why, split=True)
    g = ex.graphs
    branches = g is not None and not cache.empty and g.serves(cache, hidden.shape[0], hidden.shape[1])
    if spec.weights is None:
        fused = res.fused
    else:
        fused = spec.weights if isinstance(spec.weights, FusedBlocks) else None
    if fused is not None and not fused.applies(hidden if hidden.shape[0] == 1 else hidden[:1]):
        fused = None
    return Route(False, why, branches=branches, fused=fused)
