"""Batch invariance in float32 with the kernels of framework.kernels.cpu installed.

A forward over T new tokens (a verification) must give bit-identical logits and KV to T successive
one-token steps (plain decoding), for chains and trees. Then greedy speculative decoding reproduces
greedy decoding exactly, even on exact and near ties between the top two logits, which is checked
end to end here with LM heads built to tie.
"""

from __future__ import annotations

import pytest
import torch

from framework import REGISTRIES
from framework.config_fields import build_config
from framework.engine.adapter import adapter_for
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.kernels import cpu as kernels
from framework.testing import ARCHS, prepare_context, random_prompt, tiny_model

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=f"kernels unavailable: {kernels.unavailable_reason}"
)


def _pos(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n)[None]


def _fp32_adapter(arch: str = "llama", num_layers: int = 4, seed: int = 0, **overrides):
    model = tiny_model(arch, num_layers, seed=seed, dtype=torch.float32, **overrides)
    adapter = adapter_for(model, fast_kernels=True)
    assert adapter.fast_kernels
    return model, adapter


def _prefilled(adapter, ids: torch.Tensor, p: int):
    cache = adapter.new_cache(ids.shape[1] + 4)
    adapter.forward(ids[:, :p], _pos(0, p), cache, logits_at=None)
    cache.commit(p)
    return cache


def _single_steps(adapter, ids: torch.Tensor, p: int, positions: list[int] | None = None):
    """Logits (1, n, V) and the cache of one-token steps over ids[:, p:] after a prefill of p."""
    cache = _prefilled(adapter, ids, p)
    n = ids.shape[1] - p
    positions = list(range(p, p + n)) if positions is None else positions
    out = []
    for j in range(n):
        out.append(adapter.forward(ids[:, p + j : p + j + 1], torch.tensor([[positions[j]]]), cache).logits)
        cache.commit(1)
    return torch.cat(out, dim=1), cache


# ---------------------------------------------------------------------------------------------
# Row-wise ops of the model
# ---------------------------------------------------------------------------------------------


def test_rowwise_model_ops_are_row_invariant():
    """RMSNorm, RoPE and the gated SiLU of HF's Llama modules give each row the same bits alone
    as in a block (the kernels cover the matmuls and attention; these are HF's own code)."""
    model, adapter = _fp32_adapter()
    blk = model.model.layers[0]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 9, 64, generator=g)
    with torch.inference_mode():
        norm = blk.input_layernorm(h)
        act = model.model.layers[0].mlp.act_fn(h * 3)
        cos, sin = adapter.arch.rotary(h, _pos(20, 9))
        for j in range(9):
            assert torch.equal(blk.input_layernorm(h[:, j : j + 1]), norm[:, j : j + 1])
            assert torch.equal(model.model.layers[0].mlp.act_fn(h[:, j : j + 1] * 3), act[:, j : j + 1])
            c1, s1 = adapter.arch.rotary(h[:, j : j + 1], _pos(20 + j, 1))
            assert torch.equal(c1, cos[:, j : j + 1]) and torch.equal(s1, sin[:, j : j + 1])


def test_argmax_picks_the_first_of_tied_maxima():
    """Both decoders take ``argmax(-1)``: vanilla on (B, V), verification on (B, T, V). Ties must
    break the same way in both shapes: to the first index, as torch documents."""
    g = torch.Generator().manual_seed(1)
    for v in (7, 128, 1000, 49152):
        x = torch.randn(2, 6, v, generator=g)
        for i in range(2):
            for j in range(6):
                a, b = sorted(torch.randperm(v, generator=g)[:2].tolist())
                x[i, j, a] = x[i, j, b] = x[i, j].max() + 1.0
                want = a
                assert int(x.argmax(-1)[i, j]) == want
                assert int(x[:, j].argmax(-1)[i]) == want
                assert int(x[i, j].argmax()) == want
                assert int(x[i, j : j + 1].max(dim=-1).indices[0]) == want
                assert int(x.transpose(0, 1).argmax(-1)[j, i]) == want


# ---------------------------------------------------------------------------------------------
# Verification forwards vs single steps
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_verify_block_is_bit_identical_to_single_steps(arch):
    _, adapter = _fp32_adapter(arch)
    p, n = 11, 9
    ids = random_prompt(p + n, seed=3)
    want, ref_cache = _single_steps(adapter, ids, p)
    for t in range(1, n + 1):
        cache = _prefilled(adapter, ids, p)
        got = adapter.forward(ids[:, p : p + t], _pos(p, t), cache, base=p).logits
        assert torch.equal(got, want[:, :t]), f"T={t}: a verification differs from single steps"
        assert torch.equal(cache.keys[:, :, :, : p + t], ref_cache.keys[:, :, :, : p + t])
        assert torch.equal(cache.values[:, :, :, : p + t], ref_cache.values[:, :, :, : p + t])


def test_tree_verification_rows_equal_single_steps_along_their_paths():
    _, adapter = _fp32_adapter("qwen2")  # biases in q/k/v
    p = 7
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6]  # node 0 is the root (the pending token)
    t = len(parents)
    mask = torch.eye(t, dtype=torch.bool)
    depth = [0] * t
    for j, par in enumerate(parents):
        if par >= 0:
            mask[j] |= mask[par]
            depth[j] = depth[par] + 1
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 128, (1, p), generator=g)
    nodes = torch.randint(0, 128, (1, t), generator=g)
    cache = _prefilled(adapter, torch.cat([prompt, nodes], 1), p)
    pos = torch.tensor([[p + d for d in depth]])
    block = adapter.forward(nodes, pos, cache, base=p, tree_mask=mask).logits
    for j in range(t):
        path = [i for i in range(t) if mask[j, i]]  # ancestors in order, then j itself
        ids = torch.cat([prompt, nodes[:, path]], 1)
        single, _ = _single_steps(adapter, ids, p)
        assert torch.equal(single[:, -1], block[:, j]), f"tree node {j}"


def test_skip_drafts_then_verification_commit_identical_kv():
    """After draft steps, the verification rewrites the block; its KV equals plain decoding's."""
    from framework import LayerPlan
    from framework.engine.state import DecodeState

    _, adapter = _fp32_adapter("llama", num_layers=6)
    ids = random_prompt(14, seed=5)
    p = 8
    state = DecodeState(adapter, ids[:, :p], 32)
    state.append(state.prefill().argmax(-1)[:, None])
    plan = LayerPlan.from_indices(6, attn=[2], mlp=[1, 4])
    for j in range(3):
        state.forward_draft(ids[:, p + j : p + j + 1], plan)
    block = torch.cat([state.pending, ids[:, p : p + 3]], 1)
    got = state.forward_verify(block).logits
    want, ref = _single_steps(adapter, torch.cat([ids[:, :p], block], 1), p)
    assert torch.equal(got, want)
    state.cache.commit(4)
    assert torch.equal(state.cache.keys[:, :, :, : p + 4], ref.keys[:, :, :, : p + 4])


# ---------------------------------------------------------------------------------------------
# Greedy speculative == greedy vanilla on ties
# ---------------------------------------------------------------------------------------------


def _strategy(kind: str, name: str, **values):
    entry = REGISTRIES[kind].entry(name)
    return entry.cls(build_config(entry.config, values))


def _tied_model(tie: str):
    """A 6-layer float32 model whose LM-head rows 64..127 copy rows 0..63: exactly (``exact``)
    or up to a perturbation of ~1e-7 (``near``: the two top logits differ by a few ulps)."""
    model, adapter = _fp32_adapter("llama", num_layers=6, seed=2)
    with torch.no_grad():
        w = model.lm_head.weight
        w[64:] = w[:64]
        if tie == "near":
            g = torch.Generator().manual_seed(3)
            w[64:] += 1e-7 * torch.randn(64, w.shape[1], generator=g)
    return model, adapter


@pytest.mark.parametrize("verifier", ["greedy", "tree"])
@pytest.mark.parametrize("tie", ["exact", "near"])
def test_greedy_speculative_equals_vanilla_on_ties(tie, verifier):
    model, adapter = _tied_model(tie)
    for k in (2, 5):
        dec = SpeculativeDecoder(
            adapter,
            _strategy("selector", "static", skip_ratio=0.5),
            _strategy("length", "fixed", k=k),
            _strategy("drafter", "layer_skip"),
            _strategy("verifier", verifier),
        )
        dec.prepare(prepare_context(adapter))
        rounds = gaps = 0
        for seed in range(3):
            prompt = random_prompt(6, 128, seed)
            stop = StopCondition(24)
            want = VanillaDecoder(adapter).generate(prompt, stop).tokens
            got = dec.generate(prompt, stop)
            assert got.tokens == want, f"k={k}, prompt seed {seed}: speculative differs from vanilla"
            rounds += len(got.accept_lengths)
            seq = torch.cat([prompt, torch.tensor([want])], 1)
            with torch.inference_mode():
                logits = adapter.forward(seq, _pos(0, seq.shape[1]), adapter.new_cache(64)).logits[0, 5:-1]
            top2 = logits.topk(2, dim=-1).values
            gaps += int(
                ((top2[:, 0] - top2[:, 1]) <= 16 * torch.finfo(torch.float32).eps * top2[:, 0].abs()).sum()
            )
            if tie == "exact":
                assert max(want) < 64, "exact ties break to the first index"
        assert rounds < 3 * 23, "speculation accepted nothing: the test would be vacuous"
        assert gaps > 3 * 24 // 2, "most steps should be near-ties"


# ---------------------------------------------------------------------------------------------
# The real default model
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_verify_block_is_bit_identical_to_single_steps(default_model):
    model, _ = default_model
    adapter = adapter_for(model, fast_kernels=True)
    assert adapter.fast_kernels
    p, n = 24, 6
    ids = torch.randint(0, model.config.vocab_size, (1, p + n), generator=torch.Generator().manual_seed(0))
    want, _ = _single_steps(adapter, ids, p)
    cache = _prefilled(adapter, ids, p)
    got = adapter.forward(ids[:, p:], _pos(p, n), cache, base=p).logits
    assert torch.equal(got, want)
