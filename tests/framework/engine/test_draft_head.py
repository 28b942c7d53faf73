"""framework/engine/draft_head.py: the reduced draft head reproduces the LM head's columns, maps
indices to token ids, and a generation's head follows its context."""

from __future__ import annotations

import pytest
import torch

from framework.engine.adapter import adapter_for
from framework.engine.draft_head import DraftHead, LiveDraftHead
from framework.engine.state import DecodeState
from framework.testing import random_prompt, tiny_model
from framework.types import LayerPlan

IDS = [0, 5, 7, 9, 11, 20, 33, 64, 100, 127]


@pytest.fixture(scope="module")
def adapter():
    return adapter_for(tiny_model("llama", num_layers=4, seed=3))


def test_logits_are_the_lm_head_columns_of_the_ids(adapter):
    head = DraftHead(adapter, IDS)
    x = torch.randn(2, 3, adapter.arch.info().hidden_size, dtype=adapter.arch.dtype)
    with torch.inference_mode():
        full = adapter.arch.lm_head(x)
        mine = head.logits(x)
    assert mine.shape == (2, 3, len(IDS))
    torch.testing.assert_close(mine, full[..., IDS])
    assert head.size == len(IDS) and head.vocab_size == adapter.arch.info().vocab_size


def test_tokens_expand_mask_and_coverage(adapter):
    head = DraftHead(adapter, IDS)
    assert head.tokens(torch.tensor([[0, 3, 9]])).tolist() == [[0, 9, 127]]
    vals = torch.arange(len(IDS), dtype=torch.float64)[None]
    full = head.expand(vals)
    assert full.shape == (1, head.vocab_size)
    assert full[0, IDS].tolist() == vals[0].tolist()
    rest = torch.ones(head.vocab_size, dtype=torch.bool)
    rest[IDS] = False
    assert torch.isneginf(full[0, rest]).all()
    assert (head.expand(vals, 0.0)[0, rest] == 0).all()
    assert head.mask.sum() == len(IDS) and head.mask[IDS].all()
    assert head.coverage([0, 5, 1, 2]) == 0.5
    assert head.coverage([]) == 0.0


@pytest.mark.parametrize(
    ("ids", "match"),
    [([3], "between"), ([0, 1, 1, 2], "distinct"), ([0, 1, 128], r"\[0, 128\)"), ([-1, 0, 1], r"\[0, 128\)")],
)
def test_bad_ids_are_rejected(adapter, ids, match):
    with pytest.raises(ValueError, match=match):
        DraftHead(adapter, ids)


def test_a_head_that_is_not_a_plain_linear_map_is_rejected(adapter):
    class Scaled:  # an architecture whose LM head scales its logits (as soft-capping would change them)
        def __init__(self, inner):
            self.inner = inner

        def head_parameters(self):
            return self.inner.head_parameters()

        def lm_head(self, x):
            return 2.0 * self.inner.lm_head(x)

    class Wrapped:  # an executor of that architecture
        arch = Scaled(adapter.arch)

    with pytest.raises(ValueError, match="Scaled's LM head is not a plain linear map"):
        DraftHead(Wrapped(), IDS)


def test_forward_with_a_head_returns_its_columns_and_top1_maps_to_ids(adapter):
    head = DraftHead(adapter, IDS)
    prompt = random_prompt(6, 128, 0)
    plan = LayerPlan.from_indices(4, mlp=[1])
    outs = []
    for h in (None, head):
        state = DecodeState(adapter, prompt, 32)
        state.append(state.prefill().argmax(-1)[:, None])
        state.draft_head = h
        outs.append(state.forward_draft(state.pending, plan, logits_at="last"))
    full, mine = outs
    assert full.head is None and mine.head is head
    torch.testing.assert_close(mine.logits, full.logits[..., IDS])
    want = torch.tensor(IDS)[full.logits[..., IDS].argmax(-1)]
    assert mine.top1().tolist() == want.tolist()


def test_top1_from_hidden_with_a_head(adapter):
    head = DraftHead(adapter, IDS)
    h = torch.randn(5, adapter.arch.info().hidden_size, dtype=adapter.arch.dtype)
    toks, probs = adapter.top1_from_hidden(h, head=head)
    with torch.inference_mode():
        sub = adapter.arch.lm_head(adapter.arch.final_norm(h))[:, IDS].float()
    assert toks.tolist() == torch.tensor(IDS)[sub.argmax(-1)].tolist()
    torch.testing.assert_close(probs, torch.softmax(sub, -1).max(-1).values)


# ------------------------------------------------------------------------------ the generation's head


def test_live_head_without_context_is_the_shared_set_and_counts_coverage(adapter):
    head = DraftHead(adapter, IDS)
    with torch.inference_mode():
        live = head.start(torch.tensor([[1, 2, 3]]))
        assert isinstance(live, LiveDraftHead) and live.size == len(IDS)
        live.observe(torch.tensor([[0, 1, 5]]))
    assert (live.committed, live.covered) == (3, 2)
    assert live.size == len(IDS)  # nothing added without context


def test_live_head_with_context_adds_prompt_and_committed_tokens(adapter):
    head = DraftHead(adapter, IDS, context=True)
    x = torch.randn(1, 1, adapter.arch.info().hidden_size, dtype=adapter.arch.dtype)
    with torch.inference_mode():
        live = head.start(torch.tensor([[1, 2, 5, 2]]))  # 1 and 2 are new, 5 is in the set
        assert live.size == len(IDS) + 2
        assert set(live.ids.tolist()) == set(IDS) | {1, 2}
        live.observe(torch.tensor([[3, 1, 0]]))  # 3 is new; 1 was added by the prompt
        assert (live.committed, live.covered) == (3, 2)
        assert set(live.ids.tolist()) == set(IDS) | {1, 2, 3}
        logits = live.logits(x)
        full = adapter.arch.lm_head(x)
    torch.testing.assert_close(logits, full[..., live.ids])
    assert not head.mask[1] and head.size == len(IDS)  # the shared head is unchanged


def test_live_head_buffers_grow(adapter):
    head = DraftHead(adapter, IDS, context=True)
    with torch.inference_mode():
        live = head.start(torch.tensor([[1]]))
        for t in range(30, 127):
            live.observe(torch.tensor([[t]]))
        x = torch.randn(1, 1, adapter.arch.info().hidden_size, dtype=adapter.arch.dtype)
        torch.testing.assert_close(live.logits(x), adapter.arch.lm_head(x)[..., live.ids])
    assert live.size == len(set(IDS) | {1} | set(range(30, 127)))


def test_state_starts_and_updates_the_generations_head(adapter):
    from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
    from strategies.drafters.layer_skip import LayerSkipDrafter
    from strategies.length.fixed import FixedLength, FixedLengthConfig
    from strategies.selectors.static import StaticSelector, StaticSelectorConfig
    from strategies.verifiers.greedy import GreedyVerifier

    head = DraftHead(adapter, IDS, context=True)
    drafter = LayerSkipDrafter()
    drafter.use_head(head)
    sel = StaticSelector(StaticSelectorConfig(skip_mlp=(1,)))
    dec = SpeculativeDecoder(adapter, sel, FixedLength(FixedLengthConfig(k=3)), drafter, GreedyVerifier())
    prompt = random_prompt(7, 128, 4)
    res = dec.generate(prompt, StopCondition(20))
    assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(20)).tokens
    live = drafter.head_summary()
    assert live["draft_vocab"] == len(IDS)
    assert live["draft_vocab_now"] >= len(IDS) + len(set(prompt[0].tolist()) - set(IDS))
    assert 0.0 <= live["vocab_coverage"] <= 1.0


# ---- compressed drafts score the head from a compressed copy --------------------------------
def _kernel_adapter():
    from framework.kernels import cpu as kernels

    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason}")
    return adapter_for(tiny_model("llama", num_layers=2, seed=5, dtype=torch.float32), fast_kernels=True)


@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
def test_a_head_scored_in_a_compressed_format_computes_its_copys_product(fmt):
    from framework.kernels.fused import compress_weight

    adapter = _kernel_adapter()
    head = DraftHead(adapter, list(range(0, 128, 3)))
    x = torch.randn(1, 3, adapter.arch.hidden_size)
    with torch.inference_mode():
        own = head.logits(x)
        comp = head.logits(x, fmt)
    q, scale = compress_weight(head.weight, fmt)
    dense = q.float() * (1.0 if scale is None else scale[:, None])
    torch.testing.assert_close(comp, x @ dense.t(), atol=1e-4, rtol=1e-4)  # the copy's product
    assert not torch.equal(comp, own) and torch.allclose(comp, own, atol=0.05 * float(own.abs().max()))
    copy_ = head._copies[fmt]
    head.logits(x, fmt)
    assert head._copies[fmt] is copy_  # built once
    torch.testing.assert_close(head.logits(x, None), own)
    # more rows than the kernels take: the float32 rows
    many = torch.randn(1, 70, adapter.arch.hidden_size)
    torch.testing.assert_close(head.logits(many, fmt), head.logits(many))


@pytest.mark.parametrize(("weights", "fmt"), [("int8", "int8"), ("int4", "int8"), ("bfloat16", "bfloat16")])
def test_a_draft_with_fused_compressed_weights_scores_the_head_in_their_head_format(weights, fmt):
    adapter = _kernel_adapter()
    head = DraftHead(adapter, list(range(0, 128, 2)))
    h = torch.randn(1, 2, adapter.arch.hidden_size)
    branches = adapter.draft_branches(weights)
    assert branches.head == fmt
    with torch.inference_mode():
        normed = adapter.arch.final_norm(h)
        assert torch.equal(adapter.logits_from_hidden(h, head, branches), head.logits(normed, fmt))
        assert torch.equal(adapter.logits_from_hidden(h, head), head.logits(normed))
        plain = branches.with_head(None)  # the ablation: the same branches, the float32 head rows
        assert plain.attn is branches.attn and plain.weights == weights and plain.head is None
        assert torch.equal(adapter.logits_from_hidden(h, head, plain), head.logits(normed))


def test_the_modules_low_bit_copy_keeps_the_float32_head_rows():
    lowbit = adapter_for(tiny_model("llama", num_layers=2, seed=5, dtype=torch.float32), fast_kernels=False)
    mod = lowbit.draft_branches("int8")  # the modules' copy (CUDA's path)
    head = DraftHead(lowbit, list(range(0, 128, 2)))
    h = torch.randn(1, 2, lowbit.arch.hidden_size)
    with torch.inference_mode():
        assert torch.equal(lowbit.logits_from_hidden(h, head, mod), lowbit.logits_from_hidden(h, head))


def test_linear_lowp_refuses_an_unknown_format_and_declines_what_it_cannot_take():
    from framework.kernels import cpu as kernels
    from framework.kernels.fused import compress_weight

    q, scale = compress_weight(torch.randn(8, 16), "int8")
    with pytest.raises(ValueError, match="one of \\['bfloat16', 'int8', 'int4'\\], got 'fp8'"):
        kernels.linear_lowp(torch.randn(1, 16), q, scale, None, "fp8")
    assert kernels.linear_lowp(torch.randn(1, 16, dtype=torch.float64), q, scale, None, "int8") is None
    assert kernels.linear_lowp(torch.randn(65, 16), q, scale, None, "int8") is None  # > MAX_ROWS
