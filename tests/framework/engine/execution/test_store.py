"""The graph store (`framework.engine.execution.store`): dropped graphs kept alive while others
live, a new pool and stream once every graph is gone."""

from __future__ import annotations

import torch

from framework.engine.adapter import adapter_for
from framework.engine.execution.pool import MIN_CAPACITY
from framework.testing import tiny_model


def test_dropping_some_graphs_keeps_them_alive_and_dropping_all_starts_a_new_pool_and_stream():
    """Graphs recorded on one stream share cuBLAS's workspace for it (pytorch/pytorch#193402): one
    dropped while others live stays alive, unused. Once every graph is gone, PyTorch frees their
    private pool and its id cannot record again (an allocator assert on an H100), so the next
    recording gets a new pool and a new stream."""
    adapter = adapter_for(tiny_model("llama", num_layers=2))
    graphs = adapter.executor.set_cuda_graphs(True, capture=False)
    pool, store = graphs.pool, graphs.store
    pool.reserve(MIN_CAPACITY)
    one, two = ("graph-1", torch.zeros(1)), ("graph-2", torch.zeros(1))
    store._graphs = {("attn", 0, 1, 256, None): one, ("attn", 0, 2, 256, None): two}
    store._pool, store._stream = "pool", "stream"
    store._drop_graphs(lambda key: key[2] != 2)  # e.g. a new RoPE buffer for T = 2
    assert list(store._graphs.values()) == [one] and store._retired == [two]
    assert (store._pool, store._stream) == ("pool", "stream")
    pool.reserve(2 * MIN_CAPACITY)  # growing the pool drops every graph
    assert store._graphs == {} and store._retired == []
    assert store._pool is None and store._stream is None
