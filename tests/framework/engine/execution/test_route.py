"""The route choice (`framework.engine.execution.route.choose_route`): each rule a forward must
meet to run as one whole graph, broken alone, sends it down the block-by-block route with that
rule's name as the reason; a forward that meets them all goes whole."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from framework import LayerPlan
from framework.engine.adapter import adapter_for
from framework.engine.execution.route import WHOLE_GRAPH, choose_route
from framework.engine.execution.spec import ForwardSpec
from framework.kernels.fused import FusedBlocks
from framework.testing import tiny_model

L, MAX_TOKENS = 4, 4


def _adapter(route: str = "forward"):
    adapter = adapter_for(tiny_model("llama", L, seed=0, dtype=torch.float32), fast_kernels=False)
    adapter.executor.set_cuda_graphs(True, capture=False, route=route, max_tokens=MAX_TOKENS)
    return adapter


def _cache(adapter, written: int = 6):
    """A cache on the KV pool with ``written`` committed slots."""
    cache = adapter.new_cache(64)
    cache.begin(written)
    for layer in range(L):
        cache.claim(layer)
    cache.end()
    cache.commit(written)
    return cache


def _why(adapter, spec=None, *, ids=None, cache=None, from_ids=True):
    ids = torch.zeros(1, 2, dtype=torch.long) if ids is None else ids
    route = choose_route(
        adapter.executor,
        spec or ForwardSpec(),
        ids,
        _cache(adapter) if cache is None else cache,
        from_ids=from_ids,
    )
    assert route.whole == (route.why == "")
    return route.why


def test_a_forward_that_meets_every_rule_goes_whole():
    assert _why(_adapter()) == ""


CASES = {
    "whole-forward graphs are on": lambda a: _why(_adapter("branch")),
    "it starts from token ids": lambda a: _why(a, from_ids=False),
    "its weights are not the fused branches' compressed copy": lambda a: _why(
        a, ForwardSpec(weights=object.__new__(FusedBlocks))
    ),
    "its plan has the model's depth": lambda a: _why(a, ForwardSpec(LayerPlan.full(L + 1))),
    "it is one sequence": lambda a: _why(a, ids=torch.zeros(2, 1, dtype=torch.long)),
    "its rows fit a graph": lambda a: _why(a, ids=torch.zeros(1, MAX_TOKENS + 1, dtype=torch.long)),
    "it is not a prefill": lambda a: _why(a, cache=a.new_cache(64)),
    "its cache is the KV pool": lambda a: (_cache(a), _why(a, cache=_cache(a)))[1],  # the second: own buffers
    "it starts at the first block": lambda a: _why(a, ForwardSpec(start=1)),
    "it runs to its plan's end": lambda a: _why(a, ForwardSpec(stop=L - 1)),
    "it writes the cache": lambda a: _why(a, ForwardSpec(base=6, persist=False)),
    "it sees the whole prefix": lambda a: _why(a, ForwardSpec(base=6, visible=3)),
    "it ends inside the pool": lambda a: _why(a, ForwardSpec(base=a.executor.graphs.pool.capacity - 1)),
}


@pytest.mark.parametrize("rule", [name for name, _ in WHOLE_GRAPH])
def test_each_rule_broken_alone_is_the_reason_the_forward_does_not_go_whole(rule):
    adapter = _adapter()
    if rule == "the model is on one device":
        cache = _cache(adapter)
        adapter.placement = SimpleNamespace(split=True)
        assert _why(adapter, cache=cache) == rule
        return
    assert _why(adapter, ForwardSpec()) == ""  # the same adapter meets every rule otherwise
    assert CASES[rule](adapter) == rule
