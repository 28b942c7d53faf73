"""How-to script: an architecture for OLMo 2, checked against Hugging Face's own logits.

``docs/howto/new_architecture.md`` includes this file section by section. Run it from the
repository root (a few seconds on a CPU, nothing is downloaded):

    python docs/howto/olmo2_adapter.py
"""

# --8<-- [start:adapter]
from __future__ import annotations

from framework.engine.architecture import Architecture, cache_kwarg, register_architecture


@register_architecture("olmo2")
class Olmo2(Architecture):
    """OLMo 2: the Llama module layout, but each sub-layer normalises its output, not its input.

    Block i computes ``h = h + post_attention_layernorm(attn(h))`` and then
    ``h = h + post_feedforward_layernorm(mlp(h))``.
    """

    def __init__(self, model) -> None:
        super().__init__(model)
        inner = model.model
        self._blocks = list(inner.layers)
        self._embed = inner.embed_tokens
        self._norm = inner.norm
        self._rotary = inner.rotary_emb
        self._head = model.lm_head
        # "cache" from transformers 5.24 ("past_key_values" before, deprecated there).
        self._cache_kwarg = cache_kwarg(self._blocks[0].self_attn)

    @property
    def blocks(self):
        return self._blocks

    def embed(self, input_ids):
        return self._embed(input_ids)  # (B, T) -> (B, T, d)

    def rotary(self, hidden, position_ids):
        return self._rotary(hidden, position_ids)  # RoPE (cos, sin), passed to every attention

    def attention_branch(self, i, hidden, pos_emb, mask, cache):
        # The residual update only; the engine adds it to h. HF's attention module writes its
        # K/V into `cache` through cache.update(), so no cache code is needed here.
        blk = self._blocks[i]
        out = blk.self_attn(
            hidden_states=hidden,
            position_embeddings=pos_emb,
            attention_mask=mask,
            **{self._cache_kwarg: cache},
        )[0]
        return blk.post_attention_layernorm(out)

    def mlp_branch(self, i, hidden):
        blk = self._blocks[i]
        return blk.post_feedforward_layernorm(blk.mlp(hidden))

    def final_norm(self, hidden):
        return self._norm(hidden)

    def lm_head(self, hidden):
        return self._head(hidden)


# --8<-- [end:adapter]


# --8<-- [start:check]
import torch  # noqa: E402
from transformers import Olmo2Config, Olmo2ForCausalLM  # noqa: E402

from framework.engine.adapter import adapter_for  # noqa: E402


def tiny_olmo2(seed: int = 0) -> Olmo2ForCausalLM:
    config = Olmo2Config(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        initializer_range=0.1,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,  # the defaults lie outside this tiny vocabulary
    )
    torch.manual_seed(seed)
    return Olmo2ForCausalLM(config).to(torch.float64).eval()


def positions(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n)[None]  # (B=1, n)


@torch.inference_mode()
def check_against_hf() -> None:
    model = tiny_olmo2()
    adapter = adapter_for(model)  # finds Olmo2 through config.model_type == "olmo2"
    assert isinstance(adapter.arch, Olmo2)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    want = model(ids).logits  # (1, 12, V), Hugging Face's own forward

    # 1. The whole sequence in one forward.
    cache = adapter.new_cache(capacity=32)
    got = adapter.forward(ids, positions(0, 12), cache).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-8)

    # 2. A prefill of 8 tokens, then one token at a time through the KV cache.
    cache = adapter.new_cache(capacity=32)
    steps = [adapter.forward(ids[:, :8], positions(0, 8), cache).logits]
    cache.commit(8)
    for t in range(8, 12):
        steps.append(adapter.forward(ids[:, t : t + 1], positions(t, 1), cache).logits)
        cache.commit(1)
    torch.testing.assert_close(torch.cat(steps, dim=1), want, rtol=0, atol=1e-8)
    print("adapter logits match Hugging Face (one shot and incremental)")


def check_lossless() -> None:
    from framework import get_drafter, get_length, get_selector, get_verifier
    from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder

    adapter = adapter_for(tiny_olmo2())
    static = get_selector("static")
    spec = SpeculativeDecoder(
        adapter,
        static(static.Config(skip_ratio=0.25)),
        get_length("fixed")(),
        get_drafter("layer_skip")(),
        get_verifier("greedy")(),
    )
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    stop = StopCondition(24)
    assert spec.generate(prompt, stop).tokens == VanillaDecoder(adapter).generate(prompt, stop).tokens
    print("speculative greedy output equals vanilla greedy output")


# --8<-- [end:check]


if __name__ == "__main__":
    check_against_hf()
    check_lossless()
