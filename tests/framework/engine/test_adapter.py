"""framework.engine.adapter: the block loop against Hugging Face's own forward and an independent
reference written here from HF's decoder modules."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from framework import LayerPlan
from framework.engine.adapter import adapter_for
from framework.engine.architecture import supported_model_types
from framework.testing import ARCHS, random_prompt

ATOL = 1e-8


def _pos(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n)[None]


def _causal_mask(t: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive (1, 1, T, T) causal mask."""
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    mask = torch.zeros(t, t, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.inference_mode()
def reference_forward(model, ids: torch.Tensor, plan: LayerPlan | None = None) -> tuple[torch.Tensor, list]:
    """Logits of ``plan`` over ``ids`` computed directly from HF's decoder modules, no cache.

    Returns (logits (B, T, V), [residual after each block run], the embedding first).
    """
    inner = model.model
    h = inner.embed_tokens(ids)
    pos_emb = inner.rotary_emb(h, _pos(0, ids.shape[1]))
    mask = _causal_mask(ids.shape[1], h.dtype)
    hiddens = [h]
    n = len(inner.layers) if plan is None or plan.exit_layer is None else plan.exit_layer
    for i, blk in enumerate(inner.layers[:n]):
        if plan is None or not plan.attn_skip[i]:
            h = (
                h
                + blk.self_attn(
                    hidden_states=blk.input_layernorm(h),
                    position_embeddings=pos_emb,
                    attention_mask=mask,
                )[0]
            )
        if plan is None or not plan.mlp_skip[i]:
            h = h + blk.mlp(blk.post_attention_layernorm(h))
        hiddens.append(h)
    return model.lm_head(inner.norm(h)), hiddens


@pytest.mark.parametrize("arch", ARCHS)
def test_full_forward_matches_hf_one_shot(arch, tiny_models, adapters):
    model, adapter = tiny_models[arch], adapters[arch]
    ids = random_prompt(11, seed=5)
    with torch.inference_mode():
        want = model(ids).logits
    out = adapter.forward(ids, _pos(0, 11), adapter.new_cache(16))
    assert out.logits.shape == want.shape == (1, 11, 128)
    torch.testing.assert_close(out.logits, want, atol=ATOL, rtol=0)
    ref, _ = reference_forward(model, ids)
    torch.testing.assert_close(ref, want, atol=ATOL, rtol=0)  # the reference itself is faithful


@pytest.mark.parametrize("arch", ARCHS)
def test_full_forward_matches_hf_incremental(arch, tiny_models, adapters):
    model, adapter = tiny_models[arch], adapters[arch]
    ids = random_prompt(10, seed=6)
    with torch.inference_mode():
        want = model(ids).logits
    cache = adapter.new_cache(4)  # also exercises capacity growth
    got = []
    # a 3-token chunk first, then token by token through the cache
    out = adapter.forward(ids[:, :3], _pos(0, 3), cache)
    cache.commit(3)
    got.append(out.logits)
    for t in range(3, 10):
        out = adapter.forward(ids[:, t : t + 1], _pos(t, 1), cache)
        cache.commit(1)
        got.append(out.logits)
    torch.testing.assert_close(torch.cat(got, dim=1), want, atol=ATOL, rtol=0)
    assert cache.committed == 10 and cache.lengths == [10] * adapter.arch.num_layers


def _plans(num_layers: int):
    bits = st.lists(st.booleans(), min_size=num_layers, max_size=num_layers)
    return st.builds(
        lambda a, m, e: LayerPlan(tuple(a), tuple(m), e),
        bits,
        bits,
        st.none() | st.integers(1, num_layers),
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_skip_plan_matches_reference(arch, tiny_models, adapters):
    model, adapter = tiny_models[arch], adapters[arch]
    ids = random_prompt(7, seed=7)

    @settings(max_examples=15, deadline=None, derandomize=True)
    @given(_plans(adapter.arch.num_layers))
    def check(plan):
        want, hiddens = reference_forward(model, ids, plan)
        out = adapter.forward(ids, _pos(0, 7), adapter.new_cache(8), plan, capture_hidden=True)
        torch.testing.assert_close(out.logits, want, atol=ATOL, rtol=0)
        assert out.hidden_states.shape == (plan.blocks_run + 1, 1, 7, 64)
        torch.testing.assert_close(out.hidden_states, torch.stack(hiddens), atol=ATOL, rtol=0)
        torch.testing.assert_close(out.last_hidden, hiddens[-1], atol=ATOL, rtol=0)

    check()


def test_skip_plan_incremental_matches_reference(tiny_llama, llama_adapter):
    """A skip plan run token by token through the cache equals the plan's one-shot reference
    (the plan's own KV is what the later tokens attend to)."""
    plan = LayerPlan.from_indices(4, attn=[1], mlp=[0, 3], exit_layer=None)
    ids = random_prompt(6, seed=8)
    want, _ = reference_forward(tiny_llama, ids, plan)
    cache = llama_adapter.new_cache(8)
    got = []
    for t in range(6):
        got.append(llama_adapter.forward(ids[:, t : t + 1], _pos(t, 1), cache, plan).logits)
    torch.testing.assert_close(torch.cat(got, 1), want, atol=ATOL, rtol=0)
    # the skipped attention (block 1) wrote no KV; the others hold 6 positions
    assert cache.lengths == [6, 0, 6, 6]


def test_capture_hidden_full(tiny_llama, llama_adapter):
    ids = random_prompt(5, seed=9)
    out = llama_adapter.forward(ids, _pos(0, 5), llama_adapter.new_cache(8), capture_hidden=True)
    L = llama_adapter.arch.num_layers
    assert out.hidden_states.shape == (L + 1, 1, 5, 64)
    with torch.inference_mode():
        emb = tiny_llama.model.embed_tokens(ids)
        hf = tiny_llama(ids, output_hidden_states=True)
    torch.testing.assert_close(out.hidden_states[0], emb, atol=0, rtol=0)
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden, atol=0, rtol=0)
    # HF's hidden_states: embeddings, then every block's output except the last, which is post-norm
    for i in range(L):
        torch.testing.assert_close(out.hidden_states[i], hf.hidden_states[i], atol=ATOL, rtol=0)
    torch.testing.assert_close(
        llama_adapter.logits_from_hidden(out.hidden_states[-1]), hf.logits, atol=ATOL, rtol=0
    )
    no_capture = llama_adapter.forward(ids, _pos(0, 5), llama_adapter.new_cache(8))
    assert no_capture.hidden_states is None


def test_logits_at_variants(llama_adapter):
    ids = random_prompt(6, seed=10)

    def run(logits_at):
        return llama_adapter.forward(ids, _pos(0, 6), llama_adapter.new_cache(8), logits_at=logits_at)

    full = run("all").logits
    assert full.shape == (1, 6, 128)
    torch.testing.assert_close(run("last").logits, full[:, -1:], atol=ATOL, rtol=0)
    idx = torch.tensor([0, 3, 5])
    torch.testing.assert_close(run(idx).logits, full[:, idx], atol=ATOL, rtol=0)
    none = run(None)
    assert none.logits is None and none.last_hidden.shape == (1, 6, 64)
    with pytest.raises(ValueError, match="logits_at"):
        run("first")


def test_adapter_facts(tiny_models, adapters):
    for arch, adapter in adapters.items():
        cfg = tiny_models[arch].config
        info = adapter.arch.info()
        assert info.num_layers == 4 and info.hidden_size == 64 and info.vocab_size == 128
        assert info.max_context == 512 and info.dtype == torch.float64
        assert adapter.arch.num_kv_heads == 2
        assert adapter.arch.head_dim == (32 if arch == "qwen3" else 16) == getattr(cfg, "head_dim", 16)
        cache = adapter.new_cache(5)
        assert cache.keys.shape == (4, 1, 2, 5, adapter.arch.head_dim) and cache.dtype == torch.float64
    assert set(ARCHS) <= set(supported_model_types())


def test_max_context_bounded_by_sliding_window():
    from framework.testing import tiny_model

    m = tiny_model("mistral", num_layers=1, sliding_window=64)
    assert adapter_for(m).arch.max_context == 64


def test_unsupported_architecture():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=32))
    with pytest.raises(ValueError) as exc:
        adapter_for(gpt2)
    msg = str(exc.value)
    assert "'gpt2'" in msg and "llama" in msg and "register_architecture" in msg
    with pytest.raises(ValueError, match="None"):
        adapter_for(torch.nn.Linear(2, 2))


def test_plan_of_wrong_length_rejected(llama_adapter):
    ids = random_prompt(3, seed=11)
    short = LayerPlan.full(llama_adapter.arch.num_layers - 1)
    with pytest.raises(ValueError):
        llama_adapter.forward(ids, _pos(0, 3), llama_adapter.new_cache(4), short)


def test_tiny_model_factory():
    from framework.testing import cached_tiny_model, tiny_model

    state = torch.random.get_rng_state()
    a, b = tiny_model("qwen2", num_layers=2, seed=3), tiny_model("qwen2", num_layers=2, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    c = tiny_model("qwen2", num_layers=2, seed=4)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert not a.training and a.dtype == torch.float64 and a.config.num_hidden_layers == 2
    assert tiny_model("llama", num_layers=1, dtype=torch.float32, vocab_size=50).lm_head.weight.shape == (
        50,
        64,
    )
    assert cached_tiny_model("llama", 4) is cached_tiny_model("llama", 4)
    with pytest.raises(ValueError, match="unknown tiny-model arch"):
        tiny_model("gpt2")


# ------------------------------------------------------------------ block ranges (forward_from)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("split", [1, 2, 3])
def test_forward_from_resumes_a_pass(arch, split, adapters):
    """Blocks [0, E) then [E, L) in two calls equal one full forward (logits, hidden, KV)."""
    adapter = adapters[arch]
    ids = random_prompt(7, seed=12)
    full_cache = adapter.new_cache(8)
    full = adapter.forward(ids, _pos(0, 7), full_cache, capture_hidden=True)
    cache = adapter.new_cache(8)
    low = adapter.forward(
        ids,
        _pos(0, 7),
        cache,
        LayerPlan.from_indices(4, exit_layer=split),
        logits_at=None,
        capture_hidden=True,
    )
    assert cache.lengths == [7] * split + [0] * (4 - split)
    high = adapter.forward_from(
        low.last_hidden, _pos(0, 7), cache, start=split, logits_at="all", capture_hidden=True
    )
    assert high.hidden_states.shape == (4 - split + 1, 1, 7, 64)
    torch.testing.assert_close(high.logits, full.logits, atol=ATOL, rtol=0)
    both = torch.cat([low.hidden_states, high.hidden_states[1:]])
    torch.testing.assert_close(both, full.hidden_states, atol=ATOL, rtol=0)
    assert cache.lengths == [7] * 4
    torch.testing.assert_close(cache.keys[:, :, :, :7], full_cache.keys[:, :, :, :7], atol=ATOL, rtol=0)


def test_forward_from_single_block_candidates_leave_cache_alone(llama_adapter):
    """One block on n candidate states at one position, each seeing the prefix and itself, equals n
    separate one-state calls, and writes nothing the cache keeps (CLaSp's sequence parallelism)."""
    adapter = llama_adapter
    ids = random_prompt(6, seed=13)
    cache = adapter.new_cache(16)
    adapter.forward(ids, _pos(0, 6), cache, logits_at=None)
    cache.commit(6)
    keys, lengths = cache.keys.clone(), list(cache.lengths)
    g = torch.Generator().manual_seed(0)
    states = torch.randn(3, 64, generator=g, dtype=torch.float64)
    pos = 4  # the candidates stand for the token at position 4: they see positions 0..3 only

    def run(s):
        n = s.shape[0]
        return adapter.forward_from(
            s[None],
            torch.full((1, n), pos),
            cache,
            start=2,
            stop=3,
            base=max(cache.lengths),
            visible=pos,
            tree_mask=torch.eye(n, dtype=torch.bool),
            persist=False,
        ).last_hidden[0]

    together = run(states)
    alone = torch.cat([run(states[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(together, alone, atol=ATOL, rtol=0)
    assert cache.lengths == lengths and torch.equal(cache.keys[:, :, :, :6], keys[:, :, :, :6])
    # the same state through block 2 in a fresh prefix of 4 tokens (no cache tricks)
    ref_cache = adapter.new_cache(8)
    adapter.forward(ids[:, :4], _pos(0, 4), ref_cache, logits_at=None)
    ref_cache.commit(4)
    want = adapter.forward_from(
        states[:1][None], torch.tensor([[pos]]), ref_cache, start=2, stop=3
    ).last_hidden[0]
    torch.testing.assert_close(alone[:1], want, atol=ATOL, rtol=0)


def test_layer_loads_and_block_evals(llama_adapter):
    adapter = llama_adapter
    ids = random_prompt(5, seed=14)
    loads, evals = adapter.executor.layer_loads, adapter.executor.block_evals
    adapter.forward(ids, _pos(0, 5), adapter.new_cache(8), LayerPlan.from_indices(4, exit_layer=3))
    assert adapter.executor.layer_loads - loads == 3 and adapter.executor.block_evals - evals == 15
    loads, evals = adapter.executor.layer_loads, adapter.executor.block_evals
    adapter.forward_from(
        torch.zeros(1, 2, 64, dtype=torch.float64), _pos(0, 2), adapter.new_cache(4), start=1
    )
    assert adapter.executor.layer_loads - loads == 3 and adapter.executor.block_evals - evals == 6


def test_forward_from_bad_range(llama_adapter):
    h = torch.zeros(1, 1, 64, dtype=torch.float64)
    for start, stop in ((3, 2), (-1, 2), (0, 5)):
        with pytest.raises(ValueError, match="block range"):
            llama_adapter.forward_from(h, _pos(0, 1), llama_adapter.new_cache(2), start=start, stop=stop)


def test_top1_from_hidden(llama_adapter):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 5, 64, generator=g, dtype=torch.float64)
    tok, prob = llama_adapter.top1_from_hidden(h, chunk=4)  # chunks that split the rows unevenly
    p = torch.softmax(llama_adapter.logits_from_hidden(h).float(), dim=-1)
    assert tok.shape == prob.shape == (3, 5) and prob.dtype == torch.float32
    assert torch.equal(tok, p.argmax(-1))
    torch.testing.assert_close(prob, p.max(-1).values, atol=1e-6, rtol=0)
    empty_tok, empty_prob = llama_adapter.top1_from_hidden(h[:0])
    assert empty_tok.shape == (0, 5) and empty_prob.shape == (0, 5)


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_is_called_without_deprecated_keywords(arch, tiny_models):
    """The adapter calls HF's attention with the cache keyword the installed release takes
    (``cache`` from transformers 5.24, ``past_key_values`` before), so no deprecation warning
    reaches a user's terminal."""
    adapter = adapter_for(tiny_models[arch], fast_kernels=False)
    ids = random_prompt(5, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        cache = adapter.new_cache(12)
        adapter.forward(ids, _pos(0, 5), cache)
        adapter.forward(ids[:, :1], _pos(5, 1), cache)


def test_fingerprint_names_the_weights_not_their_dtype():
    """One checkpoint in float32 and in bfloat16 has one fingerprint (a skip set searched on a CPU
    serves a GPU run); other weights have another."""
    from framework.testing import tiny_model

    a, b = tiny_model(seed=0), tiny_model(seed=1)
    fp = adapter_for(a).arch.fingerprint()
    assert adapter_for(tiny_model(seed=0).to(torch.bfloat16)).arch.fingerprint() == fp
    assert adapter_for(b).arch.fingerprint() != fp
