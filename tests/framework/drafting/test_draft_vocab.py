"""framework/drafting/draft_vocab.py: the draft_vocab option of drafters that run the LM head: its
config checks, its preparation, what the decoder does with the head, and the drafts it produces."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from framework import REGISTRIES
from framework.config_fields import ConfigError, build_config
from framework.drafting.draft_vocab import MIN_DRAFT_VOCAB, DraftVocab, DraftVocabConfig
from framework.engine.adapter import adapter_for
from framework.engine.cost_model import CostModel
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.draft_head import DraftHead
from framework.kernels import cpu as kernels
from framework.kernels.lowbit import LowBitLinears
from framework.testing import prepare_context, random_prompt, tiny_model
from strategies.length.fixed import FixedLength, FixedLengthConfig
from strategies.selectors.static import StaticSelector, StaticSelectorConfig
from strategies.verifiers.greedy import GreedyVerifier

HEAD_DRAFTERS = ("layer_skip", "early_exit", "hybrid")


@pytest.fixture(scope="module")
def adapter():
    return adapter_for(tiny_model("llama", num_layers=4, seed=7))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))


def _drafter(name: str, **overrides):
    entry = REGISTRIES["drafter"].entry(name)
    return entry.cls(build_config(entry.config, overrides))


def _spied_decoder(
    adapter, drafter, attr: str, seen: dict, state_attr: str | None = None
) -> SpeculativeDecoder:
    """A decoder (static plan skipping two MLPs, k = 3, greedy) whose selector records the
    preparation context's ``attr`` and the round view's ``state_attr`` (default ``attr``) in
    ``seen["ctx"]`` / ``seen["state"]``."""

    class Spy(StaticSelector):
        def prepare(self, ctx):
            seen["ctx"] = getattr(ctx, attr)

        def plan(self, state):
            seen["state"] = getattr(state, state_attr or attr)
            return super().plan(state)

    return SpeculativeDecoder(
        adapter,
        Spy(StaticSelectorConfig(skip_mlp=(1, 2))),
        FixedLength(FixedLengthConfig(k=3)),
        drafter,
        GreedyVerifier(),
    )


def test_every_drafter_that_runs_the_lm_head_offers_the_option():
    for name in HEAD_DRAFTERS:
        cfg = REGISTRIES["drafter"].entry(name).config
        assert issubclass(cfg, DraftVocabConfig), name
        assert issubclass(REGISTRIES["drafter"].get(name), DraftVocab) or name == "hybrid"
        fields = {f.name for f in dataclasses.fields(cfg)}
        assert {"draft_vocab", "vocab_file", "vocab_context", "draft_weights"} <= fields
    assert not issubclass(REGISTRIES["drafter"].entry("prompt_lookup").config, DraftVocabConfig)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"draft_vocab": MIN_DRAFT_VOCAB - 1}, "draft_vocab"),
        ({"draft_vocab": -5}, "draft_vocab"),
        ({"draft_vocab": 1.5}, "draft_vocab"),
        ({"vocab_file": "ranking.json"}, "vocab_file"),
        ({"draft_vocab": 64, "vocab_context": "maybe"}, "vocab_context"),
        ({"draft_weights": "int2"}, "draft_weights"),
    ],
)
@pytest.mark.parametrize("name", HEAD_DRAFTERS)
def test_config_rejects_bad_values(name, overrides, field):
    with pytest.raises(ConfigError, match=field) as err:
        REGISTRIES["drafter"].entry(name).config(**overrides)
    assert err.value.allowed


def test_cli_strings_build_the_config():
    cfg = build_config(
        REGISTRIES["drafter"].entry("layer_skip").config, {"draft_vocab": "64", "vocab_context": "false"}
    )
    assert (cfg.draft_vocab, cfg.vocab_context) == (64, False)


def test_draft_vocab_of_the_whole_vocabulary_or_more_is_the_full_head(adapter):
    """A preset's K fits a model of any vocabulary: K >= V drafts with the full head."""
    for k in (128, 1000):
        d = _drafter("layer_skip", draft_vocab=k)
        d.prepare(prepare_context(adapter))
        assert d.draft_head() is None and d.head_summary() == {}


def test_a_bad_ranking_file_fails_at_prepare_naming_the_file(adapter, tmp_path):
    bad = tmp_path / "ranking.json"
    bad.write_text('{"format": "nope"}')
    d = _drafter("early_exit", draft_vocab=32, vocab_file=str(bad))
    with pytest.raises(ConfigError, match="vocab_file") as err:
        d.prepare(prepare_context(adapter))
    assert "ranking.json" in str(err.value)


def test_using_the_head_before_prepare_is_a_clear_error(adapter):
    d = _drafter("layer_skip", draft_vocab=32)
    dec = SpeculativeDecoder(adapter, StaticSelector(), FixedLength(), d, GreedyVerifier())
    with pytest.raises(RuntimeError, match=r"prepare\(ctx\)"):
        dec.generate(random_prompt(5, 128, 0), StopCondition(4))


@pytest.mark.parametrize("name", HEAD_DRAFTERS)
def test_prepare_builds_the_head_and_the_decoder_hands_it_on(adapter, name):
    d = _drafter(name, draft_vocab=32)
    seen: dict = {}
    dec = _spied_decoder(adapter, d, "draft_head", seen)
    dec.prepare(prepare_context(adapter))
    head = d.draft_head()
    assert isinstance(head, DraftHead) and head.size == 32
    assert seen["ctx"] is head
    prompt = random_prompt(6, 128, 1)
    res = dec.generate(prompt, StopCondition(16))
    assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(16)).tokens
    live = seen["state"]
    assert live.base is head
    summary = res.strategy_summary["drafter"]
    assert summary["draft_vocab"] == 32 and summary["draft_vocab_now"] == live.size
    assert 0.0 <= summary["vocab_coverage"] <= 1.0


@pytest.mark.parametrize("name", ["layer_skip", "early_exit"])
def test_drafted_tokens_and_candidates_lie_in_the_head(adapter, name):
    d = _drafter(name, draft_vocab=24, vocab_context=False)
    dec = SpeculativeDecoder(
        adapter,
        StaticSelector(StaticSelectorConfig(skip_mlp=(1,))),
        FixedLength(FixedLengthConfig(k=4)),
        d,
        REGISTRIES["verifier"].get("tree")(),
    )
    dec.prepare(prepare_context(adapter))
    allowed = set(d.draft_head().ids.tolist())
    drafts = []
    orig = d.draft

    def record(state, plan, length, k):
        out = orig(state, plan, length, k)
        drafts.append(out)
        return out

    d.draft = record
    prompt = random_prompt(6, 128, 2)
    res = dec.generate(prompt, StopCondition(20))
    assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(20)).tokens
    assert drafts
    for draft in drafts:
        assert set(draft.tokens.flatten().tolist()) <= allowed
        assert set(draft.top_tokens.flatten().tolist()) <= allowed
        # confidences are top-1 probabilities of q over the head's tokens: the best candidate's
        assert torch.allclose(draft.confidences, draft.top_probs[..., 0])
        assert torch.allclose(draft.top_probs.sum(-1), draft.top_probs.sum(-1).clamp(max=1.0))


def test_the_cost_model_prices_drafts_with_the_head(adapter):
    d = _drafter("layer_skip", draft_vocab=32)
    ctx = prepare_context(adapter)
    d.prepare(ctx)
    full = ctx.cost_model()
    priced = dataclasses.replace(ctx, draft_head=d.draft_head()).cost_model()
    assert priced.draft_vocab == 32 and full.draft_vocab == 0
    assert priced.verify_costs == full.verify_costs and priced.attn == full.attn
    assert priced.base == pytest.approx(full.base - full.head + priced.head)
    assert priced.full_head == full.full_head
    assert ctx.prepared.get(CostModel, (d.draft_head().key, "float32")) is priced


# ---- draft_weights: a compressed copy of the weights for draft passes -----------------------------


@pytest.fixture(scope="module")
def kernel_adapter():
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason}")
    return adapter_for(tiny_model("llama", num_layers=4, seed=7, dtype=torch.float32), fast_kernels=True)


@contextlib.contextmanager
def _counting_mlp(branches):
    """Count the calls of ``branches.mlp_branch`` (a `FusedBlocks`) while the block runs: yields a
    one-element list holding the count."""
    count = [0]
    real = branches.mlp_branch

    def counting(*a, **k):
        count[0] += 1
        return real(*a, **k)

    branches.mlp_branch = counting
    try:
        yield count
    finally:
        del branches.mlp_branch


@pytest.mark.parametrize("name", HEAD_DRAFTERS)
@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_prepare_builds_the_weights_and_every_draft_pass_runs_them(kernel_adapter, name, fmt):
    adapter = kernel_adapter
    d = _drafter(name, draft_weights=fmt)
    seen: dict = {"passes": 0}
    dec = _spied_decoder(adapter, d, "draft_weights", seen, "compressed_drafts")
    dec.prepare(prepare_context(adapter))
    weights = d.draft_weights()
    assert weights is adapter.draft_branches(fmt) and weights.weights == fmt
    assert seen["ctx"] is weights
    prompt = random_prompt(6, 128, 1)
    with _counting_mlp(weights) as calls:
        res = dec.generate(prompt, StopCondition(16))
    seen["passes"] = calls[0]
    assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(16)).tokens
    assert seen["state"] is True  # the round's view says the drafts run a compressed copy
    assert seen["passes"] > 0  # the drafts ran the compressed copy ...
    assert res.strategy_summary["drafter"]["draft_weights"] == fmt


@pytest.mark.parametrize("compress_head", [True, False])
def test_compressed_drafts_score_the_head_compressed_unless_told_not_to(kernel_adapter, compress_head):
    adapter = kernel_adapter
    d = _drafter("layer_skip", draft_weights="int4", draft_vocab=32, compress_head=compress_head)
    dec = SpeculativeDecoder(
        adapter, StaticSelector(), FixedLength(FixedLengthConfig(k=3)), d, GreedyVerifier()
    )  # fmt: skip
    dec.prepare(prepare_context(adapter))
    weights = d.draft_weights()
    assert weights.weights == "int4" and weights.head == ("int8" if compress_head else None)
    assert weights.attn is adapter.draft_branches("int4").attn  # the ablation shares the branches
    prompt = random_prompt(6, 128, 2)
    res = dec.generate(prompt, StopCondition(16))
    assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(16)).tokens
    summary = res.strategy_summary["drafter"]
    assert summary["draft_weights"] == "int4"
    assert summary["draft_head_weights"] == ("int8" if compress_head else "float32")
    assert ("int8" in d.draft_head()._copies) is compress_head


def test_verification_and_plain_steps_never_run_the_compressed_copy(kernel_adapter):
    adapter = kernel_adapter
    d = _drafter("layer_skip", draft_weights="int8")
    dec = SpeculativeDecoder(
        adapter, StaticSelector(), FixedLength(FixedLengthConfig(k=3)), d, GreedyVerifier()
    )
    dec.prepare(prepare_context(adapter))
    with _counting_mlp(adapter.fused) as own:
        res = dec.generate(random_prompt(6, 128, 2), StopCondition(12))
    calls = {"own": own[0]}
    # the prefill (6 tokens) and every verification ran every block's own MLP; the drafts none
    assert res.drafted > 0
    assert calls["own"] == adapter.arch.num_layers * (1 + len(res.accept_lengths))


def test_a_copy_without_a_fast_kernel_is_not_kept_unless_asked(adapter):
    """A float64 model has no fused branches and a CPU no low-bit kernel: only the float32
    reference could run the copy (slower than the model's own), so drafts run the model's own
    weights and the run says so; ``weights_check=False`` keeps the copy."""
    d = _drafter("layer_skip", draft_weights="int8")
    notes: list[str] = []
    d.prepare(dataclasses.replace(prepare_context(adapter), log=notes.append))
    assert d.draft_weights() is None
    assert any("draft_weights=int8 has no fast kernel on cpu" in n for n in notes)
    assert d.summary()["draft_weights"] == "float32"
    kept = _drafter("layer_skip", draft_weights="int8", weights_check=False)
    kept.prepare(prepare_context(adapter))
    assert isinstance(kept.draft_weights(), LowBitLinears) and kept.summary()["draft_weights"] == "int8"


def test_a_bfloat16_copy_of_a_bfloat16_model_is_the_model_itself():
    bf16 = adapter_for(tiny_model("llama", num_layers=2, seed=1, dtype=torch.bfloat16))
    d = _drafter("layer_skip", draft_weights="bfloat16", weights_check=False)
    notes: list[str] = []
    d.prepare(dataclasses.replace(prepare_context(bf16), log=notes.append))
    assert d.draft_weights() is None and any("nothing to compress" in n for n in notes)


@pytest.fixture(scope="module")
def module_adapter():
    """float32 through the modules (no CPU kernels): the path every low-bit format takes on CUDA."""
    return adapter_for(tiny_model("llama", num_layers=4, seed=7, dtype=torch.float32), fast_kernels=False)


@pytest.mark.parametrize("name", HEAD_DRAFTERS)
@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4", "bfloat16"])
def test_low_bit_copies_run_in_drafts_only_and_the_output_is_unchanged(
    module_adapter, monkeypatch, name, fmt
):
    adapter = module_adapter
    d = _drafter(name, draft_weights=fmt, weights_check=False)
    seen: dict = {}
    dec = _spied_decoder(adapter, d, "draft_weights", seen, "compressed_drafts")
    dec.prepare(prepare_context(adapter))
    weights = d.draft_weights()
    assert isinstance(weights, LowBitLinears) and weights is adapter.draft_branches(fmt)
    rows: list[int] = []
    real = LowBitLinears.linear
    monkeypatch.setattr(
        LowBitLinears, "linear", lambda self, mod, x: rows.append(x.shape[-2]) or real(self, mod, x)
    )
    prompt = random_prompt(6, 128, 1)
    res = dec.generate(prompt, StopCondition(16))
    monkeypatch.undo()
    assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(16)).tokens
    assert seen["ctx"] is weights and seen["state"] is True
    # the copy ran, and only in one-token draft steps: never the prefill (6) or a verification (k+1)
    assert rows and set(rows) == {1}
    assert res.strategy_summary["drafter"]["draft_weights"] == fmt


def test_low_bit_drafts_take_graphs_of_their_own(module_adapter):
    """The static CUDA-graph branches (``capture=False`` on a CPU): a draft with fp8 weights keys
    its branches by the format, verification keeps the model's own, and the output is unchanged."""
    adapter = module_adapter
    graphs = adapter.executor.set_cuda_graphs(True, capture=False)
    try:
        d = _drafter("layer_skip", draft_weights="fp8", weights_check=False)
        dec = SpeculativeDecoder(
            adapter, StaticSelector(StaticSelectorConfig(skip_mlp=(1, 2))), FixedLength(FixedLengthConfig(k=3)),
            d, GreedyVerifier(),
        )  # fmt: skip
        dec.prepare(prepare_context(adapter))
        prompt = random_prompt(6, 128, 4)
        res = dec.generate(prompt, StopCondition(16))
        formats = {key[-1] for key in graphs.store._graphs}
        assert formats == {None, "fp8"}
        assert {key[2] for key in graphs.store._graphs if key[-1] == "fp8"} == {1}  # draft steps only
        assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(16)).tokens
        assert adapter.executor.prepare_graphs(512, chain=(1, 2), weights=d.draft_weights())[0] > 0
        assert {key[2] for key in graphs.store._graphs if key[-1] == "fp8"} == {1, 2}
    finally:
        adapter.executor.set_cuda_graphs(False)


def test_low_bit_drafts_differ_from_the_target_only_by_rounding(module_adapter):
    """A draft through every sub-layer differs from the target only by its weights: float32 drafts
    accept every token, and each format keeps most of them (measured on this random model, whose
    near-uniform logits flip easily: bfloat16 1.0, int8 0.91, fp8 0.60, int4 0.29 (4-bit weights
    and 8-bit activations); a wrong scale drops to about 1/V). tests/integration pins the margin on the real default model."""
    adapter = module_adapter

    def acceptance(fmt):
        d = _drafter("layer_skip", draft_weights=fmt, weights_check=False)
        dec = SpeculativeDecoder(
            adapter,
            StaticSelector(StaticSelectorConfig(skip_ratio=0.0)),
            FixedLength(FixedLengthConfig(k=4)),
            d,
            GreedyVerifier(),
        )
        dec.prepare(prepare_context(adapter))
        runs = [dec.generate(random_prompt(8, 128, s), StopCondition(32)) for s in range(4)]
        return sum(r.accepted for r in runs) / sum(r.drafted for r in runs)

    assert acceptance("float32") == 1.0
    floors = {"bfloat16": 0.95, "int8": 0.8, "fp8": 0.45, "int4": 0.2}
    assert {f: acceptance(f) >= low for f, low in floors.items()} == dict.fromkeys(floors, True)


def _fake_timings(monkeypatch, per_block: dict):
    """Draft-block timings (own weights first, then each copy by format) instead of measuring,
    and every copy's kernel called fast, as on a GPU."""
    import framework.engine.context as chooser  # where the weights are chosen (PrepareView's service)

    def timings(adapter, weights, reps):
        return [(per_block["float32" if w is None else w.weights] / 2,) * 2 for w in weights]

    monkeypatch.setattr(chooser, "draft_sublayer_seconds", timings)
    real = LowBitLinears.build.__func__

    def build(cls, arch, fmt):
        lb = real(cls, arch, fmt)
        if lb is not None:
            lb.kernel = "fast"
        return lb

    monkeypatch.setattr(LowBitLinears, "build", classmethod(build))


@pytest.mark.parametrize(
    ("times", "want"),
    [
        ({"float32": 1.0, "fp8": 0.4, "int8": 0.6}, "fp8"),
        ({"float32": 1.0, "fp8": 0.7, "int8": 0.5}, "int8"),
        ({"float32": 1.0, "fp8": 1.2, "int8": 1.1}, None),  # neither pays: the model's own
    ],
)
def test_auto_drafts_with_the_fastest_copy_that_pays(monkeypatch, times, want):
    _fake_timings(monkeypatch, times)
    adapter = adapter_for(tiny_model("llama", num_layers=2, seed=5, dtype=torch.float32), fast_kernels=False)
    d = _drafter("layer_skip", draft_weights="auto")
    notes: list[str] = []
    d.prepare(dataclasses.replace(prepare_context(adapter), log=notes.append))
    got = d.draft_weights()
    assert (None if got is None else got.weights) == want
    assert d.summary()["draft_weights"] == (want or "float32")
    assert any("draft_weights=auto" in n and "fp8" in n and "int8" in n for n in notes), notes


def test_a_named_copy_is_kept_only_if_it_drafts_faster(monkeypatch):
    _fake_timings(monkeypatch, {"float32": 1.0, "int8": 1.3})
    adapter = adapter_for(tiny_model("llama", num_layers=2, seed=5, dtype=torch.float32), fast_kernels=False)
    slow = _drafter("layer_skip", draft_weights="int8")
    notes: list[str] = []
    slow.prepare(dataclasses.replace(prepare_context(adapter), log=notes.append))
    assert slow.draft_weights() is None and any("measured no faster" in n for n in notes)
    kept = _drafter("layer_skip", draft_weights="int8", weights_check=False)
    kept.prepare(prepare_context(adapter))
    assert kept.draft_weights().weights == "int8"


def test_auto_is_int8_on_the_cpu_kernels_and_own_weights_without_a_fast_kernel(
    kernel_adapter, module_adapter
):
    d = _drafter("layer_skip", draft_weights="auto")
    d.prepare(prepare_context(kernel_adapter))
    assert d.draft_weights() is kernel_adapter.draft_branches("int8")
    d = _drafter("layer_skip", draft_weights="auto")
    notes: list[str] = []
    d.prepare(dataclasses.replace(prepare_context(module_adapter), log=notes.append))
    assert d.draft_weights() is None and any("no fast low-bit kernel on cpu" in n for n in notes)


def test_int4_without_the_vnni_kernel_is_kept_with_a_note(kernel_adapter, monkeypatch):
    from framework.kernels.fused import FusedBlocks

    assert kernel_adapter.draft_branches("int4").int4_kernel in ("avx512_vnni", "scalar")
    monkeypatch.setattr(FusedBlocks, "int4_kernel", property(lambda self: "scalar"))
    notes: list[str] = []
    d = _drafter("layer_skip", draft_weights="int4")
    d.prepare(dataclasses.replace(prepare_context(kernel_adapter), log=notes.append))
    assert d.draft_weights().weights == "int4"
    assert any("no AVX-512 VNNI" in n and "slow scalar loop" in n for n in notes), notes
