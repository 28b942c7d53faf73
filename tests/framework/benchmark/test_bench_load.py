"""framework/benchmark/load.py: a benchmark says when its timings cannot be trusted - other
processes holding cores while it was timed, or the baseline's repeats disagreeing (issue 28)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import framework.benchmark.load as load
import framework.runner.lightning as run
from framework.runner.cli import bench_main as main


def _stat(path, busy_ticks: int) -> None:
    path.write_text(f"cpu  {busy_ticks} 0 0 1000 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")


def test_other_processes_cores_are_the_machines_busy_time_minus_ours(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    hz = load.os.sysconf("SC_CLK_TCK")
    _stat(stat, 0)
    own = iter([10.0, 10.5])  # this process: 0.5 CPU seconds
    monkeypatch.setattr(load, "_own_seconds", lambda: next(own))
    clock = iter([100.0, 102.0])  # 2 s of wall time
    monkeypatch.setattr(load.time, "perf_counter", lambda: next(clock))
    mon = load.LoadMonitor(stat).start()
    _stat(stat, int(2.5 * hz))  # the machine: 2.5 CPU seconds busy
    got = mon.stop()
    assert got["other_cores"] == pytest.approx(1.0, abs=0.01)  # (2.5 - 0.5) / 2
    assert got["own_cores"] == pytest.approx(0.25)
    monkeypatch.undo()
    assert load.LoadMonitor(tmp_path / "missing").start().stop()["other_cores"] is None  # off Linux


def test_a_busy_neighbour_is_seen():
    busy = "import time\nt = time.time()\nwhile time.time() - t < 2.0:\n    pass\n"
    mon = load.LoadMonitor().start()
    proc = subprocess.Popen([sys.executable, "-c", busy])
    time.sleep(2.2)  # this process idles while its neighbour spins
    proc.wait()
    got = mon.stop()
    if got["other_cores"] is None:
        pytest.skip("no /proc/stat on this platform")
    # the child is waited for, so its CPU time counts as ours; a neighbour is what is not ours
    assert got["own_cores"] >= 0.6 or got["other_cores"] >= 0.6


def test_warnings_name_the_load_and_the_baselines_spread():
    quiet = {"other_cores": 0.05, "cpu_count": 2}
    assert load.warnings(quiet, 0.03) == []
    busy = load.warnings({"other_cores": 0.9, "cpu_count": 2}, None)
    assert len(busy) == 1 and "kept 0.90 of 2 cores busy" in busy[0]
    drift = load.warnings(quiet, 0.25)
    assert len(drift) == 1 and "disagree by 25%" in drift[0]
    assert load.vanilla_spread([10.0, 12.0]) == pytest.approx(0.2) and load.vanilla_spread([10.0]) is None


def test_the_report_and_meta_say_when_timings_cannot_be_trusted(tmp_path, monkeypatch):
    monkeypatch.setattr(
        run.LoadMonitor,
        "stop",
        lambda self: (
            {"other_cores": 1.2, "own_cores": 0.9, "seconds": 3.0, "cpu_count": 2}
            | {"loadavg_start": 2.1, "loadavg_end": 2.4}
        ),
    )
    out = tmp_path / "b"
    args = ["--model", "tiny-random", "--limit", "1", "--categories", "qa", "--max-new-tokens", "6"]
    assert (
        main(
            [
                *args,
                "--methods",
                "vanilla,static_confidence",
                "--logger",
                "none",
                "--no-plots",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = (out / "bench.md").read_text()
    assert "- machine load while timed: other processes kept 1.20 cores busy" in report
    assert "- **warning**: other processes kept 1.20 of 2 cores busy" in report
    assert "- **These timings may not be trustworthy**: other processes kept 1.20" in report
    meta = (out / "meta.json").read_text()
    assert '"other_cores": 1.2' in meta and '"warnings": [' in meta


def test_a_cpu_run_leaves_the_busy_cores_to_their_processes(monkeypatch):
    """Issue 55, item 1: with one of 2 cores kept busy, 2 torch threads made every step 3.6x
    slower; a CPU run without --threads then runs one thread per free core, and says so."""
    import torch

    import framework.runner.pipeline as pipeline

    assert load.threads_for_load(2, 2, None) == 2  # off Linux: unchanged
    assert load.threads_for_load(2, 2, 0.3) == 2  # a light neighbour: unchanged
    assert load.threads_for_load(2, 2, 0.98) == 1
    assert load.threads_for_load(2, 2, 1.9) == 1  # never below one thread
    assert load.threads_for_load(8, 16, 4.2) == 8  # enough free cores: unchanged
    assert load.threads_for_load(16, 16, 4.2) == 12
    saved = torch.get_num_threads()
    said: list[str] = []
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(pipeline, "other_cores_now", lambda: 0.98)
        pipeline._yield_busy_cores(said.append)
        assert torch.get_num_threads() == 1
        assert said and "keep 0.98 of" in said[0] and "torch runs 1 thread(s), not 2" in said[0]
        assert "--threads N" in said[0]
        said.clear()
        torch.set_num_threads(2)
        monkeypatch.setattr(pipeline, "other_cores_now", lambda: 0.1)
        pipeline._yield_busy_cores(said.append)
        assert torch.get_num_threads() == 2 and said == []
    finally:
        torch.set_num_threads(saved)
    # Only a one-process CPU run yields cores (a GPU run's threads do not compute the model).
    from framework.session.run_config import RunConfig

    assert pipeline._on_cpu(RunConfig.of(device="cpu"))
    assert not pipeline._on_cpu(RunConfig.of(device="cuda"))
