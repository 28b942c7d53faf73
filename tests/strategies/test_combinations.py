"""THE central invariant over every registered combination: greedy self-speculative decoding emits
exactly the tokens of plain greedy decoding, for every selector x length x drafter x verifier.

The combinations are read from the registries at collection time, so a newly registered strategy
is covered without writing a test. The core product (`test_speculative_equals_vanilla`) runs every
combination in the quick check, each on one architecture with one prompt (CI: every architecture,
both prompts); the sets over further options (a reduced draft head, compressed weights, SWIFT
mid-optimisation, DEL drafting) run a covering subset there and whole in CI (`covering`). Each strategy runs with its default config, except that offline
searches are shrunk (``framework.testing.FAST_OVERRIDES``): losslessness must hold for any skip set.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from framework import REGISTRIES
from framework.config_fields import build_config
from framework.drafting.draft_vocab import DraftVocabConfig
from framework.engine.adapter import adapter_for
from framework.engine.context import PreparedCache
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.kernels import cpu as kernels
from framework.testing import default_strategy_instance, prepare_context, random_prompt, tiny_model

KINDS = ("selector", "length", "drafter", "verifier")
# Verifiers that are lossless in distribution only (speculative sampling) are tested statistically
# in their own test files; every greedy-lossless one is checked token for token here.
GREEDY_VERIFIERS = [
    n for n in REGISTRIES["verifier"].names() if REGISTRIES["verifier"].get(n).lossless == "greedy"
]
COMBOS = list(itertools.product(*(REGISTRIES[k].names() for k in KINDS[:3]), GREEDY_VERIFIERS))
ARCHS_TESTED = ("llama", "qwen2", "mistral")
MAX_NEW = 24
PROMPTS = ((0, 6), (1, 11))  # (seed, length)

_vanilla_cache: dict[tuple, list[int]] = {}


def covering(combos: list[tuple]) -> list:
    """``combos`` as parameters, where those that bring a name not seen yet in some position (in
    order) run in the quick check and the others are marked slow: the quick check still meets
    every selector, length controller, drafter, verifier and format of a set; CI runs them all."""
    seen: list[set] = [set() for _ in combos[0]] if combos else []
    params = []
    for combo in combos:
        new = any(name not in names for name, names in zip(combo, seen, strict=True))
        for name, names in zip(combo, seen, strict=True):
            names.add(name)
        params.append(pytest.param(combo, marks=() if new else pytest.mark.slow))
    return params


_prepared: dict[str, PreparedCache] = {}


def _vanilla(adapter, arch: str, seed: int, plen: int) -> list[int]:
    key = (arch, seed, plen)
    if key not in _vanilla_cache:
        res = VanillaDecoder(adapter).generate(random_prompt(plen, 128, seed), StopCondition(MAX_NEW))
        _vanilla_cache[key] = res.tokens
    return _vanilla_cache[key]


def test_registries_not_empty():
    assert COMBOS, "no registered strategy combination"
    assert all(len(REGISTRIES[k]) for k in KINDS)


# The quick check decodes every combination once: on one of the three architectures (in turn, so
# that each meets a third of the combinations) with the first prompt. CI decodes every combination on
# every architecture with both prompts.
CORE_PARAMS = [
    pytest.param(
        combo,
        arch,
        prompts,
        id=f"{'-'.join(combo)}-{arch}-{pid}",
        marks=() if (pid == "p0" and ARCHS_TESTED[i % len(ARCHS_TESTED)] == arch) else pytest.mark.slow,
    )
    for i, combo in enumerate(COMBOS)
    for arch in ARCHS_TESTED
    for pid, prompts in (("p0", PROMPTS[:1]), ("p1", PROMPTS[1:]))
]


@pytest.mark.parametrize(("combo", "arch", "prompts"), CORE_PARAMS)
def test_speculative_equals_vanilla(deep_adapters, arch, combo, prompts):
    adapter = deep_adapters[arch]
    s = {k: default_strategy_instance(k, name, fast=True) for k, name in zip(KINDS, combo, strict=True)}
    dec = SpeculativeDecoder(adapter, s["selector"], s["length"], s["drafter"], s["verifier"])
    # Offline searches (selfsd_bo) run once per model; every combination reuses the result.
    dec.prepare(prepare_context(adapter, prepared=_prepared.setdefault(arch, PreparedCache())))
    for seed, plen in prompts:
        want = _vanilla(adapter, arch, seed, plen)
        res = dec.generate(random_prompt(plen, 128, seed), StopCondition(MAX_NEW))
        assert res.tokens == want, f"{combo} on {arch}, prompt seed {seed}: output differs from vanilla"
        assert res.stop_reason == "max_new_tokens"
        assert 0 <= res.accepted <= res.drafted
        assert 1 + sum(res.accept_lengths) == MAX_NEW
        assert res.accepted == sum(res.accept_lengths) - len(res.accept_lengths)
        assert all(0.0 <= r < 1.0 for r in res.skip_ratios)


# Every drafter that runs the LM head offers a reduced draft head (draft_vocab): the output must not
# change, whatever selector, length controller and greedy verifier it drafts with. K = 32 of the
# tiny vocabulary's 128 tokens, so that many target tokens lie outside the head (and enter it as
# context tokens once they were committed).
HEAD_DRAFTERS = [
    n
    for n in REGISTRIES["drafter"].names()
    if issubclass(REGISTRIES["drafter"].entry(n).config, DraftVocabConfig)
]
HEAD_COMBOS = list(
    itertools.product(
        REGISTRIES["selector"].names(), REGISTRIES["length"].names(), HEAD_DRAFTERS, GREEDY_VERIFIERS
    )
)


@pytest.mark.parametrize("combo", covering(HEAD_COMBOS), ids=lambda c: "-".join(c))
def test_speculative_equals_vanilla_with_a_reduced_draft_head(
    deep_adapters, combo, tmp_path_factory, monkeypatch
):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path_factory.getbasetemp() / "selfspec-cache"))
    arch = "llama"
    adapter = deep_adapters[arch]
    s = {k: default_strategy_instance(k, name, fast=True) for k, name in zip(KINDS, combo, strict=True)}
    entry = REGISTRIES["drafter"].entry(combo[2])
    s["drafter"] = entry.cls(build_config(entry.config, {"draft_vocab": 32}))
    dec = SpeculativeDecoder(adapter, s["selector"], s["length"], s["drafter"], s["verifier"])
    dec.prepare(prepare_context(adapter, prepared=_prepared.setdefault(f"{arch}-head", PreparedCache())))
    assert dec.drafter.draft_head().size == 32
    for seed, plen in PROMPTS:
        want = _vanilla(adapter, arch, seed, plen)
        res = dec.generate(random_prompt(plen, 128, seed), StopCondition(MAX_NEW))
        assert res.tokens == want, (
            f"{combo} with draft_vocab 32, prompt seed {seed}: output differs from vanilla"
        )
        assert 0 <= res.accepted <= res.drafted


# Every drafter that runs the LM head can draft with a compressed copy of the weights
# (draft_weights): int8 and int4 with every selector x length controller x greedy verifier (int8
# on top of the reduced head); bfloat16 with every drafter and verifier. The copy is of the CPU kernels' fused
# branches, so these run a float32 model with the kernels (whose verification is bit-identical to
# plain steps).
WEIGHT_COMBOS = [(*c, fmt) for fmt in ("int8", "int4") for c in HEAD_COMBOS] + [
    ("static", "confidence", d, v, "bfloat16") for d in HEAD_DRAFTERS for v in GREEDY_VERIFIERS
]


@pytest.fixture(scope="module")
def kernel_adapter():
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason}")
    return adapter_for(tiny_model("llama", num_layers=6, seed=1, dtype=torch.float32), fast_kernels=True)


@pytest.mark.parametrize("combo", covering(WEIGHT_COMBOS), ids=lambda c: "-".join(c))
def test_speculative_equals_vanilla_with_compressed_draft_weights(
    kernel_adapter, combo, tmp_path_factory, monkeypatch
):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path_factory.getbasetemp() / "selfspec-cache"))
    adapter = kernel_adapter
    *names, fmt = combo
    s = {k: default_strategy_instance(k, name, fast=True) for k, name in zip(KINDS, names, strict=True)}
    entry = REGISTRIES["drafter"].entry(names[2])
    options = {"draft_weights": fmt, **({"draft_vocab": 32} if fmt == "int8" else {})}
    s["drafter"] = entry.cls(build_config(entry.config, options))
    dec = SpeculativeDecoder(adapter, s["selector"], s["length"], s["drafter"], s["verifier"])
    dec.prepare(prepare_context(adapter, prepared=_prepared.setdefault(f"kernels-{fmt}", PreparedCache())))
    assert dec.drafter.draft_weights().weights == fmt
    for seed, plen in PROMPTS:
        want = _vanilla(adapter, "llama-float32-kernels", seed, plen)
        res = dec.generate(random_prompt(plen, 128, seed), StopCondition(MAX_NEW))
        assert res.tokens == want, f"{combo}, prompt seed {seed}: output differs from vanilla"
        assert 0 <= res.accepted <= res.drafted
    assert dec.drafter.summary()["draft_weights"] == fmt


def test_default_static_plan_skips_on_deep_model(deep_adapters):
    """The 6-layer models make the default static selector actually skip (the combinations above
    would otherwise only exercise the full-model draft)."""
    sel = default_strategy_instance("selector", "static")
    sel.setup(deep_adapters["llama"].arch.info())
    assert sel.plan(None).num_skipped >= 1


# SWIFT optimises only once ``context_window + 1`` tokens are committed (32 + 1 by default), past
# the 24 tokens above: here every length controller x drafter x greedy verifier runs with the
# swift selector (its default configuration) long enough for the optimisation phase to propose
# new skip sets mid-generation, and the output must still be vanilla's.
SWIFT_MAX_NEW = 48
SWIFT_COMBOS = list(
    itertools.product(REGISTRIES["length"].names(), REGISTRIES["drafter"].names(), GREEDY_VERIFIERS)
)


@pytest.mark.parametrize("combo", covering(SWIFT_COMBOS), ids=lambda c: "swift-" + "-".join(c))
def test_speculative_equals_vanilla_while_swift_optimises(deep_adapters, combo):
    adapter = deep_adapters["llama"]
    s = {
        k: default_strategy_instance(k, name, fast=True)
        for k, name in zip(KINDS, ("swift", *combo), strict=True)
    }
    dec = SpeculativeDecoder(adapter, s["selector"], s["length"], s["drafter"], s["verifier"])
    dec.prepare(prepare_context(adapter, prepared=_prepared.setdefault("llama-swift", PreparedCache())))
    steps = 0
    for seed, plen in PROMPTS:
        want = (
            VanillaDecoder(adapter)
            .generate(random_prompt(plen, 128, seed), StopCondition(SWIFT_MAX_NEW))
            .tokens
        )
        res = dec.generate(random_prompt(plen, 128, seed), StopCondition(SWIFT_MAX_NEW))
        assert res.tokens == want, f"swift x {combo}, prompt seed {seed}: output differs from vanilla"
        steps += res.strategy_summary["selector"].get("opt_steps", 0)
    # The optimisation ran (it proposes sets from the committed tokens, whatever the drafter does
    # with the plan); a drafter that never verified past the window would leave it at 0.
    assert steps > 0, f"swift x {combo}: SWIFT never optimised within {SWIFT_MAX_NEW} tokens"


# On the random 6-block models DEL's Token-per-Layer finds no exit worth drafting from, so its
# combinations above draft nothing. A model with redundancy: the last three blocks' residual
# updates scaled by 0.35 (their output projections), so that an exit at block 3 or 4 often, not
# always, predicts the full model's token. There, del_tpl drafts, some drafts are rejected, and
# every length controller x drafter x greedy verifier must still give vanilla's output.
DEL_COMBOS = list(
    itertools.product(REGISTRIES["length"].names(), REGISTRIES["drafter"].names(), GREEDY_VERIFIERS)
)


@pytest.fixture(scope="module")
def redundant_adapter():
    model = tiny_model("llama", num_layers=6, seed=1)
    with torch.no_grad():
        for blk in model.model.layers[3:]:
            blk.self_attn.o_proj.weight.mul_(0.35)
            blk.mlp.down_proj.weight.mul_(0.35)
    return adapter_for(model)


@pytest.mark.parametrize("combo", covering(DEL_COMBOS), ids=lambda c: "del_tpl-" + "-".join(c))
def test_speculative_equals_vanilla_where_del_drafts(redundant_adapter, combo):
    adapter = redundant_adapter
    s = {
        k: default_strategy_instance(k, name, fast=True)
        for k, name in zip(KINDS, ("del_tpl", *combo), strict=True)
    }
    dec = SpeculativeDecoder(adapter, s["selector"], s["length"], s["drafter"], s["verifier"])
    dec.prepare(prepare_context(adapter))
    drafted = accepted = 0
    for seed, plen in PROMPTS:
        prompt = random_prompt(plen, 128, seed)
        want = VanillaDecoder(adapter).generate(prompt, StopCondition(MAX_NEW)).tokens
        res = dec.generate(prompt, StopCondition(MAX_NEW))
        assert res.tokens == want, f"del_tpl x {combo}, prompt seed {seed}: output differs from vanilla"
        drafted, accepted = drafted + res.drafted, accepted + res.accepted
    if combo[:2] == ("del_dynamic", "early_exit"):  # DEL as published: it drafts, and is sometimes wrong
        assert drafted > 0 and 0 < accepted < drafted, (drafted, accepted)
