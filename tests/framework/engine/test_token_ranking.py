"""framework/engine/token_ranking.py: how the vocabulary is ranked, saved, loaded, cached per model
and turned into a draft head."""

from __future__ import annotations

import json

import pytest

from framework.engine import token_ranking as tr
from framework.engine.adapter import adapter_for
from framework.engine.token_ranking import TokenRanking, draft_head_for, model_ranking
from framework.testing import prepare_context, tiny_model


@pytest.fixture(scope="module")
def adapter():
    return adapter_for(tiny_model("llama", num_layers=4, seed=5))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    return tmp_path


def test_from_counts_order():
    r = TokenRanking.from_counts({5: 3, 2: 3, 7: 9, 1: 0}, 10, always=[9, 9, 4])
    # always first (in order, deduplicated), then by count (ties by id), then the rest by id
    assert r.order == (9, 4, 7, 2, 5, 0, 1, 3, 6, 8)
    assert r.counts == {5: 3, 2: 3, 7: 9}
    assert r.top(3) == [9, 4, 7] and r.top(100) == list(r.order)
    assert r.coverage([7, 2, 0], 4) == pytest.approx(2 / 3)
    assert r.coverage([], 4) == 0.0


def test_from_counts_rejects_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TokenRanking.from_counts({10: 1}, 10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TokenRanking.from_counts({}, 10, always=[-1])


def test_save_load_round_trip(tmp_path):
    r = TokenRanking.from_counts({3: 2, 1: 1}, 6, always=[5], source="unit", fingerprint="abc")
    back = TokenRanking.load(r.save(tmp_path / "r.json"), 6)
    assert back == r


def test_load_a_list_of_ids_and_a_text_file(tmp_path):
    (tmp_path / "l.json").write_text(json.dumps([4, 2, 4]))
    assert TokenRanking.load(tmp_path / "l.json", 6).order == (4, 2, 0, 1, 3, 5)
    (tmp_path / "l.txt").write_text("3\n1\n")
    assert TokenRanking.load(tmp_path / "l.txt", 6).order == (3, 1, 0, 2, 4, 5)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("not ids at all", "neither JSON nor one token id per line"),
        ('{"format": "other"}', "is not a selfspec-token-ranking/1 file"),
        ('{"a": [1, 2]}', "is not a selfspec-token-ranking/1 file"),
        ('["a", "b"]', "must hold a list of token ids"),
        ("[1, 99]", "outside the vocabulary"),
    ],
)
def test_load_rejects_bad_files(tmp_path, content, match):
    (tmp_path / "bad").write_text(content)
    with pytest.raises(ValueError, match=match) as err:
        TokenRanking.load(tmp_path / "bad", 6)
    assert "bad" in str(err.value)


def test_load_rejects_another_vocabulary_and_a_missing_file(tmp_path):
    p = TokenRanking.from_counts({}, 6).save(tmp_path / "r.json")
    with pytest.raises(ValueError, match="vocabulary of 6 tokens, the model has 7"):
        TokenRanking.load(p, 7)
    with pytest.raises(ValueError, match="cannot be read"):
        TokenRanking.load(tmp_path / "missing.json", 6)


def test_model_ranking_is_built_once_then_read_from_the_cache(adapter, cache, monkeypatch):
    ctx = prepare_context(adapter)
    r = model_ranking(ctx)
    assert r.fingerprint == adapter.arch.fingerprint() and sum(r.counts.values()) > 0
    assert sorted(r.order) == list(range(adapter.arch.info().vocab_size))
    assert tr.ranking_path(adapter).exists()

    def fail(*a, **k):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(tr, "build_ranking", fail)
    assert model_ranking(prepare_context(adapter)) == r  # a fresh context reads the file
    # another model's file under this name is not used: it is rebuilt
    data = json.loads(tr.ranking_path(adapter).read_text())
    data["fingerprint"] = "someone-else"
    tr.ranking_path(adapter).write_text(json.dumps(data))
    with pytest.raises(AssertionError, match="rebuilt"):
        model_ranking(prepare_context(adapter))


def test_the_counts_are_the_models_own_tokens(adapter, cache):
    ctx = prepare_context(adapter)
    seqs = tr.corpus_sequences(ctx, new_tokens=8)
    assert len(seqs) == len(ctx.calibration_prompts())
    counts = tr.count_tokens(seqs)
    r = tr.build_ranking(ctx, new_tokens=8)
    top = r.order[: len(counts)]
    assert set(top) == set(counts)  # every counted token ranks above every uncounted one


def test_draft_head_for_is_memoised_and_reads_a_file(adapter, cache, tmp_path):
    ctx = prepare_context(adapter)
    h = draft_head_for(ctx, 32)
    assert draft_head_for(ctx, 32) is h and h.size == 32 and h.context
    assert draft_head_for(ctx, 32, context=False) is not h
    (tmp_path / "ids.json").write_text(json.dumps(list(range(100, 128))))
    hf = draft_head_for(ctx, 20, str(tmp_path / "ids.json"), context=False)
    assert hf.ids.tolist() == list(range(100, 120))
    with pytest.raises(ValueError, match="between 2 and V = 128"):
        draft_head_for(ctx, 1000)
