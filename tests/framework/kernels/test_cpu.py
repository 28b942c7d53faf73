"""framework.kernels.cpu: the skinny linear and attention kernels against PyTorch, their row
invariance, installing them into a model, and the fallback when they cannot be used."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from framework.engine.adapter import adapter_for
from framework.kernels import cpu as kernels
from framework.testing import random_prompt, tiny_model

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=f"kernels unavailable: {kernels.unavailable_reason}"
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _linear_tol(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A float32 rounding bound of each output: a few ulps of sum_k |x_k w_k|."""
    return 8 * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().T) + 1e-30


# ---------------------------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(1, 1), (7, 5), (33, 17), (64, 64), (130, 100), (576, 192), (40, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(n, k, bias):
    g = _gen(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    for rows in (1, 2, 3, 4, 5, 8, 13, 31, 64):
        x = torch.randn(rows, k, generator=g)
        got = kernels.linear(x, w, b)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        err = (got.double() - want).abs()
        tol = _linear_tol(x, w) + (0 if b is None else 4 * torch.finfo(torch.float32).eps * b.abs().double())
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert bool((err <= tol).all()), f"rows {rows}: max error {err.max().item():.3g}"
        stock = F.linear(x, w, b).double()
        assert bool(((got.double() - stock).abs() <= 2 * tol).all())  # both within the bound


def test_linear_rows_bit_identical_across_row_counts_and_threads():
    g = _gen(1)
    for n, k in [(96, 576), (49, 33), (200, 1536)]:
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        x = torch.randn(64, k, generator=g)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            full = kernels.linear(x, w, b)
            torch.set_num_threads(2)
            assert torch.equal(kernels.linear(x, w, b), full)
        finally:
            torch.set_num_threads(threads)
        for rows in range(1, 65):
            for start in {0, 64 - rows, (64 - rows) // 2}:
                part = kernels.linear(x[start : start + rows], w, b)
                assert torch.equal(part, full[start : start + rows]), f"{rows} rows from {start}"


def test_linear_noncontiguous_and_batched_inputs():
    g = _gen(2)
    w, b = torch.randn(48, 40, generator=g), torch.randn(48, generator=g)
    base = torch.randn(2, 40, 7, generator=g)
    x = base.transpose(1, 2)  # (2, 7, 40) with the feature dim strided
    assert not x.is_contiguous()
    got = kernels.linear(x, w, b)
    assert got.shape == (2, 7, 48)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    rows = torch.randn(9, 80, generator=g)[::2, :40]  # strided rows, contiguous features
    torch.testing.assert_close(kernels.linear(rows, w), F.linear(rows, w), rtol=1e-5, atol=1e-5)
    strided_w = torch.randn(48, 80, generator=g)[:, :40]  # rows of the weight are strided
    torch.testing.assert_close(
        kernels.linear(rows, strided_w), F.linear(rows, strided_w), rtol=1e-5, atol=1e-5
    )
    assert kernels.linear(torch.randn(3, 0, 40), w).shape == (3, 0, 48)


def test_linear_falls_back_where_the_kernel_does_not_apply():
    g = _gen(3)
    w, b = torch.randn(16, 8, generator=g), torch.randn(16, generator=g)
    x64 = torch.randn(4, 8, generator=g, dtype=torch.float64)
    assert torch.equal(kernels.linear(x64, w.double(), b.double()), F.linear(x64, w.double(), b.double()))
    many = torch.randn(kernels.MAX_ROWS + 1, 8, generator=g)  # a long block: oneDNN or F.linear
    torch.testing.assert_close(kernels.linear(many, w, b), F.linear(many, w, b), rtol=1e-5, atol=1e-5)
    # autograd: the stock path, so gradients flow
    wg = w.clone().requires_grad_(True)
    kernels.linear(torch.randn(2, 8, generator=g), wg, b).sum().backward()
    assert wg.grad is not None and wg.grad.shape == w.shape


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


class _Attn(nn.Module):
    """What the attention functions read from an HF attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True
        self.layer_idx = 0


def _qkv(b, h, hkv, t, s, d, seed):
    g = _gen(seed)
    q = torch.randn(b, t, h, d, generator=g).transpose(1, 2)  # HF's (B, H, T, D) view
    k = torch.randn(b, hkv, s, d, generator=g)
    v = torch.randn(b, hkv, s, d, generator=g)
    return q, k, v


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    m = torch.zeros(allowed.shape, dtype=torch.float32)
    return m.masked_fill(~allowed, torch.finfo(torch.float32).min)


def _reference(q, k, v, allowed: torch.Tensor | None, scale: float) -> torch.Tensor:
    """float64 softmax attention, (B, T, H, D)."""
    rep = q.shape[1] // k.shape[1]
    k2 = k.double().repeat_interleave(rep, 1)
    v2 = v.double().repeat_interleave(rep, 1)
    s = q.double() @ k2.transpose(2, 3) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return (s.softmax(-1) @ v2).transpose(1, 2)


def _prefix_allowed(t: int, base: int, visible: int | None = None, tree: torch.Tensor | None = None):
    visible = base if visible is None else visible
    allowed = torch.zeros(t, base + t, dtype=torch.bool)
    allowed[:, :visible] = True
    allowed[:, base:] = torch.ones(t, t, dtype=torch.bool).tril() if tree is None else tree
    return allowed


@pytest.mark.parametrize("h,hkv,d", [(4, 2, 16), (9, 3, 64), (2, 2, 20), (8, 1, 32)])
def test_attention_matches_reference_and_sdpa(h, hkv, d):
    module = _Attn(h // hkv)
    scale = d**-0.5
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    cases = [
        (1, 0, 12, None),  # a single query that sees everything (the decoding step)
        (5, 11, 16, _prefix_allowed(5, 11)),  # a verification block after a prefix
        (4, 9, 13, _prefix_allowed(4, 9, tree=tree)),  # a tree
        (3, 10, 13, _prefix_allowed(3, 10, visible=6)),  # scratch: part of the prefix hidden
    ]
    for t, _base, s, allowed in cases:
        for b in (1, 2):
            q, k, v = _qkv(b, h, hkv, t, s, d, seed=t * 10 + s + b)
            want = _reference(q, k, v, allowed, scale)
            masks = [None] if allowed is None else [_additive(allowed)[None, None], allowed[None, None]]
            for mask in masks:
                got, weights = kernels.attention(module, q, k, v, mask, scaling=scale)
                assert weights is None and got.shape == (b, t, h, d) and got.is_contiguous()
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
                ref, _ = kernels._sdpa(module, q, k, v, mask, scaling=scale)
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_attention_causal_without_mask_and_per_head_masks():
    module = _Attn(2)
    q, k, v = _qkv(2, 4, 2, 6, 6, 16, seed=5)
    got, _ = kernels.attention(module, q, k, v, None)  # HF's prefill: no mask, is_causal
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close(got.double(), _reference(q, k, v, allowed, 0.25), rtol=1e-5, atol=1e-5)
    # a mask per batch element and head
    g = _gen(6)
    allowed = torch.rand(2, 4, 6, 6, generator=g) > 0.4
    allowed[..., 0] = True
    got, _ = kernels.attention(module, q, k, v, _additive(allowed), scaling=0.3)
    torch.testing.assert_close(got.double(), _reference(q, k, v, allowed, 0.3), rtol=1e-5, atol=1e-5)


def test_attention_rows_bit_identical_to_single_queries():
    """Row t of a T-query call equals a one-query call over the keys it sees."""
    h, hkv, d, base, t = 9, 3, 64, 37, 8
    module = _Attn(h // hkv)
    q, k, v = _qkv(1, h, hkv, t, base + t, d, seed=7)
    mask = _additive(_prefix_allowed(t, base))[None, None]
    chain, _ = kernels.attention(module, q, k, v, mask, scaling=0.125)
    threads = torch.get_num_threads()
    try:  # the rows split over two threads: the same bits
        torch.set_num_threads(2)
        assert torch.equal(kernels.attention(module, q, k, v, mask, scaling=0.125)[0], chain)
    finally:
        torch.set_num_threads(threads)
    parents = [-1, 0, 0, 1, 2, 2, 3, 6]
    tree = torch.eye(t, dtype=torch.bool)
    for j, p in enumerate(parents):
        if p >= 0:
            tree[j] |= tree[p]
    treeout, _ = kernels.attention(
        module, q, k, v, _additive(_prefix_allowed(t, base, tree=tree))[None, None], scaling=0.125
    )
    for j in range(t):
        one, _ = kernels.attention(
            module, q[:, :, j : j + 1], k[:, :, : base + j + 1], v[:, :, : base + j + 1], None, scaling=0.125
        )
        assert torch.equal(one[:, 0], chain[:, j])
        keys = list(range(base)) + [base + i for i in range(t) if tree[j, i]]
        idx = torch.tensor(keys)
        one, _ = kernels.attention(
            module, q[:, :, j : j + 1], k[:, :, idx], v[:, :, idx], None, scaling=0.125
        )
        assert torch.equal(one[:, 0], treeout[:, j])


def test_attention_row_does_not_depend_on_key_positions():
    """Keys are scored a vector of them at a time: a row's result must not depend on where its
    visible keys sit in those blocks (masked keys in front shift every key to another lane)."""
    h, hkv, d, s = 4, 2, 64, 45
    module = _Attn(h // hkv)
    q, k, v = _qkv(1, h, hkv, 1, s, d, seed=11)
    want, _ = kernels.attention(module, q, k, v, None, scaling=0.125)
    g = _gen(12)
    for shift in range(1, 18):
        pad_k = torch.cat([torch.randn(1, hkv, shift, d, generator=g), k], 2)
        pad_v = torch.cat([torch.randn(1, hkv, shift, d, generator=g), v], 2)
        allowed = torch.ones(1, 1, 1, shift + s, dtype=torch.bool)
        allowed[..., :shift] = False
        for mask in (allowed, _additive(allowed)):
            got, _ = kernels.attention(module, q, pad_k, pad_v, mask, scaling=0.125)
            assert torch.equal(got, want), shift


def test_attention_falls_back_to_sdpa():
    module = _Attn(2)
    q, k, v = _qkv(1, 4, 2, 3, 7, 16, seed=8)
    allowed = _prefix_allowed(3, 4)
    mask = _additive(allowed)[None, None]
    # float64: SDPA
    got, _ = kernels.attention(module, q.double(), k.double(), v.double(), mask.double())
    want, _ = kernels._sdpa(module, q.double(), k.double(), v.double(), mask.double())
    assert torch.equal(got, want)
    # no mask, several queries and a longer key block: SDPA's top-left causal semantics
    got, _ = kernels.attention(module, q, k, v, None)
    want, _ = kernels._sdpa(module, q, k, v, None)
    assert torch.equal(got, want)
    # more query rows than a verification block (a long prefill): SDPA
    n = kernels.MAX_ROWS + 1
    q, k, v = _qkv(1, 4, 2, n, n, 16, seed=9)
    got, _ = kernels.attention(module, q, k, v, None)
    want, _ = kernels._sdpa(module, q, k, v, None)
    assert torch.equal(got, want)


def test_long_blocks_take_onednn_where_it_reproduces_f_linear(monkeypatch):
    """More than MAX_ROWS rows (a long prompt's prefill): oneDNN's product when this torch has it
    (checked once against F.linear), with the bias and the leading dimensions kept; a weight that
    is not contiguous takes F.linear itself."""
    g = _gen(11)
    w, b = torch.randn(48, 40, generator=g), torch.randn(48, generator=g)
    x = torch.randn(1, kernels.MAX_ROWS + 7, 40, generator=g)
    op = kernels._onednn_linear()
    calls = []
    if op is not None:
        monkeypatch.setattr(kernels, "_ONEDNN", lambda *a: calls.append(a) or op(*a))
    for bias in (b, None):
        got = kernels.linear(x, w, bias)
        assert got.shape == (1, kernels.MAX_ROWS + 7, 48)
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    assert len(calls) == (2 if op is not None else 0)
    wt = torch.randn(40, 48, generator=g).t()  # (48, 40), not contiguous
    assert torch.equal(kernels.linear(x, wt, b), F.linear(x, wt, b))
    assert len(calls) == (2 if op is not None else 0)
    # up to MAX_ROWS rows stay on the batch-invariant kernel
    if kernels.available():
        kernels.linear(x[:, : kernels.MAX_ROWS], w, b)
        assert len(calls) == (2 if op is not None else 0)


def test_onednn_is_not_used_when_its_check_fails(monkeypatch):
    monkeypatch.setattr(kernels, "_ONEDNN", False)
    bad = types.SimpleNamespace(_linear_pointwise=lambda x, w, b, *a: F.linear(x, w, b) + 1.0)
    monkeypatch.setattr(torch.ops, "mkldnn", bad, raising=False)
    assert kernels._onednn_linear() is None
    g = _gen(12)
    w, x = torch.randn(8, 16, generator=g), torch.randn(kernels.MAX_ROWS + 1, 16, generator=g)
    assert torch.equal(kernels.linear(x, w), F.linear(x, w))


# ---------------------------------------------------------------------------------------------
# install / uninstall, adapter integration
# ---------------------------------------------------------------------------------------------


def test_install_shares_weights_and_uninstall_restores():
    model = tiny_model("llama", 2, dtype=torch.float32, tie_word_embeddings=True)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    assert model.config._attn_implementation == "sdpa"
    assert kernels.install(model) and kernels.is_installed(model)
    assert kernels.install(model)  # idempotent
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is kernels.FastLinear for m in linears)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 5 and all(isinstance(m, kernels._FusedRMSNorm) for m in norms)
    assert model.config._attn_implementation == kernels.ATTN_IMPLEMENTATION
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    assert list(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = random_prompt(9, seed=1)
    with torch.inference_mode():
        fast = model(ids).logits
    kernels.uninstall(model)
    assert not kernels.is_installed(model)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert all(type(m) is LlamaRMSNorm for m in norms)
    assert model.config._attn_implementation == "sdpa"
    with torch.inference_mode():
        stock = model(ids).logits
    torch.testing.assert_close(fast, stock, rtol=1e-4, atol=1e-4)


def test_stock_context_takes_the_kernels_out_for_the_block():
    model = tiny_model("llama", 2, dtype=torch.float32)
    kernels.install(model)
    with kernels.stock(model):
        assert not kernels.is_installed(model)
        assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
        assert model.config._attn_implementation == "sdpa"
    assert kernels.is_installed(model) and model.config._attn_implementation == kernels.ATTN_IMPLEMENTATION
    kernels.uninstall(model)
    with kernels.stock(model):  # nothing installed: nothing to restore afterwards
        pass
    assert not kernels.is_installed(model)


def test_fused_rms_norm_only_where_bit_identical():
    class GemmaLikeRMSNorm(LlamaRMSNorm):  # other semantics: scales by 1 + weight
        def forward(self, hidden_states):
            return super().forward(hidden_states) + hidden_states * 0 + self.weight * 0 + 1.0

    plain, other = LlamaRMSNorm(48, eps=1e-5), GemmaLikeRMSNorm(48)
    with torch.no_grad():
        plain.weight.normal_()
    fused = kernels._fused_norm_class(plain)
    assert fused is not None and kernels._fused_norm_class(other) is None
    x = torch.randn(3, 7, 48)
    with torch.inference_mode():
        want = plain(x)
        plain.__class__ = fused
        assert torch.equal(plain(x), want)
        assert torch.equal(plain(x.double()), LlamaRMSNorm.forward(plain, x.double()))  # stock path


def test_adapter_installs_by_default_for_float32_cpu_only():
    m32 = tiny_model("qwen2", 2, dtype=torch.float32)
    a32 = adapter_for(m32)
    assert a32.fast_kernels and kernels.is_installed(m32)
    assert not a32.set_fast_kernels(False) and not kernels.is_installed(m32)
    assert a32.set_fast_kernels(True)
    m64 = tiny_model("qwen2", 2)  # float64: the kernels do not apply, the model is left alone
    a64 = adapter_for(m64)
    assert not a64.fast_kernels and not kernels.is_installed(m64)
    assert not adapter_for(tiny_model("llama", 2, dtype=torch.float32), fast_kernels=False).fast_kernels


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True, text=True, timeout=300
    )


_PROBE = """
import torch
from framework.kernels import cpu as kernels
from framework.engine.adapter import adapter_for
from framework.testing import tiny_model
model = tiny_model("llama", 2, dtype=torch.float32)
a = adapter_for(model)
b = adapter_for(model)
x = torch.randn(3, 64)
assert torch.equal(kernels.linear(x, model.lm_head.weight), torch.nn.functional.linear(x, model.lm_head.weight))
print("fast", a.fast_kernels, b.fast_kernels, kernels.available(), kernels.unavailable_reason)
"""


def test_disabled_by_env_silently():
    r = _python(_PROBE, SELFSPEC_KERNEL="0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"fast False False False disabled by {kernels.ENV_VAR}"
    assert "[selfspec]" not in r.stderr


def test_failed_build_falls_back_with_one_line_notice(tmp_path):
    # A compiler that does not exist: a different build directory, and the build fails at once.
    r = _python(_PROBE, SELFSPEC_CACHE=str(tmp_path), CXX="no-such-compiler-selfspec")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith("fast False False False no C++ compiler")
    notices = [line for line in r.stderr.splitlines() if line.startswith("[selfspec]")]
    assert len(notices) == 1 and "fast CPU kernels unavailable" in notices[0]
