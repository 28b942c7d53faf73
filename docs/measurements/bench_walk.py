"""The benchmark's walk (issue 39, item 2): over one tiny ``bench.py`` run, how often a function of
another project module is entered from the benchmark's driver and returns into it, and how often
the driver is entered from elsewhere. The driver is ``framework/benchmark/bench.py`` up to issue
48 and ``framework/runner/pipeline.py`` (the one pipeline) after it; the script takes the one
the checkout has. A driver that does one thing after another climbs
back into bench.py once per step; a translation spread over modules climbs back many times.

    git worktree add /tmp/base <commit>
    python docs/measurements/bench_walk.py /tmp/base     # before
    python docs/measurements/bench_walk.py .             # after

Measured 2026-11-28 (fourth session): b72c85a 5 entries and 45 returns (run_config 6,
bench_config 4), 8b33d5d 5 and 39 (run_config 3, bench_config 3).
2026-11-29, issue 48: aaf6b30 (before the one pipeline) 5 entries and 39 returns into bench.py
(session 7, driver 6, compare 6, ...); after it, 4 entries and 32 returns into pipeline.py
(lightning 11: the methods and the predict module; architecture 4; run_config 3; ...).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

ARGV = [
    *("--model", "tiny-random", "--limit", "1", "--categories", "qa", "--max-new-tokens", "8"),
    *("--device", "cpu", "--dtype", "float32", "--logger", "none", "--no-plots"),
    *("--methods", "vanilla,static_confidence", "--cost-model", "none", "--out", "out"),
]


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    sys.path.insert(0, str(root))
    os.chdir(tempfile.mkdtemp())
    try:
        from framework.runner.cli import bench_main
    except ImportError:  # before issue 48
        from framework.benchmark.cli import main as bench_main

    target = str(root / "framework" / "benchmark" / "bench.py")
    if not Path(target).exists():  # issue 48: the one pipeline
        target = str(root / "framework" / "runner" / "pipeline.py")
    project = str(root / "framework") + os.sep
    entries: Counter[str] = Counter()
    returns: Counter[str] = Counter()

    def profile(frame, event, _arg):  # noqa: ANN001, ANN202 - sys.setprofile's signature
        back = frame.f_back
        if back is None:
            return
        here, caller = frame.f_code.co_filename, back.f_code.co_filename
        if event == "call" and here == target and caller != target and caller.startswith(project):
            entries[os.path.relpath(caller, root)] += 1
        if event == "return" and here != target and here.startswith(project) and caller == target:
            returns[os.path.relpath(here, root)] += 1

    sys.setprofile(profile)
    try:
        code = bench_main(ARGV)
    finally:
        sys.setprofile(None)
    print(
        f"{root}: exit {code}, {sum(entries.values())} entries, {sum(returns.values())} returns into {Path(target).name}"
    )
    print("returns from:", ", ".join(f"{m} {n}" for m, n in returns.most_common()))
    return code


if __name__ == "__main__":
    sys.exit(main())
