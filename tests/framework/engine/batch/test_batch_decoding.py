"""framework.engine.batch: each row of a batch decodes exactly what its prompt decodes alone.

The contract, token for token: for every greedy-lossless combination, each row of a batch of three
prompts of different lengths equals that prompt's batch-1 output (the quick check covers every
strategy name, CI every combination); the same under logits processors and a grammar, in float32
through the CPU kernels' fused branches, and in bfloat16 with exact mode. Sampling: row r draws
from its own stream, so it equals a batch-1 run seeded ``seed + r`` (the exact-law tests of batch 1
then hold per row). The cache after every commit holds each row's committed tokens' KV.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from framework import REGISTRIES
from framework.engine.adapter import adapter_for
from framework.engine.batch.decoding import BatchDecoder
from framework.engine.batch.lockstep import Lockstep
from framework.engine.batch.rows import BatchCache, RowCache
from framework.engine.context import PreparedCache
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.processing import GenerationControls
from framework.engine.state import DecodeState
from framework.kernels import cpu as kernels
from framework.testing import default_strategy_instance, prepare_context, random_prompt, tiny_model

KINDS = ("selector", "length", "drafter", "verifier")
GREEDY_VERIFIERS = [
    n for n in REGISTRIES["verifier"].names() if REGISTRIES["verifier"].get(n).lossless == "greedy"
]
COMBOS = list(itertools.product(*(REGISTRIES[k].names() for k in KINDS[:3]), GREEDY_VERIFIERS))
PROMPTS = ((0, 6), (1, 11), (2, 3))  # (seed, length): three lengths, so the rows are ragged
MAX_NEW = 16

_prepared: dict[str, PreparedCache] = {}


def _covering(combos: list[tuple]) -> list:
    """Quick check: the combinations that bring a name not seen yet in some position; CI: all."""
    seen: list[set] = [set() for _ in KINDS]
    params = []
    for combo in combos:
        new = any(name not in names for name, names in zip(combo, seen, strict=True))
        for name, names in zip(combo, seen, strict=True):
            names.add(name)
        params.append(pytest.param(combo, id="-".join(combo), marks=() if new else pytest.mark.slow))
    return params


def _decoder(adapter, combo, key: str) -> SpeculativeDecoder:
    s = {k: default_strategy_instance(k, name, fast=True) for k, name in zip(KINDS, combo, strict=True)}
    dec = SpeculativeDecoder(adapter, s["selector"], s["length"], s["drafter"], s["verifier"])
    dec.prepare(prepare_context(adapter, prepared=_prepared.setdefault(key, PreparedCache())))
    return dec


def _prompts(vocab: int = 128) -> list[torch.Tensor]:
    return [random_prompt(n, vocab, seed) for seed, n in PROMPTS]


def _alone_then_batched(dec, prompts, stop) -> tuple[list[list[int]], list[list[int]], object]:
    """Each prompt alone (batch 1), then all of them as one batch, through ``dec``."""
    alone = [dec.generate(p, stop()).tokens for p in prompts]
    batch = BatchDecoder(dec, len(prompts)).generate(prompts, [stop() for _ in prompts])
    return alone, [r.tokens for r in batch.rows], batch


@pytest.mark.parametrize("combo", _covering(COMBOS))
def test_each_row_of_a_batch_equals_its_batch_1_output(deep_adapters, combo):
    adapter = deep_adapters["llama"]
    dec = _decoder(adapter, combo, "llama")
    alone, rows, batch = _alone_then_batched(dec, _prompts(), lambda: StopCondition(MAX_NEW))
    assert rows == alone, f"{combo}: a row of the batch differs from its prompt decoded alone"
    vanilla = [VanillaDecoder(adapter).generate(p, StopCondition(MAX_NEW)).tokens for p in _prompts()]
    assert rows == vanilla
    if REGISTRIES["selector"].get(combo[0]).shares_plan:  # the rows' drafts run as one forward
        assert batch.forwards < batch.row_forwards, "no forward held two rows"


def test_vanilla_batched_equals_vanilla_alone_and_merges_every_step(deep_adapters):
    adapter = deep_adapters["qwen2"]
    van = VanillaDecoder(adapter)
    alone, rows, batch = _alone_then_batched(van, _prompts(), lambda: StopCondition(MAX_NEW))
    assert rows == alone
    # three prefills alone, then one forward per step for the three rows
    assert batch.forwards == len(PROMPTS) + MAX_NEW - 1
    assert batch.row_forwards == len(PROMPTS) * MAX_NEW


def test_rows_that_finish_early_leave_the_forwards(deep_adapters):
    adapter = deep_adapters["llama"]
    van = VanillaDecoder(adapter)
    budgets = (4, 12, 8)
    batch = BatchDecoder(van, 3).generate(_prompts(), [StopCondition(n) for n in budgets])
    assert [r.new_tokens for r in batch.rows] == list(budgets)
    assert batch.row_forwards == sum(budgets)  # a finished row costs nothing
    assert batch.finished_rows == "leave"
    # once row 0 has left, rows 1 and 2 run as one forward from row 1 of the buffers
    assert [r.tokens for r in batch.rows] == [
        van.generate(p, StopCondition(n)).tokens for p, n in zip(_prompts(), budgets, strict=False)
    ]


@pytest.mark.parametrize("kernels_on", [False, True], ids=["modules", "fused"])
def test_rows_around_a_finished_row_still_run_as_one_forward(deep_adapters, kernel_adapter, kernels_on):
    adapter = kernel_adapter if kernels_on else deep_adapters["llama"]
    van = VanillaDecoder(adapter)
    budgets = (8, 3, 8)
    batch = BatchDecoder(van, 3).generate(_prompts(), [StopCondition(n) for n in budgets])
    assert [r.tokens for r in batch.rows] == [
        van.generate(p, StopCondition(n)).tokens for p, n in zip(_prompts(), budgets, strict=True)
    ]
    assert batch.forwards == 3 + 7  # three prefills, then one forward per step for the rows left


def test_a_rounds_verification_is_one_forward_for_the_batch(deep_adapters):
    """Rows that stop drafting early wait for the others: one verification per round."""
    adapter = deep_adapters["llama"]
    dec = _decoder(adapter, ("static", "confidence", "layer_skip", "greedy"), "llama")
    batch = BatchDecoder(dec, 3).generate(_prompts(), [StopCondition(MAX_NEW)] * 3)
    lengths = [r.draft_lengths for r in batch.rows]
    assert any(len({row[i] for row in lengths if i < len(row)}) > 1 for i in range(max(map(len, lengths))))
    assert batch.verifications == max(len(r.rounds) for r in batch.rows)


def test_processors_and_a_grammar_keep_one_state_per_row(deep_adapters):
    adapter = deep_adapters["mistral"]
    dec = _decoder(adapter, ("static", "confidence", "layer_skip", "greedy"), "mistral")

    def stop() -> StopCondition:
        return StopCondition(
            MAX_NEW, controls=GenerationControls(repetition_penalty=1.5, no_repeat_ngram_size=2)
        )

    alone, rows, _ = _alone_then_batched(dec, _prompts(), stop)
    assert rows == alone
    plain = [dec.generate(p, StopCondition(MAX_NEW)).tokens for p in _prompts()]
    assert alone != plain, "the processors did not change the output: the test does not bite"


def _char_grammar(regex: str, vocab_size: int):
    pytest.importorskip("llguidance")
    from framework.testing import char_regex_grammar

    return char_regex_grammar(regex, "abxy0123456789", vocab_size)


@pytest.mark.parametrize("drafter", ["grammar_forced", "layer_skip"])
def test_a_grammar_holds_per_row(deep_adapters, drafter):
    grammar = _char_grammar("(x|y[0-3])ab[0-8]+", 128)
    adapter = deep_adapters["llama"]
    dec = _decoder(adapter, ("static", "confidence", drafter, "greedy"), "llama")

    def stop() -> StopCondition:
        return StopCondition(MAX_NEW, controls=GenerationControls(grammar=grammar))

    alone, rows, _ = _alone_then_batched(dec, _prompts(), stop)
    assert rows == alone
    assert all(row[0] in (3 + 2, 3 + 3) for row in rows)  # "x" or "y": the grammar bites


@pytest.fixture(scope="module")
def kernel_adapter():
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason}")
    adapter = adapter_for(tiny_model("llama", num_layers=6, seed=1, dtype=torch.float32), fast_kernels=True)
    assert adapter.fused is not None
    return adapter


@pytest.mark.parametrize(
    "combo",
    [
        ("static", "confidence", "layer_skip", "greedy"),
        ("static", "fixed", "early_exit", "greedy"),
        ("static", "finite_state", "prompt_lookup", "greedy"),
        ("selfsd_bo", "adaptive_confidence", "hybrid", "tree"),
    ],
    ids="-".join,
)
def test_float32_rows_through_the_fused_kernels_equal_batch_1(kernel_adapter, combo):
    """The CPU fast path: the fused attention runs a row at a time, the MLP and the LM head every
    row's tokens at once (in blocks of 64): a row's logits are its batch-1 logits, bit for bit."""
    dec = _decoder(kernel_adapter, combo, "kernels")
    alone, rows, batch = _alone_then_batched(dec, _prompts(), lambda: StopCondition(MAX_NEW))
    assert rows == alone
    vanilla = [VanillaDecoder(kernel_adapter).generate(p, StopCondition(MAX_NEW)).tokens for p in _prompts()]
    assert rows == vanilla


def test_more_than_64_tokens_in_a_merged_forward_keep_each_row_exact(kernel_adapter):
    """Eight rows verifying nine tokens each: 72 rows of the MLP and the LM head, in two blocks."""
    from strategies.length.fixed import FixedLength, FixedLengthConfig

    s = {
        k: default_strategy_instance(k, n)
        for k, n in zip(KINDS, ("static", "fixed", "layer_skip", "greedy"), strict=False)
    }
    s["length"] = FixedLength(FixedLengthConfig(k=8))
    dec = SpeculativeDecoder(kernel_adapter, s["selector"], s["length"], s["drafter"], s["verifier"])
    prompts = [random_prompt(3 + r, 128, 10 + r) for r in range(8)]
    alone = [dec.generate(p, StopCondition(MAX_NEW)).tokens for p in prompts]
    batch = BatchDecoder(dec, 8).generate(prompts, [StopCondition(MAX_NEW) for _ in prompts])
    assert [r.tokens for r in batch.rows] == alone


def test_bfloat16_exact_rows_equal_batch_1():
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason}")
    adapter = adapter_for(tiny_model("llama", num_layers=6, seed=1, dtype=torch.bfloat16))
    adapter.set_exact(True)
    dec = _decoder(adapter, ("static", "confidence", "layer_skip", "greedy"), "bf16-exact")
    alone, rows, _ = _alone_then_batched(dec, _prompts(), lambda: StopCondition(MAX_NEW))
    assert rows == alone
    van = VanillaDecoder(adapter)
    assert [
        r.tokens for r in BatchDecoder(van, 3).generate(_prompts(), [StopCondition(MAX_NEW)] * 3).rows
    ] == [van.generate(p, StopCondition(MAX_NEW)).tokens for p in _prompts()]


def test_sampling_rows_draw_from_their_own_streams(deep_adapters):
    """Row r of a batch samples exactly what a batch-1 run seeded ``seed + r`` samples: each row
    keeps batch 1's law (tested exact in `tests/strategies/verifiers/test_sampling.py`), and no two
    rows share draws."""
    from strategies.verifiers.sampling import SamplingVerifier, SamplingVerifierConfig

    adapter = deep_adapters["llama"]
    prompts = [random_prompt(5, 128, 7)] * 2  # the same prompt twice: only the streams differ

    def decoder(seed: int) -> SpeculativeDecoder:
        s = {
            k: default_strategy_instance(k, n)
            for k, n in zip(KINDS[:3], ("static", "confidence", "layer_skip"), strict=False)
        }
        verifier = SamplingVerifier(SamplingVerifierConfig(temperature=1.0, seed=seed))
        return SpeculativeDecoder(adapter, s["selector"], s["length"], s["drafter"], verifier)

    batch = BatchDecoder(decoder(11), 2).generate(prompts, [StopCondition(MAX_NEW)] * 2)
    rows = [r.tokens for r in batch.rows]
    assert rows[0] == decoder(11).generate(prompts[0], StopCondition(MAX_NEW)).tokens
    assert rows[1] == decoder(12).generate(prompts[1], StopCondition(MAX_NEW)).tokens
    assert rows[0] != rows[1]


def test_the_cache_after_every_commit_holds_each_rows_committed_kv(deep_adapters, monkeypatch):
    adapter = deep_adapters["qwen2"]
    dec = _decoder(adapter, ("static", "confidence", "layer_skip", "greedy"), "qwen2")
    checked: list[int] = []
    commit = DecodeState.commit

    def checked_commit(state, result):
        out = commit(state, result)
        cache = state.cache
        assert isinstance(cache, RowCache)
        ids = state.tokens[:, :-1]  # every committed token but pending (its KV is not written yet)
        assert cache.committed == ids.shape[1]
        fresh = adapter.arch.new_cache(ids.shape[1] + 1)
        adapter.executor.forward(ids, torch.arange(ids.shape[1])[None], fresh, logits_at=None)
        for layer in range(cache.num_layers):
            k, v = cache.committed_kv(layer)
            fk, fv = fresh.committed_kv(layer) if fresh.committed else (None, None)
            want_k = fresh._k_layers[layer][:, :, : ids.shape[1]]
            want_v = fresh._v_layers[layer][:, :, : ids.shape[1]]
            torch.testing.assert_close(k, want_k, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(v, want_v, atol=1e-6, rtol=1e-6)
        # and the row's KV sits in its own row of the batch's buffers
        assert cache.keys.data_ptr() == cache.batch.keys[:, cache.row].data_ptr()
        checked.append(cache.row)
        return out

    monkeypatch.setattr(DecodeState, "commit", checked_commit)
    BatchDecoder(dec, 3).generate(_prompts(), [StopCondition(MAX_NEW)] * 3)
    assert sorted(set(checked)) == [0, 1, 2]


def test_a_batch_refuses_what_it_cannot_hold(deep_adapters):
    van = VanillaDecoder(deep_adapters["llama"])
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        BatchDecoder(van, 0)
    with pytest.raises(ValueError, match="a batch holds 1 to 2 prompts, got 3"):
        BatchDecoder(van, 2).generate(_prompts(), [StopCondition(4)] * 3)
    with pytest.raises(ValueError, match="one stop condition per prompt"):
        BatchDecoder(van, 3).generate(_prompts(), [StopCondition(4)] * 2)


def test_a_rows_error_reaches_the_caller_after_every_row_stopped(deep_adapters):
    adapter = deep_adapters["llama"]
    lockstep = Lockstep(adapter.executor, BatchCache(6, 2, 2, 8, 16, torch.float64, "cpu"))

    def fails() -> None:
        raise RuntimeError("row 1 broke")

    with pytest.raises(RuntimeError, match="row 1 broke"):
        lockstep.run([lambda: 1, fails])


def test_sharing_selectors_say_so():
    assert REGISTRIES["selector"].get("static").shares_plan
    assert REGISTRIES["selector"].get("selfsd_bo").shares_plan
    for name in ("swift", "clasp_dp", "del_tpl"):
        assert not REGISTRIES["selector"].get(name).shares_plan


def test_each_rows_own_reduced_draft_head_and_int8_drafts_keep_it_exact(kernel_adapter):
    """The presets' drafts: int8 weights and a reduced head that grows with each row's context (a
    head per row: the rows' blocks run as one forward, each row's logits through its own head)."""
    from framework.config_fields import build_config

    s = {
        k: default_strategy_instance(k, n)
        for k, n in zip(KINDS, ("static", "confidence", "layer_skip", "greedy"), strict=False)
    }
    entry = REGISTRIES["drafter"].entry("layer_skip")
    s["drafter"] = entry.cls(build_config(entry.config, {"draft_vocab": 32, "draft_weights": "int8"}))
    dec = SpeculativeDecoder(kernel_adapter, s["selector"], s["length"], s["drafter"], s["verifier"])
    dec.prepare(
        prepare_context(kernel_adapter, prepared=_prepared.setdefault("kernels-head-int8", PreparedCache()))
    )
    alone, rows, batch = _alone_then_batched(dec, _prompts(), lambda: StopCondition(MAX_NEW))
    assert rows == alone
    assert batch.forwards < batch.row_forwards


def test_a_merged_verification_of_72_rows_gives_each_row_its_batch_1_logits_bit_for_bit(kernel_adapter):
    """Eight rows of nine tokens through the merged path against each row's own forward: the
    logits are equal, not close (the MLP and the LM head run in blocks of at most 64 rows)."""
    from framework.engine.batch.merge import ForwardRequest, run_alone, run_merged

    a = kernel_adapter.arch
    ids = torch.randint(0, 128, (8, 30), generator=torch.Generator().manual_seed(3))

    def fresh_rows() -> BatchCache:
        cache = BatchCache(a.num_layers, 8, a.num_kv_heads, a.head_dim, 40, torch.float32, "cpu")
        for r, row in enumerate(cache.rows):
            n = 10 + r  # ragged
            run_alone(
                kernel_adapter.executor,
                ForwardRequest(r, True, ids[r : r + 1, :n], torch.arange(n)[None], row, None, {}),
            )
            row.commit(n)
        return cache

    def requests(cache: BatchCache) -> list[ForwardRequest]:
        return [
            ForwardRequest(r, True, ids[r : r + 1, 10 + r : 19 + r], torch.arange(10 + r, 19 + r)[None], row, None, {"base": 10 + r})
            for r, row in enumerate(cache.rows)
        ]  # fmt: skip

    with torch.inference_mode():
        cache = fresh_rows()
        merged = run_merged(kernel_adapter.executor, cache, requests(cache))
        alone = [run_alone(kernel_adapter.executor, q) for q in requests(fresh_rows())]
    for r in range(8):
        assert torch.equal(merged[r].logits, alone[r].logits), f"row {r}'s logits differ"
