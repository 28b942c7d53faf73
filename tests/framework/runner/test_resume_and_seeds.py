"""What a long run relies on between its pieces (issue 54, class 4): resuming a results file that
a kill left with a prompt only some methods recorded, resuming with repeats, ``--seed`` reaching
every random stream a run draws from, and the split of the prompts over ranks."""

from __future__ import annotations

import json
import random
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from framework.results.records import read_records
from framework.runner.lightning import DecodeModule
from framework.runner.pipeline import run
from framework.session.methods import specs as methods_of
from framework.session.run_config import RunConfig
from framework.session.session import Session
from tests.framework.runner.test_lightning import cfg_for


def _cfg(data, out, **kw):
    """`test_lightning.cfg_for` (static at 0.3, fixed k = 3, 8 new tokens, no warm-up)."""
    return cfg_for(data, out, **kw)


def _counts(records):
    return Counter((r.get("repeat", 0), r["question_id"], r["method"]) for r in records)


def _interrupt_at(monkeypatch, question_id, after=0):
    """Make decoding raise KeyboardInterrupt at ``question_id``, once it was decoded ``after``
    times (each method's decode of each repeat counts)."""
    real = Session.decode_prompt
    seen = Counter()

    def decode(self, decoder, prompt, max_new_tokens=None):
        if prompt.question_id == question_id:
            seen[question_id] += 1
            if seen[question_id] > after:
                raise KeyboardInterrupt
        return real(self, decoder, prompt, max_new_tokens)

    monkeypatch.setattr(Session, "decode_prompt", decode)
    return real


def test_a_prompt_only_some_methods_recorded_is_decoded_again_and_counted_once(
    tiny, data, tmp_path, monkeypatch
):
    """A kill in the middle of a prompt's write leaves its first method's record whole and the
    next one torn: the resumed run decodes that prompt again with every method, and the file and
    the table hold every (prompt, method) once."""
    model, tok = tiny
    out = tmp_path / "r"
    real = _interrupt_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(data, out), log=lambda s: None, model=model, tokenizer=tok)
    monkeypatch.setattr(Session, "decode_prompt", real)
    first = [r for r in read_records(out) if r["question_id"] == 2]
    assert [r["method"] for r in first] == ["vanilla", "static+fixed"]
    vanilla_q3 = {**first[0], "question_id": 3, "category": "rag"}  # whole
    with (out / "records.jsonl").open("a") as fh:  # the prompt's one write, cut after its first record
        fh.write(json.dumps(vanilla_q3) + "\n" + '{"question_id": 3, "method": "stat')
    lines: list[str] = []
    res = run(_cfg(data, out, resume=True), log=lines.append, model=model, tokenizer=tok)
    counts = _counts(read_records(out))
    assert counts == Counter({(0, q, m): 1 for q in range(1, 6) for m in ("vanilla", "static+fixed")}), counts
    assert any("--resume: 2 of 5 prompts already in" in s for s in lines), lines
    assert _whole(res, 5)


def test_resume_with_repeats_decodes_each_repeat_of_each_prompt_once(tiny, data, tmp_path, monkeypatch):
    """``--repeats 2`` killed in the second repeat: the resumed run decodes the rest of the second
    repeat only, and the file holds each (repeat, prompt, method) once."""
    model, tok = tiny
    out = tmp_path / "r"
    real = _interrupt_at(
        monkeypatch, 2, after=2
    )  # q2's first repeat (2 methods) passes, its second is killed
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(data, out, repeats=2), log=lambda s: None, model=model, tokenizer=tok)
    before = _counts(read_records(out))
    assert {r for r, _, _ in before} == {0, 1} and all(n == 1 for n in before.values())
    assert len(before) < 2 * 5 * 2
    monkeypatch.setattr(Session, "decode_prompt", real)
    lines: list[str] = []
    run(_cfg(data, out, repeats=2, resume=True), log=lines.append, model=model, tokenizer=tok)
    done = len(before) // 2
    assert any(f"--resume: {done} of 10 prompts already in" in s for s in lines), lines
    counts = _counts(read_records(out))
    want = {(r, q, m): 1 for r in (0, 1) for q in range(1, 6) for m in ("vanilla", "static+fixed")}
    assert counts == Counter(want), counts


# ---- --seed ---------------------------------------------------------------------------------
def _sampled(tiny, data, tmp_path, name, **kw):
    """The tokens of every record of a one-prompt run (``name``: the output file's stem)."""
    model, tok = tiny
    out = tmp_path / name
    run(_cfg(data, out, limit=1, categories="qa", **kw), log=lambda s: None, model=model, tokenizer=tok)
    return {r["method"]: [t["tokens"] for t in r["turns"]] for r in read_records(out)}


SAMPLING = {"verifier": "sampling", "verifier.temperature": 1.0}


@pytest.mark.parametrize(
    "method",
    [
        pytest.param(SAMPLING, id="sampling-verifier"),
        pytest.param({"synthetic_acceptance": 0.5}, id="synthetic-acceptance"),
        pytest.param({"selector": "swift", "max_new_tokens": 40}, id="swift-search"),
    ],
)
def test_the_same_seed_repeats_a_run_and_another_seed_reaches_its_stream(tiny, data, tmp_path, method):
    """Each random stream a run draws from (a sampling verifier's, the synthetic acceptance's, a
    selector's search) repeats with the same ``--seed`` and changes with another."""
    a = _sampled(tiny, data, tmp_path, "a", seed=3, **method)
    b = _sampled(tiny, data, tmp_path, "b", seed=3, **method)
    assert a == b
    label = next(m for m in a if m != "vanilla")
    others = [_sampled(tiny, data, tmp_path, f"c{s}", seed=s, **method)[label] for s in (4, 5, 6)]
    if "synthetic_acceptance" in method or "verifier" in method:  # the output itself is drawn
        assert any(o != a[label] for o in others), f"--seed does not reach {label}'s random stream"
    else:  # a search's draws decide its skip sets, never the output
        assert all(o == a["vanilla"] for o in others)


def test_the_seed_reaches_every_random_stream_a_strategy_keeps():
    """``--seed S`` offsets the seed of every strategy that keeps a random stream of its own (a
    sampling verifier's, SWIFT's and Self-SD's searches); ``--seed 0`` leaves each at its own
    default (the papers' code values), so a run at the default seed is what it was."""
    from framework.session.session import build_strategies

    def seeds(cfg):
        parts = build_strategies(cfg)
        return {k: getattr(s.config, "seed", None) for k, s in parts.items()}

    for selector in ("swift", "selfsd_bo"):
        base = RunConfig.of(selector=selector, verifier="sampling")
        plain = seeds(base)
        assert plain["selector"] == base.method.selector.build("selector").config.seed
        assert plain["verifier"] == 0
        moved = seeds(base.replace(seed=7))
        assert moved["selector"] == plain["selector"] + 7 and moved["verifier"] == plain["verifier"] + 7
        assert moved["selector"] != plain["selector"]


def test_the_pipeline_seeds_python_numpy_and_torch_from_the_seed(tiny, data, tmp_path, monkeypatch):
    """Before anything is decoded, every global generator a strategy might use is seeded from
    ``--seed``: two runs with one seed see the same first draws, another seed other ones."""
    draws = []
    real = Session.decode_prompt

    def first_draw(self, decoder, prompt, max_new_tokens=None):
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(1))))
        return real(self, decoder, prompt, max_new_tokens)

    monkeypatch.setattr(Session, "decode_prompt", first_draw)
    model, tok = tiny
    for i, seed in enumerate((11, 11, 12)):
        run(
            _cfg(data, tmp_path / f"s{i}", limit=1, seed=seed),
            log=lambda s: None,
            model=model,
            tokenizer=tok,
        )
        draws[i:] = draws[i : i + 1]  # the first draw of each run
    assert draws[0] == draws[1] and all(a != b for a, b in zip(draws[0], draws[2], strict=True))


# ---- the prompt split over ranks ---------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("repeats", [1, 2])
def test_the_prompts_split_over_ranks_once_each_with_a_remainder(data, tmp_path, world, repeats):
    """7 prompts (x repeats) over 2 and 3 ranks: every item on exactly one rank, in order, the
    shards' sizes differing by at most one (the remainder on the first ranks)."""
    from framework.data.prompts import load_prompts

    rows = [{"question_id": i, "category": "qa", "turns": [f"w{i}"]} for i in range(1, 8)]
    path = tmp_path / "seven.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = _cfg(path, tmp_path / "r")
    items = [(r, p) for r in range(repeats) for p in load_prompts(path)]
    shards = []
    for rank in range(world):
        module = DecodeModule(cfg, methods_of(cfg), items, lambda _label: tmp_path / "r", lambda s: None)
        module.trainer = SimpleNamespace(world_size=world, global_rank=rank, num_nodes=1)
        shards.append([(r, p.question_id) for r, p in module.shard()])
    flat = [x for shard in shards for x in shard]
    assert sorted(flat) == sorted((r, p.question_id) for r, p in items) and len(flat) == len(items)
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    order = [(r, p.question_id) for r, p in items]
    assert all(s == sorted(s, key=order.index) for s in shards)


def _whole(res, prompts: int) -> bool:
    """The report covers every prompt of the folder, each method's output lossless."""
    methods = res["summary"]["methods"]
    return (
        all(e["prompts"] == prompts for e in methods.values()) and not methods["static+fixed"]["mismatches"]
    )
