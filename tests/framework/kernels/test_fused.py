"""The fused branches of framework.kernels.fused: which blocks they take, and that they compute what the
modules compute (to float32 rounding), write the same cache, and stay row-invariant."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from framework import LayerPlan
from framework.engine.adapter import adapter_for
from framework.kernels import cpu as kernels
from framework.kernels.fused import FusedBlocks, compress_weight
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
    n = adapter.arch.num_layers
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
    # the old storage kept alive (so that the allocator cannot hand its address to the new one) and
    # overwritten after the move: a fused path still reading it would compute NaNs
    kept = [p.data for p in model.parameters()]
    model.to(torch.float64).to(torch.float32)  # exact round trip; every parameter's data is new
    for t in kept:
        t.fill_(float("nan"))
    assert model.model.layers[0].mlp.up_proj.weight.data_ptr() != old
    assert torch.equal(adapter.forward(ids, pos, adapter.new_cache(8)).logits, want)


# ---- compressed copies of the branches, for drafts ----------------------------------------------


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_compress_weight_rounds_within_its_format(fmt):
    w = torch.randn(40, 72, generator=torch.Generator().manual_seed(0))
    q, scale = compress_weight(w, fmt)
    if fmt == "bfloat16":
        assert q.dtype is torch.bfloat16 and scale is None
        assert torch.equal(q, w.to(torch.bfloat16))
    else:
        assert q.dtype is torch.int8 and scale is not None and scale.shape == (40,)
        assert torch.equal(q.abs().amax(dim=1), torch.full((40,), 127, dtype=torch.int8))
        err = (q.float() * scale[:, None] - w).abs()
        assert bool((err <= scale[:, None] / 2 + 1e-7).all())  # at most half a step of its row


def test_compress_weight_names_the_formats_it_knows():
    with pytest.raises(ValueError, match="'bfloat16', 'int8' or 'int4', got 'float16'"):
        compress_weight(torch.zeros(2, 2), "float16")


def _round_weights(model: nn.Module, fmt: str) -> None:
    """Replace every linear weight of the blocks by its value in ``fmt`` (kept in float32)."""
    with torch.no_grad():
        for blk in model.model.layers:
            for mod in blk.modules():
                if isinstance(mod, nn.Linear):
                    q, scale = compress_weight(mod.weight, fmt)
                    mod.weight.copy_(q.float() if scale is None else q.float() * scale[:, None])


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
@pytest.mark.parametrize("case", ["chain", "skip_plan", "tree", "qwen2_bias"])
def test_compressed_branches_compute_the_model_with_rounded_weights(fmt, case):
    """A forward through `draft_branches(fmt)` computes what the modules compute once the weights
    are rounded to ``fmt`` (to float32 rounding), and writes the same KV cache."""
    arch = "qwen2" if case == "qwen2_bias" else "llama"
    model, adapter = _adapter(arch, num_layers=4, seed=1)
    comp = adapter.draft_branches(fmt)
    assert comp is not None and comp.weights == fmt and comp.num_fused == adapter.fused.num_fused
    _round_weights(model, fmt)  # the copy was made before: it keeps the rounded values
    adapter.fused = None  # the reference: the modules, with the rounded weights
    p, t = 9, 5
    ids = random_prompt(p + t, seed=2)
    kwargs: dict = dict(capture_hidden=True)
    pos = torch.arange(p, p + t)[None]
    if case == "skip_plan":
        kwargs.update(plan=LayerPlan.from_indices(4, attn=[1], mlp=[2]))
    elif case == "tree":
        mask = torch.tensor(
            [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
            dtype=torch.bool,
        )
        kwargs.update(base=p, tree_mask=mask)
    runs = []
    for weights in (comp, None):
        cache = adapter.new_cache(p + t + 4)
        adapter.forward(ids[:, :p], torch.arange(p)[None], cache, logits_at=None)
        cache.commit(p)
        runs.append((adapter.forward(ids[:, p:], pos, cache, weights=weights, **kwargs), cache))
    (c, cc), (m, mc) = runs
    assert _close(c.logits, m.logits) and _close(c.hidden_states, m.hidden_states)
    assert _close(cc.keys, mc.keys) and _close(cc.values, mc.values)


@pytest.mark.parametrize("case", ["chain", "skip_plan", "qwen2_bias"])
def test_int4_branches_compute_the_int4_reference_through_the_modules(case):
    """The fused int4 branches (the kernel's W4A8 product) and the modules with the same int4 copy
    run by `reference_linear` (activations quantised per group in float32) give the same logits,
    hidden states and KV cache, to float32 rounding."""
    from framework.kernels.lowbit import LowBitLinears

    arch = "qwen2" if case == "qwen2_bias" else "llama"
    model, adapter = _adapter(arch, num_layers=4, seed=3)
    fused = adapter.draft_branches("int4")
    assert isinstance(fused, FusedBlocks) and fused.weights == "int4"
    modules = LowBitLinears.build(adapter.arch, "int4")
    assert modules is not None and modules.kernel == "reference"
    p, t = 9, 4
    ids = random_prompt(p + t, seed=5)
    kwargs: dict = dict(capture_hidden=True)
    if case == "skip_plan":
        kwargs.update(plan=LayerPlan.from_indices(4, attn=[2], mlp=[1]))
    runs = []
    for weights in (fused, modules):
        if weights is modules:
            adapter.fused = None
        cache = adapter.new_cache(p + t + 2)
        adapter.forward(ids[:, :p], torch.arange(p)[None], cache, logits_at=None)
        cache.commit(p)
        pos = torch.arange(p, p + t)[None]
        runs.append((adapter.forward(ids[:, p:], pos, cache, weights=weights, **kwargs), cache))
    (f, fc), (m, mc) = runs
    assert _close(f.logits, m.logits) and _close(f.hidden_states, m.hidden_states)
    assert _close(fc.keys, mc.keys) and _close(fc.values, mc.values)
    own = adapter.forward(ids[:, p:], torch.arange(t)[None], adapter.new_cache(t)).logits
    assert not torch.equal(f.logits, own)  # it is a different (compressed) computation


def test_compressed_copies_read_half_or_a_quarter_of_the_bytes():
    _, adapter = _adapter(num_layers=2)
    own = adapter.fused.nbytes
    assert adapter.draft_branches("bfloat16").nbytes == own // 2
    int8 = adapter.draft_branches("int8").nbytes
    assert own // 4 < int8 < own // 4 + own // 50  # plus one float32 scale per output row
    # int4: half a byte a weight and a float32 scale per 64 inputs, each row padded to 128 inputs
    shapes = [p.shape for b in [*adapter.fused.attn, *adapter.fused.mlp] for p in b.params[::2]]
    padded = [(n, -(-k // 128) * 128) for n, k in shapes]
    assert adapter.draft_branches("int4").nbytes == sum(n * kp // 2 + n * kp // 64 * 4 for n, kp in padded)


def test_draft_branches_are_built_once_fused_where_the_kernels_run_and_low_bit_elsewhere():
    from framework.kernels.lowbit import LowBitLinears

    _, adapter = _adapter(num_layers=2)
    assert adapter.draft_branches("int8") is adapter.draft_branches("int8")
    assert isinstance(adapter.draft_branches("int8"), FusedBlocks)
    assert adapter.draft_branches("float32") is adapter.fused
    assert isinstance(adapter.draft_branches("fp8"), LowBitLinears)  # no fused fp8: the modules
    with pytest.raises(
        ValueError, match="one of \\['float32', 'fp8', 'int8', 'int4', 'bfloat16'\\], got 'int2'"
    ):
        adapter.draft_branches("int2")
    assert isinstance(adapter.draft_branches("int4"), FusedBlocks)
    adapter.set_fast_kernels(False)
    assert isinstance(adapter.draft_branches("int8"), LowBitLinears)  # no fused branches
    bf16 = adapter_for(tiny_model("llama", dtype=torch.bfloat16))
    assert bf16.draft_branches("bfloat16") is None  # nothing to copy


def test_compressed_drafts_differ_from_the_model_but_the_model_path_is_untouched():
    _, adapter = _adapter(num_layers=3, seed=4)
    ids = random_prompt(8, seed=9)
    pos = torch.arange(8)[None]
    own = adapter.forward(ids, pos, adapter.new_cache(10)).logits
    int8 = adapter.forward(ids, pos, adapter.new_cache(10), weights=adapter.draft_branches("int8")).logits
    assert not torch.equal(int8, own) and _close(int8, own, rel=0.05)
    assert torch.equal(adapter.forward(ids, pos, adapter.new_cache(10)).logits, own)


def test_adapters_of_one_model_share_the_copy_until_a_weight_changes():
    model, adapter = _adapter(num_layers=2)
    other = adapter_for(model, fast_kernels=True)
    first = adapter.draft_branches("int8").mlp[0].params[0]
    assert other.draft_branches("int8").mlp[0].params[0] is first  # one copy per model
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.weight.mul_(2.0)  # changed in place
    adapter.set_fast_kernels(True)  # "build it again after changing the weights"
    again = adapter.draft_branches("int8").mlp[0]
    assert again.params[0] is not first
    assert torch.equal(again.wscales[0], 2.0 * other.draft_branches("int8").mlp[0].wscales[0])
