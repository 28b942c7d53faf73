"""Reproduce the seed papers' testable claims on this framework (docs/reproduction.md).

For each claim of the reference files (Draft & Verify / Self-SD and SWIFT: "Part E"; CLaSp and
DEL: "Part D") this package measures what the framework can measure on one model, with the
strategies' own code: acceptance (alpha), mean accepted length (M), SWIFT's matchness, CLaSp's
final-layer cosine, DEL's shadow tokens and eTPL, lossless counts, and, for the few claims about
speed, same-process interleaved speed ratios against vanilla decoding (the protocol of
`framework.experiment.timing`). Most numbers do not depend on timing: "modelled speedup" prices the
counted rounds of a decode (draft steps and verification sizes) with `CostModel.round_time` of the
cost model measured once at the start (selector overheads not included), exactly as
`selfsd_bo`'s objective does.

    python experiments/reproduce.py --threads 1 --out runs/repro            # quick (default)
    python experiments/reproduce.py --claims sd_fixed_k,cl_bruteforce --out runs/repro
    python experiments/reproduce.py --full --threads 2 --out runs/repro_full
    python experiments/reproduce.py --smoke                                # CI: tiny random model

``--out DIR`` gets ``claims.jsonl`` (one line per claim, written as soon as it finishes: every
number and the claim's markdown) and ``report.md`` (the table). ``--skip-set FILE`` gives the
searched Self-SD set (a ``selfsd_bo`` result); without it a short search runs first.

Layout: `common` (the run's context, decoding, `Claim`, `verdict`, output), `measure` (the
measurements several claims share), one module per paper (`selfsd`, `swift`, `clasp`, `del_`) and
`shared` (the cross-paper claims), each exporting its ``CLAIMS``; this module collects them and
holds the driver, `main`.
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
from .common import Claim, command, jsonable, load, row_md, section_md, verdict

#: Every claim, paper by paper (`shared` after Self-SD, as in the reference files).
CLAIMS: list[Claim] = [*selfsd.CLAIMS, *shared.CLAIMS, *swift.CLAIMS, *clasp.CLAIMS, *del_.CLAIMS]

#: Claims run by default in quick mode, most informative (and cheapest per insight) first.
QUICK_ORDER = [
    "de_tpl",
    "cl_bruteforce",
    "cl_parallel",
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
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--out", default=None, help="directory for claims.jsonl and report.md")
    ap.add_argument(
        "--skip-set", default=None, help="a saved selfsd_bo search result (the searched Self-SD set)"
    )
    ap.add_argument("--list", action="store_true", help="list the claims and exit")
    args = ap.parse_args(argv)
    mode = "full" if args.full else ("smoke" if args.smoke else "quick")
    by_id = {c.id: c for c in CLAIMS}
    if args.list:
        for c in CLAIMS:
            print(
                f"{c.id:<20} {c.paper:<26} {'(not run: ' + c.untestable + ')' if c.run is None else c.says}"
            )
        return 0
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
    ctx = load(mode, args.threads or (1 if mode == "smoke" else None), args.skip_set, log)
    env = {
        "mode": mode,
        "model": "tiny random llama (8 blocks)" if mode == "smoke" else "SmolLM2-135M-Instruct",
        "layers": ctx.L,
        "prompts": len(ctx.ids),
        "max_new_tokens": ctx.max_new,
        "threads": torch.get_num_threads(),
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
                rec = verdict("not run", "not testable here", note=c.untestable)
            else:
                log(f"[reproduce] {cid} ...")
                rec = c.run(ctx)
            rec |= {
                "id": cid,
                "paper": c.paper,
                "ref": c.ref,
                "says": c.says,
                "seconds": round(time.perf_counter() - t0, 1),
                "command": command(mode, cid, args.threads, args.skip_set) if c.run else "",
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
    table = ["| claim | paper says | we measure | holds? |", "|---|---|---|---|"]
    table += [row_md(by_id[r["id"]], r) for r in records]
    report = "\n".join(table)
    elapsed = time.perf_counter() - t_start
    print("\n" + report)
    print("\nre-run a claim:\n" + "\n".join(f"  {r['command']}" for r in records if r["command"]))
    print(f"\n{len(records)} claims in {elapsed:.0f} s ({mode}, {env['threads']} thread(s))")
    if out_dir:
        body = "\n\n".join(r["markdown"] for r in records)
        (out_dir / "report.md").write_text(f"{report}\n\n{body}\n")
    print("ok")
    return 0
