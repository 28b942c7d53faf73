"""The KV pool that CUDA graphs write into (`framework.engine.execution.pool`): lent to one live
cache at a time, regrown for a longer request, left by a cache that outgrows it."""

from __future__ import annotations

import torch

from framework.engine.adapter import adapter_for
from framework.engine.execution.pool import MIN_CAPACITY
from framework.testing import tiny_model


def _adapters():
    static = adapter_for(tiny_model("llama", 4, seed=0, dtype=torch.float32), fast_kernels=False)
    static.executor.set_cuda_graphs(True, capture=False)
    return None, static


def test_the_kv_pool_serves_one_live_cache_at_a_time():
    _, static = _adapters()
    pool = static.executor.graphs.pool
    first = static.new_cache(40)
    assert pool.holds(first) and pool.capacity == MIN_CAPACITY
    second = static.new_cache(40)  # the first still holds the pool: own buffers, eager steps
    assert not pool.holds(second) and second.keys is not first.keys
    first.release()
    first.release()  # idempotent
    third = static.new_cache(40)
    assert pool.holds(third) and third.keys is first.keys
    del third
    assert pool.holds(static.new_cache(10))  # a dropped cache gives the pool back too
    assert static.new_cache(40, batch=2).keys.shape[1] == 2  # batches are not pooled


def test_a_longer_request_regrows_the_pool_and_a_cache_that_outgrows_it_runs_eagerly():
    _, static = _adapters()
    pool = static.executor.graphs.pool
    big = static.new_cache(MIN_CAPACITY + 1)
    assert pool.capacity == 2 * MIN_CAPACITY and pool.holds(big)
    big.release()
    cache = static.new_cache(8)
    cache.begin(3 * MIN_CAPACITY)  # grows past the pool: its own buffers from here on
    cache.end()
    assert not pool.holds(cache)
