"""Reproduce the seed papers' testable claims on this framework (docs/reproduction.md).

For each claim of the reference files (Draft & Verify / Self-SD and SWIFT: "Part E"; CLaSp and
DEL: "Part D") this package measures what the framework can measure on one model, with the
strategies' own code: acceptance (alpha), mean accepted length (M), SWIFT's matchness, CLaSp's
final-layer cosine, DEL's shadow tokens and eTPL, lossless counts, and, for the few claims about
speed, same-process interleaved speed ratios against vanilla decoding (the protocol of
`framework.results.compare`). Most numbers do not depend on timing: "modelled speedup" prices the
counted rounds of a decode (draft steps and verification sizes) with `CostModel.round_time` of the
cost model measured once at the start (selector overheads not included), exactly as
`selfsd_bo`'s objective does.

    python experiments/reproduce.py --threads 1 --out runs/repro            # quick (default)
    python experiments/reproduce.py --claims sd_fixed_k,cl_bruteforce --out runs/repro
    python experiments/reproduce.py --full --threads 2 --out runs/repro_full
    python experiments/reproduce.py --redecide runs/repro/claims.jsonl     # current rules, saved numbers
    python experiments/reproduce.py --smoke                                # CI: tiny random model

Every claim carries its verdict rule (`Claim.rule`, a sentence written from the paper's numbers)
and the code that implements it (`Claim.decide`, a pure function of the numbers its ``run``
measured): yes / partly / no, comparisons by their 95% intervals (`stats`). Checks of this
implementation's algebra and exactness are ``kind="check"`` (pass / fail) and are reported apart,
never counted; the report's headline is generated from the verdict counts (`common.headline`).

``--out DIR`` gets ``claims.jsonl`` (one line per claim, written as soon as it finishes: every
number, the rule, the verdict and why, and the claim's markdown) and ``report.md`` (the headline,
the tally, the tables and the paragraphs). ``--skip-set FILE`` gives the searched Self-SD set (a
``selfsd_bo`` result); without it a short search runs first. ``--repeats`` and ``--random-sets``
set the timed passes per prompt and the random sets per comparison.

Layout: `common` (the run's context, decoding, `Claim`, the verdict helpers, the tally and
headline, output), `stats` (bootstraps, Wilson, permutation test, per-prompt counts), `measure`
(the measurements several claims share), one module per paper (`selfsd`, `swift`, `clasp`,
`del_`) and `shared` (the cross-paper claims), each exporting its ``CLAIMS``; this module
collects them and holds the driver, `main`, and `redecide`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from . import clasp, del_, selfsd, shared, swift
from .common import (
    NOT_TESTABLE,
    POLICY,
    Claim,
    command,
    headline,
    jsonable,
    load,
    model_label,
    row_md,
    section_md,
    tally,
    verdict,
)

#: Every claim, paper by paper (`shared` after Self-SD, as in the reference files).
CLAIMS: list[Claim] = [*selfsd.CLAIMS, *shared.CLAIMS, *swift.CLAIMS, *clasp.CLAIMS, *del_.CLAIMS]

#: Claims run by default in quick mode, most informative (and cheapest per insight) first.
QUICK_ORDER = [
    "de_tpl",
    "cl_bruteforce",
    "cl_parallel",
    "cl_parallel_exact",
    "cl_persistence",
    "sd_searched",
    "sd_skip_count",
    "sw_matchness_alpha",
    "sw_converge",
    "sd_pattern",
    "sd_bo_budget",
    "sw_overhead",
    "de_vanilla_etpl",
    "de_calibration",
    "de_confidence",
    "de_vs_static",
    "de_context",
    "de_free",
    "de_off_by_one",
    "cl_dp_vs_random",
    "cl_m_sweep",
    "cl_loi",
    "sd_fixed_k",
    "sd_threshold",
    "sd_adaptive",
    "sw_tree",
    "sw_expected",
    "both_draft_share",
    "overheads",
    "lossless",
]
FULL_ONLY = {"cl_det", "de_omega"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="1 prompt per category, 40 new tokens (default)")
    g.add_argument("--full", action="store_true", help="3 prompts per category, 128 new tokens, wider sweeps")
    g.add_argument("--smoke", action="store_true", help="every claim's code path on a tiny random model (CI)")
    ap.add_argument("--claims", default="", help="comma-separated claim ids (default: all runnable ones)")
    ap.add_argument(
        "--model",
        default=None,
        help="the model (a name of --list-models in run.py, a local .gguf file or HF directory; "
        "default: the embedded SmolLM2-135M-Instruct); not with --smoke",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--out", default=None, help="directory for claims.jsonl and report.md")
    ap.add_argument(
        "--skip-set", default=None, help="a saved selfsd_bo search result (the searched Self-SD set)"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed (vanilla, method) passes per prompt (quick: 2, full: 3)",
    )
    ap.add_argument(
        "--random-sets",
        type=int,
        default=None,
        help="random sets a 'vs random sets' comparison decodes (quick: 5, full: 8)",
    )
    ap.add_argument("--list", action="store_true", help="list the claims and exit")
    ap.add_argument(
        "--redecide",
        default=None,
        metavar="CLAIMS_JSONL",
        help="apply the current verdict rules to a saved run's numbers (its claims.jsonl) and write its "
        "report again (to --out, else beside the file); measures nothing",
    )
    ap.add_argument(
        "--preface",
        default=None,
        metavar="MARKDOWN",
        help="with --redecide: put this file's text before the report (the docs page is the preface "
        "plus the report of the committed numbers)",
    )
    args = ap.parse_args(argv)
    mode = "full" if args.full else ("smoke" if args.smoke else "quick")
    if args.smoke and args.model:
        ap.error("--model cannot be combined with --smoke (which builds a tiny random model)")
    by_id = {c.id: c for c in CLAIMS}
    if args.list:
        for c in CLAIMS:
            what = f"(not run: {c.untestable})" if c.run is None else c.says
            kind = "" if c.kind == "claim" else " [implementation check]"
            print(f"{c.id:<20} {c.paper:<26} {what}{kind}")
        return 0
    if args.redecide:
        preface = Path(args.preface).read_text() if args.preface else ""
        return redecide(Path(args.redecide), by_id, Path(args.out) if args.out else None, preface)
    if args.claims:
        wanted = [s.strip() for s in args.claims.split(",") if s.strip()]
        bad = [w for w in wanted if w not in by_id]
        if bad:
            print(f"error: unknown claim ids {bad}; see --list", file=sys.stderr)
            return 2
    else:
        wanted = [c for c in QUICK_ORDER] + [c.id for c in CLAIMS if c.id not in QUICK_ORDER]
        if mode == "quick":
            wanted = [w for w in wanted if w not in FULL_ONLY]
    log = print
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    ctx = load(
        mode,
        args.threads or (1 if mode == "smoke" else None),
        args.skip_set,
        log,
        args.repeats,
        args.random_sets,
        model=args.model,
    )
    env = {
        "mode": mode,
        "model": model_label(mode, args.model),
        "layers": ctx.L,
        "prompts": len(ctx.ids),
        "max_new_tokens": ctx.max_new,
        "threads": torch.get_num_threads(),
        "repeats": ctx.repeats,
        "random_sets": ctx.n_random,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    log(f"[reproduce] {json.dumps(env)}")
    records = []
    jsonl = (out_dir / "claims.jsonl").open("a") if out_dir else None
    with torch.inference_mode():
        for cid in wanted:
            c = by_id[cid]
            t0 = time.perf_counter()
            if c.run is None:
                rec = verdict("not run", NOT_TESTABLE, note=c.untestable)
            else:
                log(f"[reproduce] {cid} ...")
                rec = c.run(ctx)
                if c.decide is None:
                    rec |= {"holds": NOT_TESTABLE, "why": c.untestable}
                else:
                    rec["holds"], rec["why"] = c.decide(rec["numbers"])
            rec |= {
                "kind": c.kind,
                "rule": c.rule,
                "id": cid,
                "paper": c.paper,
                "ref": c.ref,
                "says": c.says,
                "seconds": round(time.perf_counter() - t0, 1),
                "command": command(
                    mode, cid, args.threads, args.skip_set, args.repeats, args.random_sets, args.model
                )
                if c.run
                else "",
                "env": env,
            }
            rec["markdown"] = section_md(c, rec)
            records.append(rec)
            log(f"[reproduce] {cid}: {rec['holds']} ({rec['seconds']} s): {rec['measured']}")
            if jsonl:
                jsonl.write(json.dumps(jsonable(rec)) + "\n")
                jsonl.flush()
    if jsonl:
        jsonl.close()
    elapsed = time.perf_counter() - t_start
    report = render(by_id, records, env, elapsed)
    print("\n" + report)
    print("\nre-run a claim:\n" + "\n".join(f"  {r['command']}" for r in records if r["command"]))
    print(f"\n{len(records)} claims in {elapsed:.0f} s ({mode}, {env['threads']} thread(s))")
    if out_dir:
        (out_dir / "report.md").write_text(report + "\n")
    print("ok")
    return 0


def render(by_id: dict[str, Claim], records: list[dict], env: dict, elapsed: float) -> str:
    """The run's report: the headline generated from the verdict counts, the verdict policy, the
    tally per paper, the claims' table, the implementation checks apart, the untested claims, and
    every claim's paragraph (rule, measured, verdict, command)."""
    order = {cid: i for i, cid in enumerate(by_id)}
    records = sorted(records, key=lambda r: order.get(r["id"], len(order)))  # paper by paper
    t = tally(by_id, records)
    setting = (
        f"{env['mode']} mode: {env['prompts']} prompts, {env['max_new_tokens']} new tokens, CPU, "
        f"{env['threads']} thread(s)"
    )
    lines = [f"**{headline(t, env['model'], setting)}**", "", f"*Verdicts.* {POLICY}", ""]
    lines += ["| | yes | partly | no | not testable here |", "|---|---|---|---|---|"]
    papers = list(dict.fromkeys(by_id[r["id"]].paper for r in records if by_id[r["id"]].kind == "claim"))
    for p in papers:
        rs = [r for r in records if by_id[r["id"]].paper == p and by_id[r["id"]].kind == "claim"]
        cell = {
            v: ", ".join(f"`{r['id']}`" for r in rs if r["holds"] == v) or "-"
            for v in ("yes", "partly", "no", NOT_TESTABLE)
        }
        lines.append(f"| {p} | {cell['yes']} | {cell['partly']} | {cell['no']} | {cell[NOT_TESTABLE]} |")
    claims = [r for r in records if by_id[r["id"]].kind == "claim" and r["holds"] != NOT_TESTABLE]
    checks = [r for r in records if by_id[r["id"]].kind == "check"]
    other = [r for r in records if by_id[r["id"]].kind == "claim" and r["holds"] == NOT_TESTABLE]
    lines += [
        "",
        "## Empirical claims",
        "",
        "| claim | paper says | we measure | verdict |",
        "|---|---|---|---|",
    ]
    lines += [row_md(by_id[r["id"]], r) for r in claims]
    if checks:
        lines += [
            "",
            "## Implementation checks (not claims, not counted)",
            "",
            "| check | property | we measure | result |",
            "|---|---|---|---|",
        ]
        lines += [row_md(by_id[r["id"]], r) for r in checks]
    if other:
        lines += ["", "## Not testable here", "", "| claim | paper says | why |", "|---|---|---|"]
        lines += [f"| `{r['id']}` | {by_id[r['id']].says} | {r.get('why') or r['note']} |" for r in other]
    lines += ["", "## Claim by claim", ""]
    lines += ["\n\n".join(r["markdown"] for r in records)]
    lines += ["", f"{len(records)} claims in {elapsed:.0f} s; {json.dumps(env)}"]
    return "\n".join(lines)


def redecide(path: Path, by_id: dict[str, Claim], out_dir: Path | None, preface: str = "") -> int:
    """``--redecide``: the verdicts of a saved run from its numbers with the current rules (each
    `Claim.decide` is a pure function of the numbers), and its report written again, after
    ``preface`` (the docs page's own text)."""
    recs: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            recs[rec["id"]] = rec  # the last record of a claim wins (claims.jsonl is appended to)
    records = []
    for cid, rec in recs.items():
        c = by_id.get(cid)
        if c is None:
            print(f"warning: {cid} is no longer a claim; left out", file=sys.stderr)
            continue
        if c.run is not None and c.decide is not None:
            rec["holds"], rec["why"] = c.decide(rec["numbers"])
        rec |= {"kind": c.kind, "rule": c.rule}
        rec["markdown"] = section_md(c, rec)
        records.append(rec)
    env = records[0]["env"] if records else {}
    elapsed = sum(r.get("seconds", 0.0) for r in records)
    report = (
        preface
        + render(by_id, records, env, elapsed)
        + f"\n\n(verdicts re-decided from {path} by --redecide)"
    )
    print(report)
    target = (out_dir or path.parent) / "report.md"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(report + "\n")
    print("ok")
    return 0
