"""framework/kernels/lowbit.py: the low-bit copies of the blocks' linear layers that draft passes
run through the model's modules (fp8, int8, int4, bfloat16): quantisation, the reference arithmetic, the
device kernels' calling conventions (checked through their CPU implementations), the routing
switch, and the kernel choice."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from framework.engine.adapter import adapter_for
from framework.kernels import lowbit
from framework.kernels.lowbit import (
    FP8_MAX,
    INT4_GROUP,
    LowBitLinears,
    active_format,
    fast_linear,
    quantize_groups_int8,
    quantize_int4,
    quantize_rows,
    quantize_tokens_fp8,
    reference_linear,
    unpack_int4,
)
from framework.testing import tiny_model

FORMATS = ("fp8", "int8", "bfloat16")


def _weight(n: int = 48, k: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: a per-row scale must follow each row
    return torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None]


def _dequant(q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return q.float() * (1.0 if scale is None else scale[:, None])


# ---- quantisation -----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_row_round_trips_within_the_formats_precision(fmt):
    w = _weight()
    q, scale = quantize_rows(w, fmt)
    back = _dequant(q, scale)
    err = (back - w).abs()
    row_max = w.abs().amax(dim=1, keepdim=True)
    if fmt == "fp8":  # e4m3: 3 mantissa bits (half an ulp = 2^-4 relative), subnormals below 2^-6
        assert q.dtype == torch.float8_e4m3fn
        assert torch.allclose(scale, w.abs().amax(dim=1) / FP8_MAX)
        assert (err <= w.abs() * 2**-4 + row_max / FP8_MAX * 2**-10).all()
        assert torch.allclose(back.abs().amax(dim=1), w.abs().amax(dim=1), rtol=1e-6)  # amax is exact
    elif fmt == "int8":
        assert q.dtype == torch.int8 and int(q.abs().max()) == 127
        assert (err <= scale[:, None] / 2 + 1e-7).all()
    else:
        assert q.dtype == torch.bfloat16 and scale is None
        assert (err <= w.abs() * 2**-8).all()


def test_quantisation_refuses_what_it_cannot_store():
    with pytest.raises(ValueError, match="one of"):
        quantize_rows(_weight(), "int2")
    with pytest.raises(ValueError, match="2-D"):
        quantize_rows(torch.ones(3), "fp8")


def test_activations_get_one_fp8_scale_per_token():
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 10.0, 100.0, 0.0])[:, None]
    q, s = quantize_tokens_fp8(x)
    assert s.shape == (5, 1) and q.dtype == torch.float8_e4m3fn
    assert torch.allclose(q.float().abs().amax(dim=1)[:4], torch.full((4,), FP8_MAX))
    assert torch.isfinite(q.float() * s).all() and (q.float()[4] == 0).all()  # a zero row stays zero


@pytest.mark.parametrize("k", [64, 200, 576])  # one group, a ragged tail, 4.5 blocks of 128
def test_int4_rounds_each_group_no_worse_than_its_amax_over_7(k):
    w = _weight(48, k) * torch.linspace(0.1, 3.0, k)[None, :]  # groups of different magnitudes
    packed, scale = quantize_int4(w)
    kp = -(-k // 128) * 128
    assert packed.dtype == torch.uint8 and packed.shape == (48, kp // 2)
    assert scale.shape == (48, kp // INT4_GROUP)
    q = unpack_int4(packed, kp)
    assert q.min() >= -8 and q.max() <= 7 and (q[:, k:] == 0).all()  # the padding is zero
    assert int((q == -8).sum()) > 0  # the 16th level is used
    wp = torch.zeros(48, kp)
    wp[:, :k] = w
    g = wp.view(48, -1, INT4_GROUP)
    err = ((q.view(48, -1, INT4_GROUP) * scale[:, :, None] - g) ** 2).sum(2)
    plain = g.abs().amax(2, keepdim=True) / 7  # the symmetric baseline, one of the candidates
    base = ((torch.round(g / plain.clamp_min(1e-30)) * plain - g) ** 2).sum(2)
    assert (err <= base * (1 + 1e-5) + 1e-12).all()
    assert float(err.sum()) < 0.95 * float(base.sum())  # and the search pays overall


def test_int4_stores_a_group_on_its_grid_exactly():
    w = torch.zeros(2, 64)
    w[0] = torch.arange(-8, 56).remainder(16).sub(8).float() * 0.25  # every level, scale 0.25
    w[1, :8] = torch.tensor([7.0, -3.0, 1.0, 0.0, 2.0, -8.0, 5.0, 4.0]) * -0.5  # a negative scale
    packed, scale = quantize_int4(w)
    back = unpack_int4(packed, 64) * scale.repeat_interleave(64, dim=1)[:, :64]
    assert torch.equal(back, w)


def test_int4_packs_two_groups_per_64_bytes_as_the_kernel_reads_them():
    """Byte i of a 64-byte block holds input i (low nibble) and input 64 + i (high nibble) of its
    128 inputs, stored as q + 8: the layout ``q4_t`` of the CPU kernels reads."""
    w = torch.zeros(1, 128)
    w[0, 3], w[0, 10], w[0, 64 + 3], w[0, 127] = 1.0, -0.4, -0.2, 0.5
    packed, scale = quantize_int4(w)
    # least squares: each group's extreme maps to -8 (scale -extreme / 8; / 7 rounds 3.2 up)
    assert torch.allclose(scale, torch.tensor([[-1 / 8, -0.5 / 8]]))
    assert int(packed[0, 3]) == (8 - 8) | ((8 + 3) << 4)  # -0.2 / (-0.5 / 8) = 3.2 -> 3
    assert int(packed[0, 63]) == 8 | ((8 - 8) << 4)  # input 127: group 1's extreme
    assert int(packed[0, 10]) == (8 + 3) | (8 << 4)  # -0.4 / (-1 / 8) = 3.2 -> 3
    assert int(packed[0, 0]) == 8 | (8 << 4)


def test_int4_activations_round_per_group_and_stay_zero_where_zero():
    x = torch.randn(3, 130)
    x[1, :64] = 0.0
    x[2, 64:128] *= 1e3
    q, s = quantize_groups_int8(x)
    assert q.shape == (3, 256) and s.shape == (3, 4)
    assert (q[1, :64] == 0).all() and s[1, 0] == 0  # an all-zero group
    assert (q[:, 130:] == 0).all() and (s[:, 3] == 0).all()  # padding
    assert float(q.abs().max()) == 127 and (q == q.round()).all()
    back = (q.view(3, 4, 64) * s[:, :, None]).view(3, 256)[:, :130]
    assert ((back - x).abs() <= s.repeat_interleave(64, dim=1)[:, :130] / 2 * (1 + 1e-5) + 1e-7).all()
    assert float(q[2, 64:128].abs().max()) == 127 and float(q[2, :64].abs().max()) == 127  # own scales


def test_int4_reference_sums_exact_group_products():
    w, b = _weight(48, 200), torch.randn(48)
    x = torch.randn(2, 3, 200)
    packed, scale = quantize_int4(w)
    out = reference_linear(x, packed, scale, b, "int4")
    exact = nn.functional.linear(x, w, b)
    assert out.shape == exact.shape
    rel = float((out - exact).norm() / exact.norm())  # measured ~0.09 (4-bit weights, 8-bit inputs)
    assert 0.02 < rel < 0.2
    xq, xs = quantize_groups_int8(x.reshape(-1, 200))
    wq = unpack_int4(packed, 256)
    manual = (xq.double() * xs.repeat_interleave(64, 1).double()) @ (
        wq.double() * scale.repeat_interleave(64, 1).double()
    ).t() + b.double()
    assert torch.allclose(out.reshape(-1, 48).double(), manual, atol=1e-5, rtol=1e-5)
    with pytest.raises(NotImplementedError, match="fused branches"):
        fast_linear(x, packed, scale, b, "int4")  # no kernel through the modules


# ---- the arithmetic ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_reference_product_is_the_linear_layer_within_the_formats_error(fmt):
    g = torch.Generator().manual_seed(1)  # not the global RNG: its state depends on the tests before
    w, b = _weight(), torch.randn(48, generator=g)
    x = torch.randn(2, 3, 64, generator=g)
    q, scale = quantize_rows(w, fmt)
    out = reference_linear(x, q, scale, b, fmt)
    exact = nn.functional.linear(x, w, b)
    assert out.shape == exact.shape and out.dtype == x.dtype
    rel = float((out - exact).norm() / exact.norm())  # measured: fp8 ~0.03, int8 ~0.006, bf16 ~0.0025
    assert rel < {"fp8": 0.05, "int8": 0.012, "bfloat16": 0.005}[fmt]
    # and it is exactly the de-quantised product of what it stores
    if fmt == "fp8":
        xq, xs = quantize_tokens_fp8(x.reshape(-1, 64))
        manual = (xq.float() * xs) @ _dequant(q, scale).t() + b
    elif fmt == "int8":
        manual = x.reshape(-1, 64) @ _dequant(q, scale).t() + b
    else:
        manual = x.reshape(-1, 64).to(torch.bfloat16).float() @ q.float().t() + b
    assert torch.allclose(out.reshape(-1, 48), manual, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_device_kernels_calling_conventions_agree_with_the_reference(fmt):
    """``fast_linear`` calls ``torch._scaled_mm`` / ``torch._weight_int8pack_mm`` as on CUDA; their
    CPU implementations check the argument order, the transposition and the scale shapes."""
    w, b = _weight(), torch.randn(48)
    x = torch.randn(4, 64)
    q, scale = quantize_rows(w, fmt)
    try:
        got = fast_linear(x, q, scale, b, fmt)
    except (RuntimeError, NotImplementedError) as err:  # pragma: no cover - depends on the torch build
        pytest.skip(f"no CPU implementation of the {fmt} kernel in this torch: {err}")
    want = reference_linear(x, q, scale, b, fmt)
    assert got.shape == want.shape and got.dtype == x.dtype
    # the fast kernels round their output to bfloat16 (fp8, bfloat16): half an ulp of the largest
    tol = want.abs().max() * (2**-8 if fmt != "int8" else 1e-6) + 1e-5
    assert float((got - want).abs().max()) <= float(tol)


def test_a_kernel_is_used_only_if_it_agrees_with_the_reference(monkeypatch):
    mod = nn.Linear(64, 48)
    probe = (mod, lowbit._Packed(*quantize_rows(mod.weight, "fp8")))
    assert lowbit._agrees("fp8", probe, torch.device("cpu"))
    monkeypatch.setattr(lowbit, "fast_linear", lambda x, q, s, b, f: reference_linear(x, q, s, b, f) * 1.5)
    assert not lowbit._agrees("fp8", probe, torch.device("cpu"))

    def broken(*args):
        raise RuntimeError("no kernel for this architecture")

    monkeypatch.setattr(lowbit, "fast_linear", broken)
    assert not lowbit._agrees("fp8", probe, torch.device("cpu"))
    # a CPU never needs the device kernel: the reference is what runs there
    assert lowbit._choose_kernel("fp8", probe, torch.device("cpu")) == "reference"


# ---- the copies and the switch ----------------------------------------------------------------
@pytest.fixture
def adapter():
    return adapter_for(tiny_model("llama", num_layers=3, seed=3, dtype=torch.float32), fast_kernels=False)


def _linears(adapter):
    return [m for blk in adapter.arch.blocks for m in blk.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_copy_runs_only_while_active_and_nests(adapter, fmt):
    mods = _linears(adapter)
    x = torch.randn(1, 2, mods[0].in_features)
    before = mods[0](x)
    copy_ = LowBitLinears.build(adapter.arch, fmt)
    assert copy_ is not None and copy_.weights == fmt and copy_.kernel == "reference"
    fits = [m for m in mods if fmt != "fp8" or (m.in_features % 16 == 0 and m.out_features % 16 == 0)]
    assert copy_.covered == (len(fits), len(mods)) and fits
    assert torch.equal(mods[0](x), before)  # outside: the model's own weights, bit for bit
    with copy_.active():
        assert active_format() == fmt
        inside = mods[0](x)
        with LowBitLinears.build(adapter.arch, "int8").active():
            assert active_format() == "int8"
        assert active_format() == fmt
    assert active_format() is None and torch.equal(mods[0](x), before)
    p = copy_._packed[mods[0]]
    assert torch.equal(inside, reference_linear(x, p.q, p.scale, mods[0].bias, fmt))
    assert not torch.equal(inside, before)


def test_a_copy_reads_fewer_bytes_and_leaves_the_parameters_alone(adapter):
    own = sum(m.weight.numel() * m.weight.element_size() for m in _linears(adapter))
    params = {k: v.clone() for k, v in adapter.arch.model.state_dict().items()}
    sizes = {fmt: LowBitLinears.build(adapter.arch, fmt).nbytes for fmt in FORMATS}
    assert sizes["bfloat16"] == own // 2
    assert own // 4 <= sizes["int8"] < own // 4 * 1.1
    assert sizes["fp8"] <= sizes["int8"]
    after = adapter.arch.model.state_dict()
    assert params.keys() == after.keys() and all(torch.equal(params[k], after[k]) for k in params)


def test_a_bfloat16_model_has_nothing_to_copy_to_bfloat16():
    model = tiny_model("llama", num_layers=2, seed=1, dtype=torch.bfloat16)
    assert LowBitLinears.build(adapter_for(model, fast_kernels=False).arch, "bfloat16") is None
    with pytest.raises(ValueError, match="one of"):
        LowBitLinears.build(adapter_for(model, fast_kernels=False).arch, "int2")


def test_a_deep_copy_of_the_model_switches_its_own_layers(adapter):
    copy_ = LowBitLinears.build(adapter.arch, "int8")
    clone = copy.deepcopy(adapter.arch.model)
    src = _linears(adapter)[0]
    dst = next(m for m in clone.modules() if isinstance(m, nn.Linear))
    with torch.no_grad():
        dst.weight.mul_(2.0)  # the clone's own weights, not the original's
    x = torch.randn(1, 1, src.in_features)
    assert torch.allclose(dst(x), nn.functional.linear(x, dst.weight, dst.bias))
    assert dst.__dict__["_selfspec_lowbit"]["int8"] is not copy_  # the clone's copy is its own
    with copy_.active():
        assert torch.equal(dst(x), src(x))  # a copy does not follow later weight changes
