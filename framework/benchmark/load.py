"""Whether a benchmark's timings can be trusted: the machine's load while it ran, and how well
the repeats of the baseline agree (issue 28).

On a 2-core machine one busy core made a step 14x slower and flipped a draft gate; a table that
does not say so misleads. `LoadMonitor` reads, over the timed part of a run, the CPU time the whole
machine spent (``/proc/stat``) and the CPU time this process spent (``getrusage``); the
difference, per second of wall time, is how many cores *other* processes kept busy. `warnings`
turns that and the spread of the baseline's repeats into sentences for the report's header and
story. Off Linux (no ``/proc/stat``) only the load average is reported.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Cores other processes may keep busy on average before a run is flagged.
BUSY_CORES = 0.25
#: Largest relative spread (max / min - 1) of the baseline's tokens/s over repeats before a run is flagged.
VANILLA_SPREAD = 0.10


def _machine_busy_seconds(stat: Path = Path("/proc/stat")) -> float | None:
    """CPU seconds the whole machine spent busy since boot (user, nice, system, irq, softirq,
    steal), or ``None`` without ``/proc/stat``."""
    try:
        fields = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    busy = (
        ticks[0] + ticks[1] + ticks[2] + sum(ticks[5:8])
    )  # user nice system (idle iowait) irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds this process (and its finished children) spent."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


@dataclass
class LoadMonitor:
    """Measures the load other processes put on the machine between `start` and `stop`."""

    stat: Path = Path("/proc/stat")

    def start(self) -> LoadMonitor:
        self._t = time.perf_counter()
        self._busy = _machine_busy_seconds(self.stat)
        self._own = _own_seconds()
        self._load = _loadavg()
        return self

    def stop(self) -> dict[str, Any]:
        """``{"other_cores", "own_cores", "seconds", "cpu_count", "loadavg_start", "loadavg_end"}``;
        ``other_cores`` is ``None`` off Linux."""
        wall = max(time.perf_counter() - self._t, 1e-9)
        busy = _machine_busy_seconds(self.stat)
        own = _own_seconds() - self._own
        other = None if busy is None or self._busy is None else max(0.0, (busy - self._busy - own) / wall)
        return {
            "other_cores": None if other is None else round(other, 3),
            "own_cores": round(own / wall, 3),
            "seconds": round(wall, 2),
            "cpu_count": os.cpu_count(),
            "loadavg_start": self._load,
            "loadavg_end": _loadavg(),
        }


#: Cores other processes must keep busy before a CPU run leaves them to those processes
#: (`threads_for_load`).
YIELD_CORES = 0.5


def other_cores_now(seconds: float = 0.5, stat: Path = Path("/proc/stat")) -> float | None:
    """Cores other processes keep busy, sampled over ``seconds`` while this process sleeps
    (``None`` off Linux)."""
    mon = LoadMonitor(stat).start()
    time.sleep(seconds)
    return mon.stop()["other_cores"]


def threads_for_load(threads: int, cpu_count: int, other: float | None) -> int:
    """The torch CPU threads a run should use when other processes keep ``other`` cores of
    ``cpu_count`` busy: ``threads`` on an idle machine, else no more than the cores left free
    (at least 1). On 2 cores with one kept busy, 2 threads made every step 3.6x slower (each
    operation waits for the thread that shares the busy core); 1 thread on the free core loses
    only what the second core added."""
    if other is None or other < YIELD_CORES:
        return threads
    return max(1, min(threads, round(cpu_count - other)))


def vanilla_spread(tokens_per_s_by_repeat: Sequence[float]) -> float | None:
    """max / min - 1 of the baseline's overall tokens/s over repeats (``None`` with one repeat)."""
    vals = [v for v in tokens_per_s_by_repeat if v and v > 0]
    return max(vals) / min(vals) - 1.0 if len(vals) >= 2 else None


def warnings(load: Mapping[str, Any] | None, spread: float | None) -> list[str]:
    """Sentences saying why the timings may not be trusted (empty: nothing seen)."""
    out = []
    other = (load or {}).get("other_cores")
    if other is not None and other > BUSY_CORES:
        out.append(
            f"other processes kept {other:.2f} of {load['cpu_count']} cores busy on average while this run was "
            "timed: its speed ratios may be off (a busy core slows every method, but not alike); run it again "
            "on an idle machine"
        )
    if spread is not None and spread > VANILLA_SPREAD:
        out.append(
            f"the baseline's repeats disagree by {100 * spread:.0f}% (more than {100 * VANILLA_SPREAD:.0f}%): the "
            "machine's speed drifted during the run, so single-run ratios carry that noise"
        )
    return out


def load_line(load: Mapping[str, Any] | None) -> str:
    """The report header's line on the machine's load."""
    if not load:
        return "- machine load: not measured"
    other = load.get("other_cores")
    avg = (
        f"load average {load['loadavg_start']:.2f} -> {load['loadavg_end']:.2f}"
        if load.get("loadavg_start") is not None and load.get("loadavg_end") is not None
        else "no load average"
    )
    busy = (
        "other processes: not measurable here"
        if other is None
        else f"other processes kept {other:.2f} cores busy"
    )
    return f"- machine load while timed: {busy}, this run {load['own_cores']:.2f} cores ({load['cpu_count']} in all; {avg})"
