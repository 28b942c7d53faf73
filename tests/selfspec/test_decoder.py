"""selfspec.Decoder: the Python API over presets, strategy names/classes/instances and loaded models."""

from __future__ import annotations

import pytest
import torch

import selfspec
from framework import ConfigError, LayerPlan, LayerSelector
from framework.testing import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("llama", num_layers=4, seed=3), tiny_tokenizer()


PROMPT = "w5 w9 w13 w2 w7"


def quiet(**kw):
    return dict(log=None, **kw)


def test_from_preset_generates_exactly_the_vanilla_tokens(model_and_tokenizer):
    model, tok = model_and_tokenizer
    dec = selfspec.Decoder.from_preset(
        "static_confidence", model=model, tokenizer=tok, max_new_tokens=24, **quiet()
    )
    out = dec.generate(PROMPT)
    van = dec.generate_vanilla(PROMPT)
    assert out.tokens == van.tokens and len(out.tokens) > 0
    assert out.text == van.text
    s = out.stats
    assert s.new_tokens == len(out.tokens)
    assert s.rounds == len(s.accept_lengths) == len(s.draft_lengths)
    assert sum(s.accept_lengths) == s.new_tokens - 1  # the prefill's token is not a round's
    assert 0.0 <= s.acceptance_rate <= 1.0 and s.mean_accepted_length >= 1.0
    assert all(isinstance(p, LayerPlan) and p.num_layers == 4 for p in s.plans)
    assert len(s.plans) == sum(1 for k in s.draft_lengths if k)
    assert {"prefill", "draft", "verify"} <= set(s.phase_times)
    assert dec.method.label == "static_confidence"


def test_overrides_reach_the_strategies(model_and_tokenizer):
    model, tok = model_and_tokenizer
    dec = selfspec.Decoder.from_preset(
        "swift", model=model, tokenizer=tok, **{"length.threshold": 0.7}, gate={"enabled": False}, **quiet()
    )
    assert dec.method.length.config.threshold == 0.7
    assert dec.strategies["length"].config.threshold == 0.7
    with pytest.raises(ConfigError, match=r"--length\.threshold"):
        selfspec.Decoder.from_preset(
            "swift", model=model, tokenizer=tok, **{"length.threshold": 1.5}, **quiet()
        )


class EveryOtherMlp(LayerSelector):
    """An unregistered researcher's selector: skip the MLP of every other block."""

    def __init__(self) -> None:
        super().__init__(config=object())
        self.calls = 0

    def plan(self, state):
        self.calls += 1
        n = state.info.num_layers
        return LayerPlan.from_indices(n, mlp=range(1, n, 2))


def test_from_strategies_takes_names_and_instances(model_and_tokenizer):
    model, tok = model_and_tokenizer
    mine = EveryOtherMlp()
    dec = selfspec.Decoder.from_strategies(
        selector=mine, length="fixed", model=model, tokenizer=tok, **{"length.k": 3}, **quiet()
    )
    assert dec.strategies["selector"] is mine
    assert dec.strategies["length"].config.k == 3
    cmp = dec.compare(PROMPT, max_new_tokens=16)
    assert mine.calls > 0
    assert cmp.lossless is True and cmp.first_mismatch is None
    assert cmp.method.tokens == cmp.vanilla.tokens
    assert cmp.speedup > 0 and cmp.repeats == 1
    assert all(p.mlp_skip == (False, True, False, True) for p in cmp.method.stats.plans)
    assert "speedup" in str(cmp)


def test_prompts_as_chat_and_as_ids(model_and_tokenizer):
    model, tok = model_and_tokenizer
    dec = selfspec.Decoder.from_preset("static_confidence", model=model, tokenizer=tok, **quiet())
    ids = dec.encode(PROMPT)
    assert torch.equal(dec.encode([{"role": "user", "content": PROMPT}]), ids)
    assert (
        dec.generate(ids[0].tolist(), max_new_tokens=8).tokens
        == dec.generate(PROMPT, max_new_tokens=8).tokens
    )


def test_bad_input_is_named(model_and_tokenizer):
    model, tok = model_and_tokenizer
    with pytest.raises(ValueError, match="both hf_model and tokenizer"):
        selfspec.Decoder.from_preset("swift", model=model, **quiet())
    # a decoder takes the model, method and generation sections only
    for key, section in (
        ("logger", "runner"),
        ("resume", "runner"),
        ("limit", "data"),
        ("num_nodes", "runner"),
    ):
        with pytest.raises(ConfigError, match=f"it is the {section} section's option"):
            selfspec.Decoder.from_preset("swift", model="tiny-random", **{key: "x"}, **quiet())
    with pytest.raises(ConfigError, match="it is no option"):
        selfspec.Decoder.from_preset("swift", model="tiny-random", sampler=1, **quiet())
    dec = selfspec.Decoder.from_preset("static_confidence", model=model, tokenizer=tok, **quiet())
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate("  ")
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        dec.compare(PROMPT, repeats=0)


def test_named_model_loads_offline():
    dec = selfspec.Decoder.from_preset("static_confidence", model="tiny-random", max_new_tokens=8, **quiet())
    out = dec.generate(PROMPT)
    assert out.tokens == dec.generate_vanilla(PROMPT).tokens
