"""run.py's and bench.py's reports say each speculative method's host work a round, counted in
its first warm-up decode, and name the strategy's own line (issue 55, item 2)."""

from __future__ import annotations

import importlib.util
import json

from framework.interfaces import REGISTRIES
from framework.runner.pipeline import run
from tests.framework.runner.test_lightning import cfg_for

AUTHOR = """
from dataclasses import dataclass

import torch

from framework import LayerPlan, LayerSelector, register_selector


@register_selector("zz_author_reads")
class AuthorReads(LayerSelector):
    @dataclass(frozen=True)
    class Config:
        pass

    def plan(self, state):
        n = state.info.num_layers
        skip = torch.arange(1, n - 1, 2).tolist()  # READ
        return LayerPlan.from_indices(n, attn=skip, mlp=skip)
"""


def test_run_reports_a_selector_in_the_authors_folder_at_its_own_line(tiny, data, tmp_path):
    path = tmp_path / "research" / "author_reads.py"
    path.parent.mkdir()
    path.write_text(AUTHOR)
    line = next(i for i, text in enumerate(AUTHOR.splitlines(), 1) if "# READ" in text)
    spec = importlib.util.spec_from_file_location("author_reads_elsewhere", path)
    module = importlib.util.module_from_spec(spec)
    model, tok = tiny
    try:
        spec.loader.exec_module(module)
        cfg = cfg_for(data, tmp_path / "out", selector="zz_author_reads", limit=1, warmup=1)
        res = run(cfg, log=lambda s: None, model=model, tokenizer=tok)
    finally:
        REGISTRIES["selector"].unregister("zz_author_reads")
    site = f"{path.resolve()}:{line}"
    said = next(
        x for x in res["report"].splitlines() if x.startswith("- host work (counted in the first warm-up")
    )
    assert "zz_author_reads+fixed: " in said and "operations and" in said and "host reads a round" in said
    assert f"most at {site} (" in said and "a round)" in said, said
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert site in [x["site"] for x in meta["host_work"]["zz_author_reads+fixed"]["sites"]]


def test_bench_reports_every_speculative_methods_host_work(tiny, data, tmp_path):
    from framework.session.run_config import RunConfig

    model, tok = tiny
    cfg = RunConfig.of(methods=("vanilla", "static_confidence", "hybrid"), data=str(data), limit=1,
                       categories="qa", max_new_tokens=6, output=str(tmp_path / "b"), cost_model="none",
                       plots=False, dtype="float64", logger="none")  # fmt: skip
    res = run(cfg, model=model, tokenizer=tok, log=lambda s: None)
    lines = [
        x for x in res["report"].splitlines() if x.startswith("- host work (counted in the first warm-up")
    ]
    assert [x.split(": ")[1] for x in lines] == ["static_confidence", "hybrid"]  # not vanilla: no rounds
    for x in lines:  # within the limits, the strategies' own lines are named all the same
        assert ": within the limits; most at strategies/" in x, x
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert set(meta["host_work"]) == {"static_confidence", "hybrid"}
    assert all(h["rounds"] > 0 and h["ops"] >= 0 for h in meta["host_work"].values())


def test_a_skip_ratio_that_skips_nothing_is_said(tiny, data, tmp_path):
    """Issue 55, item 5: a smoke run whose skip ratio rounds to zero skipped sub-layers drafts with
    the full model (alpha 1 by construction); the run says so, and a run that skips does not."""
    from framework.runner.pipeline import full_model_drafts

    model, tok = tiny
    said: list[str] = []
    cfg = cfg_for(data, tmp_path / "none", limit=1, **{"selector.skip_ratio": 0.01})
    res = run(cfg, log=said.append, model=model, tokenizer=tok)
    assert "its drafts skipped no sub-layer in any round" in res["report"]
    assert any(x.startswith("note: static+fixed: its drafts skipped no sub-layer") for x in said)
    skips = run(cfg_for(data, tmp_path / "some", limit=1), log=lambda s: None, model=model, tokenizer=tok)
    assert "skipped no sub-layer" not in skips["report"]
    assert full_model_drafts(skips["records"], ["vanilla", "static+fixed"]) == {}
