"""experiments/claims: the registry of the seed papers' claims, the entry point, and the pure helpers
(statistics, verdicts, the pricing of counted rounds, the output) - offline, no real model.

The whole run on a tiny random model (`--smoke`) is `tests/test_docs.py::test_reproduction_script_smoke_mode`.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from experiments import claims
from experiments.claims import clasp, common, del_, measure, selfsd, shared, swift
from framework import LayerPlan
from framework.testing import synthetic_cost_model

ROOT = Path(__file__).resolve().parents[2]

PAPER_MODULES = {selfsd: "sd_", swift: "sw_", clasp: "cl_", del_: "de_"}


# ---- the claims registry -------------------------------------------------------------------


def test_claim_ids_are_unique_and_every_module_contributes():
    ids = [c.id for c in claims.CLAIMS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for mod, prefix in PAPER_MODULES.items():
        assert mod.CLAIMS, mod.__name__
        assert all(c.id.startswith(prefix) for c in mod.CLAIMS), [c.id for c in mod.CLAIMS]
    assert {c.id for c in shared.CLAIMS} == {"sd_sampling", "lossless", "both_draft_share", "overheads"}
    assert all(c.paper == common.BOTH for c in shared.CLAIMS)
    together = [c for mod in (selfsd, shared, swift, clasp, del_) for c in mod.CLAIMS]
    assert claims.CLAIMS == together
    assert len(ids) == 39


def test_every_claim_runs_or_says_why_not():
    for c in claims.CLAIMS:
        assert c.says and c.ref and c.paper
        assert c.run is not None or c.untestable, c.id
        assert c.ref.startswith((common.R1, common.R2)), c.id
        assert c.kind in ("claim", "check"), c.id
        # a verdict needs a rule written next to the claim, and the code that implements it
        assert (c.decide is not None) == bool(c.rule), c.id
        if c.run is not None and c.decide is None:
            assert c.untestable, c.id  # measured for context only: says why no verdict
        if c.kind == "check":
            assert c.decide is not None and c.test, c.id


def test_algebra_checks_are_not_claims():
    """The checks of this implementation's algebra and exactness are reported apart, never tallied."""
    checks = {c.id for c in claims.CLAIMS if c.kind == "check"}
    assert checks == {
        "de_tpl",
        "de_off_by_one",
        "de_vanilla_etpl",
        "de_free",
        "lossless",
        "cl_parallel_exact",
    }
    assert not any(c.tallied for c in claims.CLAIMS if c.id in checks)
    assert not next(c for c in claims.CLAIMS if c.id == "de_vs_static").tallied


def test_default_order_names_known_claims():
    ids = {c.id for c in claims.CLAIMS}
    assert len(claims.QUICK_ORDER) == len(set(claims.QUICK_ORDER))
    assert set(claims.QUICK_ORDER) <= ids
    assert claims.FULL_ONLY <= ids and not claims.FULL_ONLY & set(claims.QUICK_ORDER)
    runnable = {c.id for c in claims.CLAIMS if c.run is not None}
    assert set(claims.QUICK_ORDER) <= runnable


# ---- the entry point ----------------------------------------------------------------------------


def test_help_runs_from_the_repo_root():
    proc = subprocess.run(
        [sys.executable, "experiments/reproduce.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in (
        "--quick",
        "--full",
        "--smoke",
        "--claims",
        "--threads",
        "--out",
        "--skip-set",
        "--list",
        "--repeats",
        "--random-sets",
    ):
        assert flag in proc.stdout


def test_list_and_unknown_ids(capsys):
    assert claims.main(["--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == [c.id for c in claims.CLAIMS]
    assert claims.main(["--claims", "sd_fixed_k,no_such_claim"]) == 2
    assert "no_such_claim" in capsys.readouterr().err


def test_command_reruns_one_claim():
    assert common.SCRIPT == "python experiments/reproduce.py"
    assert common.command("quick", "de_tpl", None, None) == "python experiments/reproduce.py --claims de_tpl"
    assert common.command("full", "cl_loi", 2, "s.json") == (
        "python experiments/reproduce.py --claims cl_loi --full --threads 2 --skip-set s.json"
    )
    assert common.command("quick", "sw_tree", 1, None, 3, 4) == (
        "python experiments/reproduce.py --claims sw_tree --threads 1 --repeats 3 --random-sets 4"
    )


# ---- pure helpers -------------------------------------------------------------------------------


def test_spearman():
    assert common.spearman([1, 2, 3, 4], [10, 20, 25, 100]) == pytest.approx(1.0)
    assert common.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert common.spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)


def test_monotone_and_unimodal():
    assert common.monotone([0.1, 0.2, 0.2, 0.5], increasing=True)
    assert not common.monotone([0.1, 0.3, 0.25], increasing=True)
    assert common.monotone([0.1, 0.3, 0.25], increasing=True, tol=0.05)
    assert common.monotone([0.9, 0.5, 0.5, 0.1], increasing=False)
    assert not common.monotone([0.9, 0.5, 0.6], increasing=False)
    assert common.monotone([], increasing=True) and common.monotone([1.0], increasing=False)
    assert common.unimodal([0.5, 0.7, 0.9, 0.6, 0.4])
    assert common.unimodal([0.9, 0.7, 0.5])  # peak at the start
    assert common.unimodal([0.1, 0.2, 0.3])  # peak at the end
    assert not common.unimodal([0.5, 0.3, 0.6, 0.2])
    assert common.unimodal([0.5, 0.49, 0.6, 0.2], tol=0.02)


def test_verdict_fmt_and_markdown():
    v = common.verdict("alpha 0.5", "partly", {"a": 1}, "a note", why="holds: x")
    assert v == {
        "measured": "alpha 0.5",
        "holds": "partly",
        "why": "holds: x",
        "numbers": {"a": 1},
        "note": "a note",
    }
    assert common.measured("m") == {"measured": "m", "numbers": {}, "note": ""}
    assert common.fmt(0.12345) == "0.123" and common.fmt(2.0, 2) == "2.00"
    c = next(c for c in claims.CLAIMS if c.id == "sd_fixed_k")
    rec = v | {"command": "python experiments/reproduce.py --claims sd_fixed_k"}
    assert common.row_md(c, rec) == f"| `sd_fixed_k` | {c.says} | alpha 0.5 | partly |"
    md = common.section_md(c, rec)
    assert md.startswith(f"**`sd_fixed_k`** ({common.SD}; {c.ref}). *Paper:* {c.says}.")
    assert f"*Rule:* {c.rule}" in md
    assert "*Verdict:* **partly** (holds: x). A note." in md
    assert md.endswith("`python experiments/reproduce.py --claims sd_fixed_k`")
    chk = next(c for c in claims.CLAIMS if c.id == "de_tpl")
    md = common.section_md(chk, common.verdict("m", "pass"))
    assert "*Check:*" in md and f"*Unit test:* {chk.test}." in md


def test_ternary_and_graded():
    assert common.ternary({"a": True, "b": True}) == ("yes", "holds: a, b")
    assert common.ternary({"a": True, "b": False}) == ("partly", "holds: a; fails: b")
    assert common.ternary({"a": False, "b": False}) == ("no", "fails: a, b")
    assert common.graded(True, True, "x")[0] == "yes"
    assert common.graded(False, True, "x")[0] == "partly"
    assert common.graded(False, False, "x")[0] == "no"


def test_tally_and_headline_come_from_the_verdicts():
    by_id = {c.id: c for c in claims.CLAIMS}
    recs = [
        {"id": "sd_fixed_k", "holds": "yes"},
        {"id": "sd_threshold", "holds": "partly"},
        {"id": "sd_searched", "holds": "no"},
        {"id": "sd_pattern", "holds": "no"},
        {"id": "sd_bo_budget", "holds": "not testable here"},
        {"id": "de_vs_static", "holds": "not testable here"},
        {"id": "de_tpl", "holds": "pass"},
        {"id": "lossless", "holds": "fail"},
    ]
    t = common.tally(by_id, recs)
    assert t["claims"] == 4 and t["yes"] == ["sd_fixed_k"] and t["partly"] == ["sd_threshold"]
    assert t["no"] == ["sd_searched", "sd_pattern"]
    assert t["untested"] == ["sd_bo_budget", "de_vs_static"]
    assert t["checks"] == 2 and t["checks_passed"] == ["de_tpl"] and t["checks_failed"] == ["lossless"]
    h = common.headline(t, "M", "quick")
    assert h.startswith("Of 4 empirical claims tested on M (quick), 1 holds, 1 holds partly and 2 do not.")
    assert "2 more claims could not be tested" in h
    assert "1 of 2 implementation checks (not claims, not counted) passed; failed: lossless." in h


def test_jsonable():
    plan = LayerPlan.from_indices(4, attn=[1], mlp=[2])
    got = common.jsonable({1: (0.1234567891, torch.tensor([1, 2])), "p": [plan], "s": "x"})
    assert got == {"1": [0.123457, [1, 2]], "p": [plan.describe()], "s": "x"}


def test_modelled_time_prices_each_round_with_its_plan():
    cost = synthetic_cost_model(4)  # step 1; base 0.1, attention 0.125, MLP 0.1; verify(T) = 1 + 0.1 (T - 1)
    skip_two_attn = LayerPlan.from_indices(4, attn=[1, 2])  # 0.1 + 2 * 0.125 + 4 * 0.1 = 0.75 per token
    skip_all = LayerPlan.from_indices(4, attn=range(4), mlp=range(4))  # 0.1 per token
    res = SimpleNamespace(draft_lengths=[0, 3, 0, 2], plans=[skip_two_attn.code(), skip_all.code()])
    # a plain step, 3 * 0.75 + verify(4), a plain step, 2 * 0.1 + verify(3)
    assert common.modelled_time(cost, res) == pytest.approx(1.0 + 3.55 + 1.0 + 1.4)
    assert common.modelled_time(cost, res) == pytest.approx(
        cost.step * 2 + cost.round_time(3, skip_two_attn) + cost.round_time(2, skip_all)
    )
    assert common.modelled_time(cost, SimpleNamespace(draft_lengths=[], plans=[])) == 0.0


def test_static_spec_round_trips_a_plan():
    assert common.static_spec(LayerPlan.full(4)) == ("static", {"skip_ratio": 0.0})
    plan = LayerPlan.from_indices(4, attn=[1, 3], mlp=[2])
    assert common.static_spec(plan) == ("static", {"skip_attn": (1, 3), "skip_mlp": (2,)})


def test_simulate_ls_replays_layerskip_rounds():
    match = torch.tensor([True, True, False, True, True, True])
    # round 1: two matches (gamma caps the run) + the bonus token; round 2: the same
    assert measure.simulate_ls(match, 2, 2, 4) == (6, 2 * (2 * 2 + 4), 2)
    none = torch.zeros(3, dtype=torch.bool)  # nothing matches: one token per round
    assert measure.simulate_ls(none, 3, 4, 8) == (3, 3 * (4 * 3 + 8), 3)


def test_clasp_m_is_a_fifth_of_the_blocks():
    assert clasp.clasp_m(SimpleNamespace(L=30)) == 6
    assert clasp.clasp_m(SimpleNamespace(L=2)) == 1


def test_model_free_del_checks_pass():
    """The DEL checks of the strategy's own algebra need no model at all."""
    tpl = del_.c_de_tpl(None)
    assert del_.d_de_tpl(tpl["numbers"])[0] == "pass", tpl["numbers"]["errors"]
    off = del_.c_de_off_by_one(SimpleNamespace(full=False))
    assert del_.d_de_off_by_one(off["numbers"])[0] == "pass", off["measured"]
    assert off["numbers"]["window_in_range"] and math.isfinite(off["numbers"]["literal_max"])


def test_redecide_applies_the_current_rules_to_saved_numbers(tmp_path, capsys):
    """--redecide re-derives every verdict from a saved run's numbers (the rules are pure functions
    of them) and writes the report again; a stale verdict in the file is replaced."""
    env = {"mode": "quick", "model": "M", "prompts": 7, "max_new_tokens": 40, "threads": 1}
    recs = [
        {
            "id": "sd_pattern",
            "holds": "yes",  # stale: the rule gives no
            "measured": "m",
            "note": "",
            "numbers": {"sets": {"s": {"attn": 13, "mlp": 12, "second_half": 0.52}}},
            "seconds": 1.0,
            "command": "c",
            "env": env,
        },
        {"id": "de_tpl", "holds": "pass", "measured": "m", "note": "", "numbers": {"errors": []}, "env": env},
        {
            "id": "sw_transfer",
            "holds": "not testable here",
            "measured": "not run",
            "note": "n",
            "numbers": {},
        },
    ]
    f = tmp_path / "claims.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert claims.main(["--redecide", str(f)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert report.startswith(
        "**Of 1 empirical claim tested on M (quick mode: 7 prompts, 40 new tokens, CPU, 1 thread(s)), 0 hold, "
        "0 hold partly and 1 does not."
    )
    assert "| `sd_pattern` |" in report and "| no |" in report and "*Verdict:* **no**" in report
    assert "## Implementation checks (not claims, not counted)" in report and "| `de_tpl` |" in report
    assert "## Not testable here" in report and "| `sw_transfer` |" in report
    assert capsys.readouterr().out.rstrip().endswith("ok")
