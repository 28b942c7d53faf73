"""Every preset prepares and decodes on a CPU in bfloat16, exact mode on and off, and in float16
(issue 48, item 4).

The tiny model here has a vocabulary of 512 and the drafters that run the LM head draft with a
reduced head of 64 tokens, so the reduced draft head is built and checked against the model's own
head (`framework.engine.draft_head.DraftHead._check`) in the model's dtype: with the tiny models'
usual vocabulary of 128 a preset's ``draft_vocab`` covers the whole vocabulary and no head is
built, which is how a bfloat16 check at float32 tolerance stopped the default model's preparation
unseen. The gate is off so that rounds draft. In exact mode a lossless preset's output equals plain
decoding token for token; without it the run must decode (equality may fail at near-ties there).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from framework import REGISTRIES
from framework.config_fields import ConfigError
from framework.engine.draft_head import DraftHead, HeadNotLinear, head_check_tolerance
from framework.kernels import cpu as kernels
from framework.session.presets import list_presets, load_preset
from framework.session.run_config import RunConfig
from framework.session.session import Session
from framework.testing import fast_overrides, random_prompt, tiny_model, tiny_tokenizer

VOCAB, HEAD = 512, 64

#: The presets of the quick check (the default, the hybrid drafter and a sampling preset); the full
#: suite runs every preset.
QUICK = ("static_confidence", "hybrid", "selfsd_sampling")

#: (dtype, exact): float16 has no exact mode on a CPU (refused, `test_exact_mode_is_refused_in_float16`).
MODES = ((torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, False))

PROMPTS = ((911, 9), (912, 15))


def _overrides(name: str) -> dict:
    preset = load_preset(name)
    out = fast_overrides(preset)
    drafter = REGISTRIES["drafter"].entry(preset.get("drafter", {}).get("name", "layer_skip")).config
    if "draft_vocab" in {f.name for f in dataclasses.fields(drafter)}:
        out["drafter.draft_vocab"] = HEAD
    inner = preset.get("drafter", {}).get("then_config") or {}
    if "draft_vocab" in inner:  # grammar_forced drafting on with a drafter that has a head
        out["drafter.then_config"] = {**inner, "draft_vocab": HEAD}
    if preset.get("gate"):
        out["gate.enabled"] = False
    return out


def _session(name: str, dtype: torch.dtype, exact: bool) -> Session:
    cfg = RunConfig.from_preset(name, max_new_tokens=20, exact=exact, **_overrides(name))
    model = tiny_model("llama", num_layers=6, seed=9, dtype=dtype, vocab_size=VOCAB)
    return Session(cfg, model, tiny_tokenizer(VOCAB), log=lambda _msg: None)


def _params():
    for name in list_presets():
        for dtype, exact in MODES:
            marks = () if name in QUICK else (pytest.mark.slow,)
            label = f"{name}-{str(dtype).removeprefix('torch.')}-{'exact' if exact else 'plain'}"
            yield pytest.param(name, dtype, exact, marks=marks, id=label)


@pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {kernels.unavailable_reason}")
@pytest.mark.parametrize(("name", "dtype", "exact"), list(_params()))
def test_every_preset_prepares_and_decodes_in_low_precision(name, dtype, exact):
    exp = _session(name, dtype, exact)
    assert exp.adapter.arch.dtype is dtype and exp.adapter.exact is exact
    decoder = exp.decoder
    overrides = _overrides(name)
    if (
        "drafter.draft_vocab" in overrides or "drafter.then_config" in overrides
    ) and not exp.cfg.method.baseline_only:
        head = decoder.drafter.draft_head()
        assert isinstance(head, DraftHead) and head.size == HEAD  # the reduced head was built and checked
    verifier = exp.cfg.method.verifier.name
    greedy = REGISTRIES["verifier"].get(verifier).lossless == "greedy"
    drafted = 0
    for seed, plen in PROMPTS:
        ids = random_prompt(plen, VOCAB, seed=seed)
        got = decoder.generate(ids, exp.stop())
        assert len(got.tokens) == 20 or got.stop_reason != "max_new_tokens"
        assert all(0 <= t < VOCAB for t in got.tokens)
        drafted += sum(got.draft_lengths)
        if exact and greedy:
            want = exp.vanilla.generate(ids, exp.stop()).tokens
            assert got.tokens == want, f"{name} in exact mode, prompt {seed}: differs from plain decoding"
    if not exp.cfg.method.baseline_only:
        # `forced` drafts only what a grammar forces: without one, every round is a plain step
        assert drafted > 0 or name.startswith("del") or name == "forced", f"{name}: no round drafted"


def test_exact_mode_is_refused_in_float16_with_one_line_naming_the_flag():
    with pytest.raises(
        ConfigError, match=r"--exact must be off \(exact mode on a CPU needs float32 or bfloat16"
    ):
        cfg = RunConfig.from_preset("static_confidence", exact=True)
        Session(cfg, tiny_model("llama", 4, dtype=torch.float16), tiny_tokenizer(), log=lambda _m: None)


# ------------------------------------------------------------------ the reduced head's check by dtype


@pytest.mark.parametrize(
    ("dtype", "exact"),
    [*MODES, (torch.float32, True), (torch.float32, False)],
    ids=lambda v: (
        str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else ("exact" if v else "plain")
    ),
)
def test_the_head_check_tolerance_follows_the_dtype(dtype, exact):
    """The reduced head reproduces the model's own head to the dtype's rounding, in exact mode and
    without: built, and its logits match the LM head's columns within `head_check_tolerance`."""
    from framework.engine.adapter import adapter_for

    adapter = adapter_for(tiny_model("llama", 4, seed=3, dtype=dtype, vocab_size=VOCAB))
    adapter.set_exact(exact)
    ids = list(range(0, VOCAB, 3))
    head = DraftHead(adapter, ids)
    x = torch.randn(3, adapter.arch.info().hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        full = adapter.arch.lm_head(x)[..., ids].float()
        mine = head.logits(x).float()
    tol = head_check_tolerance(dtype) * float(full.abs().max())
    assert float((full - mine).abs().max()) <= tol
    assert head_check_tolerance(torch.bfloat16) > 1e-2 > head_check_tolerance(torch.float16) > 1e-3


def test_the_head_check_at_float32_tolerance_fails_a_bfloat16_model(monkeypatch):
    """A bfloat16 head compared at float32's tolerance is refused (what stopped the default model):
    the check's probe makes the rounding visible on a tiny model too."""
    import framework.engine.draft_head as draft_head
    from framework.engine.adapter import adapter_for

    adapter = adapter_for(tiny_model("llama", 4, seed=3, dtype=torch.bfloat16, vocab_size=VOCAB))
    monkeypatch.setattr(draft_head, "head_check_tolerance", lambda _dtype: 1e-3)
    with pytest.raises(HeadNotLinear):
        DraftHead(adapter, list(range(0, VOCAB, 3)))


def test_a_head_refused_by_the_architecture_blames_draft_vocab_not_a_file(monkeypatch):
    """The error names the setting to change (draft_vocab) and the architecture, never a
    ``--drafter.vocab_file`` nobody set."""
    import framework.engine.draft_head as draft_head

    monkeypatch.setattr(draft_head, "head_check_tolerance", lambda _dtype: -1.0)
    with pytest.raises(ConfigError) as err:
        _session("static_confidence", torch.bfloat16, True)
    text = str(err.value)
    assert text.startswith("--drafter.draft_vocab must be 0 for this model (LlamaFamily's LM head")
    assert "vocab_file" not in text and "(built)" not in text


@pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {kernels.unavailable_reason}")
@pytest.mark.parametrize("exact", [True, False])
def test_exact_in_float32_on_a_cpu_says_it_changes_nothing(exact):
    """A float32 model on a CPU runs the batch-invariant kernels whatever ``--exact`` says: the
    run says so in one line instead of pretending the flag did something."""
    said: list[str] = []
    cfg = RunConfig.from_preset("static_confidence", exact=exact)
    exp = Session(cfg, tiny_model("llama", 4, dtype=torch.float32), tiny_tokenizer(), log=said.append)
    assert exp.adapter.fast_kernels and exp.adapter.exact is exact
    assert [m for m in said if "exact changes nothing" in m] == [
        f"note: --{'' if exact else 'no-'}exact changes nothing here: a float32 model on a CPU with the "
        "kernels computes every row alike whatever it says (--no-kernels: the stock path)"
    ]
    said.clear()
    Session(
        RunConfig.from_preset("static_confidence"),
        tiny_model("llama", 4, dtype=torch.float32),
        tiny_tokenizer(),
        log=said.append,
    )
    assert not [m for m in said if "exact" in m]
