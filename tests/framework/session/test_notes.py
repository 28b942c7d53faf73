"""framework/session/notes.py: a run says up front, and keeps in its metadata, what it cannot do as
configured - SWIFT's search never starting in a short run, a paper's selector used as a building
block with this framework's defaults, a paper preset with overridden settings (issue 29)."""

from __future__ import annotations

import json

import pytest

from framework.runner.cli import bench_main, list_strategies
from framework.runner.cli import main as run_main
from framework.session.notes import PAPER_PRESETS, differences, published_by, published_notes, run_notes
from framework.session.presets import list_presets
from framework.session.run_config import RunConfig
from strategies.selectors.swift import SwiftConfig, SwiftSelector


def test_swift_says_when_its_search_can_never_start():
    sel = SwiftSelector(SwiftConfig(context_window=32))
    (note,) = sel.run_notes(33)
    assert "never optimises" in note and "new token 34" in note and "max_new_tokens is 33" in note
    assert sel.run_notes(34) == []
    assert SwiftSelector(SwiftConfig(context_window=8)).run_notes(16) == []


def test_a_paper_selector_as_a_building_block_names_its_differences_from_the_paper():
    cfg = RunConfig.of(selector="clasp_dp")
    (note,) = published_notes(cfg.method)
    assert "--selector clasp_dp is a building block" in note and "--method clasp" in note
    assert "--length.threshold 0.6 (published: 0.7)" in note
    assert published_notes(RunConfig.from_preset("clasp").method) == []  # as published: silent
    overridden = RunConfig.from_preset("clasp", **{"length.threshold": 0.6}).method
    (note,) = published_notes(overridden)
    assert note.startswith("clasp is not CLaSp (Chen et al., 2025) as published")
    assert published_notes(RunConfig.of().method) == []  # the generic static selector: nothing to say
    gated = RunConfig.from_preset("swift", **{"gate.enabled": True}).method
    assert "--gate.enabled True (published: False)" in differences(
        gated, RunConfig.from_preset("swift").method
    )


def test_run_notes_collects_the_strategies_and_the_paper_notes():
    cfg = RunConfig.from_preset("swift", max_new_tokens=16)
    strategies = {"selector": SwiftSelector(cfg.method.selector.config)}
    notes = run_notes(cfg, strategies)
    assert len(notes) == 1 and "never optimises" in notes[0]


def test_list_marks_the_paper_presets_and_the_building_blocks():
    text = list_strategies(verbose=False)
    presets = text[text.index("presets (--method") :]
    for preset in list_presets():
        line = next(x for x in presets.splitlines() if x.strip().startswith(preset + " "))
        assert ("[paper]" in line) == (preset in PAPER_PRESETS), line
    assert published_by("selector") == {
        "selfsd_bo": "selfsd",
        "swift": "swift",
        "clasp_dp": "clasp",
        "del_tpl": "del",
    }
    assert "confidence" not in published_by("length") and "greedy" not in published_by("verifier")
    assert "(a building block with this framework's defaults; as published: --method clasp)" in text


def test_the_notes_are_said_and_kept_in_the_run_and_the_benchmark(tmp_path, capsys):
    common = ["--model", "tiny-random", "--limit", "1", "--categories", "qa", "--max-new-tokens", "8"]
    out = tmp_path / "r"
    assert (
        run_main([*common, "--logger", "none", "--method", "swift", "--warmup", "0", "--output", str(out)])
        == 0
    )
    said = capsys.readouterr().out
    assert "note: swift never optimises in this run" in said
    meta = json.loads((out / "meta.json").read_text())
    assert list(meta["notes"]) == ["swift"] and "never optimises" in meta["notes"]["swift"][0]
    assert "- **swift**, as configured: swift never optimises" in (out / "bench.md").read_text()
    assert (
        bench_main([*common, "--methods", "vanilla,swift", "--no-plots", "--out", str(tmp_path / "b")]) == 0
    )
    report = (tmp_path / "b" / "bench.md").read_text()
    assert "- **swift**, as configured: swift never optimises" in report
    assert "never optimises" in json.loads((tmp_path / "b" / "meta.json").read_text())["notes"]["swift"][0]


@pytest.mark.parametrize("preset", PAPER_PRESETS)
def test_every_paper_preset_is_silent_as_published(preset):
    assert published_notes(RunConfig.from_preset(preset).method) == []
