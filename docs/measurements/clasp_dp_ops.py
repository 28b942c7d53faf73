"""CLaSp's DP, this checkout against an earlier commit's: operations outside the block forwards,
host reads, skip set and time per DP (issue 38, item 3; docs/performance.md, "Host work per
round").

    python docs/measurements/clasp_dp_ops.py --base 66f0a01 --layers 30 --skip 15

The earlier ``strategies/selectors/clasp_dp.py`` is read with ``git show`` and loaded beside the
current one (its registration left out). Both run the DP on the same tiny random Llama's prompt
state, alternated, one thread, with warm-up; the table gives medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from framework.engine.adapter import adapter_for  # noqa: E402
from framework.engine.state import DecodeState  # noqa: E402
from framework.testing import random_prompt, tiny_model  # noqa: E402
from framework.testing.host_work import count_host_work  # noqa: E402
from strategies.selectors.clasp_dp import clasp_dp  # noqa: E402

PATH = "strategies/selectors/clasp_dp.py"


def _load_base(rev: str):
    text = subprocess.run(
        ["git", "show", f"{rev}:{PATH}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    text = text.replace('@register_selector("clasp_dp", config=ClaspDPConfig)', "")
    path = Path(tempfile.mkdtemp()) / "clasp_dp_base.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("clasp_dp_base", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["clasp_dp_base"] = module
    spec.loader.exec_module(module)
    return module.clasp_dp


def dp_is_ours(name: str) -> bool:
    return name == "this checkout"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare with (e.g. 66f0a01)")
    ap.add_argument("--layers", type=int, default=30, help="blocks of the tiny model (default 30)")
    ap.add_argument("--skip", type=int, default=15, help="M, blocks skipped (default 15)")
    ap.add_argument("--repeats", type=int, default=15, help="timed DPs each (default 15; 3 warm-up)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    adapter = adapter_for(tiny_model("llama", num_layers=args.layers, seed=0))
    state = DecodeState(adapter, random_prompt(9, 128, 0), 64, capture_hidden=True)
    with torch.inference_mode():
        state.append(state.prefill().argmax(-1)[:, None])
        pos = state.prompt_len - 1
        x = state.last_hidden_states[:, 0, pos]
        runs = {args.base: _load_base(args.base), "this checkout": clasp_dp}
        times: dict[str, list[float]] = {k: [] for k in runs}
        print("| DP | operations | host reads | skip set | ms (median) |\n|---|---:|---:|---|---:|")
        counted = {}
        for name, dp in runs.items():
            with count_host_work() as work:
                res = dp(x, partial(state.compute_at, pos), args.skip)
            counted[name] = (work.ops, work.reads, res.skip)
        for _ in range(args.repeats):
            for name, dp in runs.items():
                t0 = time.perf_counter()
                dp(x, partial(state.compute_at, pos), args.skip)
                times[name].append(time.perf_counter() - t0)
    for name, (ops, reads, skip) in counted.items():
        ms = statistics.median(times[name][3:]) * 1e3
        # reads are counted at project lines; the earlier file is loaded from elsewhere
        shown = reads if dp_is_ours(name) else "not counted"
        print(f"| {name} | {ops} | {shown} | {list(skip)} | {ms:.2f} |")


if __name__ == "__main__":
    main()
