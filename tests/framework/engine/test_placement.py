"""A model split across devices (``--device-map``): the placement logic, and the split forward path
run on one CPU (shards on ``cpu`` twice take the same code path as ``cuda:0`` + ``cuda:1``: the
residual stream crosses each boundary, every shard has its own KV buffer). Every decoder must give
the unsplit model's tokens. On a GPU, tests/integration/test_gpu.py splits ``cuda:0`` + ``cpu``."""

from __future__ import annotations

import pytest
import torch

from framework.engine.adapter import adapter_for
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.placement import BlockPlacement, Shard
from framework.testing import default_strategy_instance, prepare_context, random_prompt, tiny_model

L = 6


def test_parse_splits_by_counts_and_shares_the_rest_evenly():
    p = BlockPlacement.parse("cuda:0=20,cuda:1", 32)
    assert p.shards == (
        Shard(torch.device("cuda:0"), range(20)),
        Shard(torch.device("cuda:1"), range(20, 32)),
    )
    assert p.split and p.input_device == torch.device("cuda:0") and p.output_device == torch.device("cuda:1")
    even = BlockPlacement.parse("cuda:0, cpu", 5)
    assert [s.blocks for s in even.shards] == [range(3), range(3, 5)]
    assert [p.device_of(i).type for i in (0, 19, 20, 31)] == ["cuda", "cuda", "cuda", "cuda"]
    assert BlockPlacement.parse("cpu", 4).split is False
    assert "cuda:0: blocks 0-19" in p.describe()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "names at least one device"),
        ("gpu0", "is not a device"),
        ("cpu=0,cpu", "BLOCKS must be an integer >= 1"),
        ("cpu=x,cpu", "BLOCKS must be an integer >= 1"),
        ("cpu=5,cpu=5", "add up to 10, the model has 6"),
        ("cpu=3,cpu=2", "add up to 5, the model has 6"),
        ("cpu=6,cpu", "share only 0 blocks"),
    ],
)
def test_bad_device_maps_are_refused_with_a_reason(spec, message):
    with pytest.raises(ValueError, match=message):
        BlockPlacement.parse(spec, L)


def test_the_placement_of_a_loaded_model_is_read_from_its_blocks():
    adapter = adapter_for(tiny_model("llama", L, seed=1))
    assert adapter.placement == BlockPlacement.single(L, "cpu") and not adapter.placement.split


def _pair(seed: int = 3, spec: str = "cpu=2,cpu=1,cpu"):
    """(unsplit adapter, the same model split into the shards of ``spec``)."""
    whole = adapter_for(tiny_model("llama", L, seed=seed))
    split = adapter_for(tiny_model("llama", L, seed=seed))
    split.place(BlockPlacement.parse(spec, L))
    return whole, split


def test_a_split_cache_has_one_buffer_per_shard_and_no_single_buffer():
    _, split = _pair()
    cache = split.new_cache(32)
    assert len(cache._k_shards) == 3 and [b.shape[0] for b in cache._k_shards] == [2, 1, 3]
    with pytest.raises(ValueError, match="no single keys buffer"):
        cache.keys  # noqa: B018
    with pytest.raises(ValueError, match="one device"):
        split.executor.set_cuda_graphs(True, capture=False)


def test_a_split_forward_computes_what_the_whole_model_computes():
    whole, split = _pair()
    prompt = random_prompt(9, seed=2)
    outs = []
    for a in (whole, split):
        cache = a.new_cache(32)
        pos = torch.arange(9)[None]
        out = a.forward(prompt, pos, cache, logits_at="all", capture_hidden=True)
        outs.append((out, cache))
    (w, wc), (s, sc) = outs
    assert torch.equal(s.logits, w.logits) and torch.equal(s.hidden_states, w.hidden_states)
    assert torch.equal(s.last_hidden, w.last_hidden)
    for layer in range(L):
        for a, b in zip(wc.committed_kv(layer), sc.committed_kv(layer), strict=True):
            assert torch.equal(a, b)


COMBINATIONS = [
    ("static", "fixed", "layer_skip", "greedy"),
    ("clasp_dp", "confidence", "layer_skip", "greedy"),  # hidden states across the shards
    ("del_tpl", "del_dynamic", "early_exit", "greedy"),  # early-exit KV reuse across a boundary
    ("static", "confidence", "layer_skip", "tree"),  # a token tree's commit gathers every shard
    ("swift", "fixed", "layer_skip", "greedy"),  # scratch passes
    ("static", "fixed", "hybrid", "greedy"),  # copies and a reduced draft head
]


@pytest.mark.parametrize("selector, length, drafter, verifier", COMBINATIONS)
def test_every_decoder_on_a_split_model_gives_the_whole_models_tokens(selector, length, drafter, verifier):
    whole, split = _pair()
    stop = StopCondition(48)
    for seed in range(3):
        prompt = random_prompt(8, seed=seed)
        want = VanillaDecoder(whole).generate(prompt, stop).tokens
        assert VanillaDecoder(split).generate(prompt, stop).tokens == want
        kinds = ("selector", "length", "drafter", "verifier")
        names = (selector, length, drafter, verifier)
        parts = [default_strategy_instance(k, n, fast=True) for k, n in zip(kinds, names, strict=True)]
        dec = SpeculativeDecoder(split, *parts)
        dec.prepare(prepare_context(split))
        got = dec.generate(prompt, stop)
        assert got.tokens == want, (selector, length, drafter, verifier, seed)


def test_the_run_option_places_the_model_and_refuses_what_cannot_work(tmp_path):
    from framework.config_fields import ConfigError
    from framework.data.prompts import Prompt
    from framework.models.loading import hf_device_map
    from framework.session.run_config import RunConfig
    from framework.session.session import Session
    from framework.testing import tiny_tokenizer

    cfg = RunConfig.of(
        device_map="cpu=1,cpu", dtype="float64", max_new_tokens=12, logger="none", kernels=False
    )
    exp = Session(cfg, tiny_model("llama", 4, seed=5), tiny_tokenizer(), log=lambda m: None)
    assert [s.blocks for s in exp.adapter.placement.shards] == [range(1), range(1, 4)]
    prompt = Prompt(1, "qa", "qa", ("w5 w6 w7",))
    (van, _), (spec, _) = exp.decode_prompt(exp.vanilla, prompt)[0], exp.decode_prompt(exp.spec, prompt)[0]
    assert spec.tokens == van.tokens
    with pytest.raises(ConfigError, match="a split of 4 blocks"):
        Session(cfg.replace(device_map="cpu=5,cpu"), tiny_model("llama", 4), tiny_tokenizer())
    with pytest.raises(ConfigError, match="off with --device-map"):
        RunConfig.of(device_map="auto", cuda_graphs=True)
    with pytest.raises(ConfigError, match="one process"):
        RunConfig.of(device_map="auto", devices=2)

    class Config:
        num_hidden_layers = 4

    hf = hf_device_map("cuda:0=3,cpu", Config())
    assert hf["model.embed_tokens"] == hf["model.layers.2"] == "cuda:0"
    assert hf["model.layers.3"] == hf["model.norm"] == hf["lm_head"] == "cpu"
    assert hf_device_map("auto", Config()) == "auto"
