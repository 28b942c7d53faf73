"""The fused branches of framework.kernels.fused: which blocks they take, and that they compute what the
modules compute (to float32 rounding), write the same cache, and stay row-invariant."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from framework import LayerPlan
from framework.engine.adapter import adapter_for
from framework.kernels import cpu as kernels
from framework.testing import ARCHS, random_prompt, tiny_model

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=f"kernels unavailable: {kernels.unavailable_reason}"
)


def _adapter(arch: str = "llama", num_layers: int = 4, seed: int = 0, **overrides):
    model = tiny_model(arch, num_layers, seed=seed, dtype=torch.float32, **overrides)
    return model, adapter_for(model, fast_kernels=True)


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return bool((a - b).abs().max() <= rel * (b.abs().max() + 1e-6))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_plain_llama_branch_is_fused_and_qk_norms_are_not(arch):
    _, adapter = _adapter(arch)
    fused = adapter.fused
    assert fused is not None
    n = adapter.num_layers
    assert all(m is not None for m in fused.mlp)
    if arch == "qwen3":  # q/k RMSNorms inside the attention: not the fused computation
        assert fused.attn == [None] * n and fused.num_fused == n
    else:
        assert all(a is not None for a in fused.attn) and fused.num_fused == 2 * n


def test_no_fused_path_without_kernels_or_in_float64():
    model, adapter = _adapter()
    adapter.set_fast_kernels(False)
    assert adapter.fused is None
    assert adapter_for(tiny_model("llama", dtype=torch.float64)).fused is None


def test_a_branch_that_computes_something_else_keeps_the_module_path():
    model, adapter = _adapter(num_layers=3)
    mlp = model.model.layers[1].mlp
    stock = mlp.forward
    mlp.forward = lambda x: 2.0 * stock(x)  # a "modeling change" the structure check cannot see
    adapter.set_fast_kernels(True)
    assert adapter.fused.mlp[1] is None
    assert adapter.fused.mlp[0] is not None and adapter.fused.mlp[2] is not None
    model.model.layers[2].mlp.act_fn = nn.GELU()  # another activation: refused by structure
    adapter.set_fast_kernels(True)
    assert adapter.fused.mlp[2] is None


def _forward_both(adapter, *args, **kwargs):
    """(fused output, cache), (module output, cache) of one forward from the same prefilled cache."""
    fused = adapter.fused
    out = []
    for path in (fused, None):
        adapter.fused = path
        ids, p = kwargs.pop("_ids"), kwargs.pop("_p")
        cache = adapter.new_cache(ids.shape[1] + 8)
        adapter.forward(ids[:, :p], torch.arange(p)[None], cache, logits_at=None)
        cache.commit(p)
        res = adapter.forward(*args, cache=cache, **kwargs)
        out.append((res, cache))
        kwargs.update(_ids=ids, _p=p)
    adapter.fused = fused
    return out


@pytest.mark.parametrize(
    "case", ["chain", "tree", "scratch", "skip_plan", "exit_plan", "qwen2_bias", "mistral"]
)
def test_fused_forward_matches_the_modules(case):
    arch = {"qwen2_bias": "qwen2", "mistral": "mistral"}.get(case, "llama")
    _, adapter = _adapter(arch, num_layers=4, seed=1)
    p, t = 9, 5
    ids = random_prompt(p + t, seed=2)
    block = ids[:, p:]
    kwargs: dict = dict(_ids=ids, _p=p, capture_hidden=True)
    pos = torch.arange(p, p + t)[None]
    if case == "tree":
        mask = torch.tensor(
            [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
            dtype=torch.bool,
        )
        kwargs.update(base=p, tree_mask=mask)
        pos = torch.tensor([[p, p + 1, p + 1, p + 2, p + 2]])
    elif case == "scratch":  # SWIFT's teacher-forced scoring: sees only 4 committed slots
        kwargs.update(base=p, visible=4, persist=False)
    elif case == "skip_plan":
        kwargs.update(plan=LayerPlan.from_indices(4, attn=[1], mlp=[2]))
    elif case == "exit_plan":
        kwargs.update(plan=LayerPlan.from_indices(4, exit_layer=2))
    (f, fc), (m, mc) = _forward_both(adapter, block, pos, **kwargs)
    assert _close(f.logits, m.logits)
    assert _close(f.hidden_states, m.hidden_states)
    assert fc.lengths == mc.lengths
    assert _close(fc.keys, mc.keys) and _close(fc.values, mc.values)


def test_fused_verification_is_row_invariant_and_is_taken():
    """The fused path (and not the module path) gives the bit-identical single-step logits."""
    _, adapter = _adapter("llama", num_layers=4, seed=3)
    calls = []
    real = adapter.fused.attention

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    adapter.fused.attention = counting
    p, n = 7, 6
    ids = random_prompt(p + n, seed=4)

    def prefilled():
        cache = adapter.new_cache(p + n + 2)
        adapter.forward(ids[:, :p], torch.arange(p)[None], cache, logits_at=None)
        cache.commit(p)
        return cache

    cache = prefilled()
    singles = []
    for j in range(n):
        singles.append(adapter.forward(ids[:, p + j : p + j + 1], torch.tensor([[p + j]]), cache).logits)
        cache.commit(1)
    singles = torch.cat(singles, 1)
    block = adapter.forward(ids[:, p:], torch.arange(p, p + n)[None], prefilled()).logits
    assert torch.equal(block, singles)
    assert len(calls) == 4 * (1 + n + 1 + 1)  # every forward, every block


def test_batches_and_long_blocks_take_the_module_path():
    _, adapter = _adapter()
    fused = adapter.fused
    assert not fused.applies(torch.zeros(1, 3, 64))  # autograd on: the modules
    with torch.inference_mode():
        assert not fused.applies(torch.zeros(2, 3, 64))
        assert not fused.applies(torch.zeros(1, kernels.MAX_ROWS + 1, 64))
        assert not fused.applies(torch.zeros(1, 3, 64, dtype=torch.float64))
        assert fused.applies(torch.zeros(1, kernels.MAX_ROWS, 64))
    ids = torch.cat([random_prompt(6, seed=5), random_prompt(6, seed=6)])
    cache = adapter.new_cache(8, batch=2)
    out = adapter.forward(ids, torch.arange(6)[None].expand(2, 6), cache)
    assert out.logits.shape == (2, 6, 128)


def test_fused_results_do_not_depend_on_the_thread_count():
    # hidden 1024 and intermediate 2048: big enough that the kernels use more than one thread
    _, adapter = _adapter(num_layers=2, hidden_size=1024, intermediate_size=2048, num_attention_heads=8)
    ids = random_prompt(12, seed=7)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            cache = adapter.new_cache(16)
            outs.append(adapter.forward(ids, torch.arange(12)[None], cache).logits)
    finally:
        torch.set_num_threads(threads)
    assert adapter.fused.num_fused == 4
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_the_fused_path_follows_parameters_that_get_new_storage():
    model, adapter = _adapter(num_layers=2)
    ids = random_prompt(6, seed=8)
    pos = torch.arange(6)[None]
    want = adapter.forward(ids, pos, adapter.new_cache(8)).logits
    old = model.model.layers[0].mlp.up_proj.weight.data_ptr()
    model.to(torch.float64).to(torch.float32)  # exact round trip; every parameter's data is new
    assert model.model.layers[0].mlp.up_proj.weight.data_ptr() != old
    assert torch.equal(adapter.forward(ids, pos, adapter.new_cache(8)).logits, want)
