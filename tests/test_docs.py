"""The documentation stays in step with the code.

- Every shipped strategy has a page ``docs/strategies/<dir>/<name>.md`` that names each of its
  config fields (in backticks).
- The scripts that pages include section by section (the tutorials, the new-architecture how-to)
  run, exit 0 and each print their last line (``ok`` for the tutorials).
- Every snippet section a page includes exists in the file it names.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from framework import REGISTRIES

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
KIND_DIRS = {"selector": "selectors", "length": "length", "drafter": "drafters", "verifier": "verifiers"}


def _shipped_strategies() -> list[tuple[str, str, type]]:
    """(kind, name, config class) of every registered strategy shipped in ``strategies/``.

    Tests elsewhere register throw-away strategies; those live outside the ``strategies``
    package and need no page.
    """
    return [
        (kind, e.name, e.config)
        for kind, reg in REGISTRIES.items()
        for e in reg.entries()
        if e.cls.__module__.split(".")[0] == "strategies"
    ]


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_every_shipped_strategy_is_in_the_registered_now_tables(page):
    """README's and the docs home's "registered now" tables name every shipped strategy of each
    kind, in the row of its interface (they had drifted to two names)."""
    rows = {
        "selector": "`LayerSelector`",
        "length": "`LengthController`",
        "drafter": "`Drafter`",
        "verifier": "`Verifier`",
    }
    text = (ROOT / page).read_text()
    for kind, name, _ in _shipped_strategies():
        row = next(line for line in text.splitlines() if line.startswith(f"| {rows[kind]} |"))
        assert f"`{name}`" in row.split(" | ")[-1], f"{page}: {kind} {name!r} missing from its table row"


REPRODUCTION_PAGES = [
    ("reproduction.md", "smollm2-135m", "preface.md"),
    ("reproduction-qwen.md", "qwen2.5-coder-0.5b", "preface_qwen.md"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("page_name", "model", "preface"), REPRODUCTION_PAGES, ids=["smollm2", "qwen"])
def test_the_reproduction_page_regenerates_from_its_committed_numbers(tmp_path, page_name, model, preface):
    """Each reproduction page is its preface plus the report that --redecide renders from the
    run's raw numbers committed next to it (no decoding): a rule or a renderer that changed
    without the page being regenerated fails here (issue 31)."""
    data = f"docs/reproduction/{model}.claims.jsonl"
    if not (ROOT / data).exists():
        pytest.skip(f"{data} is not committed yet")
    cmd = [sys.executable, "experiments/reproduce.py", "--redecide", data]
    cmd += ["--preface", f"experiments/claims/{preface}", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = (ROOT / "docs" / page_name).read_text()
    assert (tmp_path / "report.md").read_text() == page, (
        f"docs/{page_name} differs from its regeneration: run python experiments/reproduce.py "
        f"--redecide {data} --preface experiments/claims/{preface} --out DIR and copy DIR/report.md"
    )


def test_every_kind_has_a_docs_directory():
    assert set(KIND_DIRS) == set(REGISTRIES), (
        "a new registry needs an entry in KIND_DIRS and a docs directory"
    )


@pytest.mark.parametrize(
    ("kind", "name", "config"), _shipped_strategies(), ids=lambda v: getattr(v, "__name__", v)
)
def test_strategy_has_page_naming_every_config_field(kind, name, config):
    page = DOCS / "strategies" / KIND_DIRS[kind] / f"{name}.md"
    assert page.is_file(), f"{kind} {name!r} has no docs page: write {page.relative_to(ROOT)}"
    text = page.read_text(encoding="utf-8")
    # In backticks, as the page's config table writes it: a bare `k` would match any "k".
    missing = [f.name for f in dataclasses.fields(config) if f"`{f.name}`" not in text]
    assert not missing, f"{page.relative_to(ROOT)} does not mention config field(s) {missing}"


#: Scripts that pages include section by section; each must run to completion.
DOC_SCRIPTS = (
    "docs/tutorials/custom_selector.py",
    "docs/howto/olmo2_adapter.py",
    "docs/tutorials/compare_methods.py",
    "docs/tutorials/custom_length.py",
    "docs/tutorials/python_api.py",
    "docs/tutorials/fast_strategy.py",
    "docs/tutorials/structured_output.py",
)

#: The line each script prints last when it finished (``ok`` unless listed here).
DOC_SCRIPT_LAST_LINE = {
    "docs/howto/olmo2_adapter.py": "speculative greedy output equals vanilla greedy output",
}

_RUNNER = """
import runpy, sys
for path in sys.argv[1:]:
    print("==>", path, flush=True)
    runpy.run_path(path, run_name="__main__")
"""


def _script_outputs(stdout: str) -> dict[str, list[str]]:
    """The runner's stdout split by script: ``{path: non-empty lines it printed}``."""
    out: dict[str, list[str]] = {}
    current = None
    for line in stdout.splitlines():
        if line.startswith("==> "):
            current = line[4:].strip()
            out[current] = []
        elif current is not None and line.strip():
            out[current].append(line.strip())
    return out


@pytest.mark.slow
def test_doc_scripts_run():
    """The tutorial and how-to scripts run and exit 0 (one interpreter, to pay the imports once).

    They run in a subprocess: a tutorial registers strategies (``middle_mlp``, ``risk_budget``)
    when it runs, and a registration in this process would leak into every test that iterates the
    registries (the combination test, the drafter contract's loop over length controllers).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    # Tiny matmuls gain nothing from intra-op threads, and lose a lot on a busy CPU.
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, *DOC_SCRIPTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"a docs script failed:\n{proc.stdout}\n{proc.stderr}"
    printed = _script_outputs(proc.stdout)
    for path in DOC_SCRIPTS:
        want = DOC_SCRIPT_LAST_LINE.get(path, "ok")
        lines = printed.get(path, [])
        assert lines and lines[-1] == want, (
            f"{path} did not finish (its last line should be {want!r}):\n" + "\n".join(lines[-20:])
        )


_SNIPPET = re.compile(r'^--8<-- "([^":]+)(?::([\w-]+))?"\s*$', re.MULTILINE)


@pytest.mark.slow
def test_reproduction_script_smoke_mode():
    """experiments/reproduce.py (the numbers of docs/reproduction.md) runs every claim's code path
    on a tiny random model."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, "experiments/reproduce.py", "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"reproduce.py --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    assert lines and lines[-1] == "ok", proc.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script",
    [
        [
            "docs/measurements/gpu_costs.py",
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--new-tokens",
            "12",
            "--reps",
            "1",
        ],
        [
            "docs/measurements/gpu_e2e.py",
            *("--shape", "tiny", "--device", "cpu", "--dtype", "float32"),
            *("--new-tokens", "16", "--reps", "1", "--prompts", "2"),
        ],
        [
            "docs/measurements/gpu_e2e.py",
            *("--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--reps", "1", "--prompts", "2"),
            *("--trace", "docs/measurements/traces/smollm2-135m.json", "--trace-turns", "2"),
            *("--trace-methods", "clasp,static_confidence:raw"),
        ],
        [
            "docs/measurements/host_reads.py",
            "--presets",
            "static_confidence,swift,vanilla",
            "--new-tokens",
            "16",
        ],
        [
            "docs/measurements/draft_weights.py",
            *("--model", "tiny-random", "--reps", "2", "--accept-tokens", "12", "--draft-vocab", "0"),
        ],
        [
            "docs/measurements/exact_cost.py",
            *("--model", "tiny-random", "--tokens", "8", "--repeats", "1", "--threads", "1"),
        ],
        [
            "docs/measurements/synthetic_acceptance.py",
            *(
                "--model",
                "tiny-random",
                "--limit",
                "1",
                "--max-new-tokens",
                "8",
                "--p",
                "0.5",
                "--out",
                "{tmp}",
            ),
        ],
        [
            "docs/measurements/gpu_engine_probe.py",
            *("--out", "{tmp}", "--parts", "engine,whole,exact,cond,7b"),
        ],
    ],
    ids=[
        "gpu_costs",
        "gpu_e2e",
        "gpu_e2e_trace",
        "host_reads",
        "draft_weights",
        "exact_cost",
        "synthetic_acceptance",
        "gpu_engine_probe",
    ],
)
def test_measurement_scripts_smoke(script, tmp_path):
    """The GPU measurement script (docs/performance.md; written to run unchanged on any CUDA
    machine) and the host-read count run every code path here on a tiny model on the CPU."""
    script = [a.replace("{tmp}", str(tmp_path)) for a in script]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, *script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{script[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if "gpu_costs" in script[0]:
        for part in (
            "## Targets (issue 17), eager",
            "## Targets (issue 17), graphs",
            "## Targets (issue 27), graphs",
            "## Bandwidth floor (measured copy:",
            "| fp8 | reference |",  # fp8 drafts through the modules (no CPU kernel: the reference)
            "| int8 | cpu-fused |",
            "| draft skipping 45%, int8 weights (steps) |",
            "| plain step (x bandwidth floor) |",
            "# Eager against CUDA graphs",
        ):
            assert part in proc.stdout, part
        assert "| selfsd |" in proc.stdout
    elif "exact_cost" in script[0]:
        assert "exact on / off:" in proc.stdout and "same tokens:" in proc.stdout
    elif "gpu_engine_probe" in script[0]:
        records = [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()]
        assert [r["part"] for r in records] == ["env", "engine", "whole", "exact", "cond", "7b"], records
        assert not [r for r in records if "error" in r], records
        assert set(records[1]) >= {"forward", "forward_exact", "branch"}
        assert records[3]["default"]["argmax_diffs"] == 0  # float32 on a CPU: no near-tie here
    elif "--trace" in script:
        rows = [line for line in proc.stdout.splitlines() if line.startswith("| smollm2-135m-instruct/")]
        assert len(rows) == 2 * 2, proc.stdout  # two methods, eager and graphs
        for row in rows:  # the replay commits what the trace recorded; no graph recorded while timed
            cells = [c.strip() for c in row.strip("|").split("|")]
            alpha, recorded = (float(x) for x in cells[6].replace("(", " ").replace(")", " ").split())
            m, recorded_m = (float(x) for x in cells[7].replace("(", " ").replace(")", " ").split())
            assert abs(alpha - recorded) <= 0.02 and abs(m - recorded_m) <= 0.05, row
            assert cells[10] == "0", row
    elif "gpu_e2e" in script[0]:
        rows = [line for line in proc.stdout.splitlines() if line.startswith(("| eager |", "| graphs |"))]
        assert len(rows) == 2, proc.stdout
        for row in rows:  # a redundant model: drafts are accepted, and the outputs equal vanilla's
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert float(cells[5]) > 0.5 and cells[9] == "0/2", row
    elif "draft_weights" in script[0]:
        rows = [
            line
            for line in proc.stdout.splitlines()
            if line.startswith(("| float32 |", "| int8 |", "| bfloat16 |"))
        ]
        assert len(rows) == 3 + 3 * 2, proc.stdout  # the cost table, then each format x ratio
        assert all(row.rstrip(" |").endswith("0/7") for row in rows[3:]), rows  # every output exact
    elif "synthetic_acceptance" in script[0]:
        rows = [line for line in proc.stdout.splitlines() if line.startswith("| static_confidence | 0.5 |")]
        assert len(rows) == 1 and rows[0].rstrip(" |").split(" | ")[-1].endswith("%"), proc.stdout  # an error
        assert "Mean absolute error" in proc.stdout
    else:
        assert "| swift |" in proc.stdout and "| vanilla |" in proc.stdout


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "measurements" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _turn(drafted, committed, ratios):
    return {"draft_lengths": drafted, "accept_lengths": committed, "skip_ratios": ratios}


def test_record_traces_keeps_every_round_and_refuses_inconsistent_turns():
    rt = _script("record_traces")
    # a declined round (0 drafted) has no skip ratio; the others take theirs in order
    assert rt.turn_rounds(_turn([3, 0, 2], [4, 1, 1], [0.5, 0.25])) == [
        [3, 4, 0.5],
        [0, 1, 0.0],
        [2, 1, 0.25],
    ]
    with pytest.raises(ValueError, match="same rounds"):
        rt.turn_rounds(_turn([3, 0, 2], [4, 1, 1], [0.5]))
    with pytest.raises(ValueError, match="committed 5"):
        rt.turn_rounds(_turn([3], [5], [0.5]))
    records = [
        {"method": "vanilla", "turns": [_turn([], [1] * 4, [])]},
        {"method": "m", "repeat": 0, "turns": [_turn([3, 0], [4, 1], [0.5]), _turn([2], [2], [0.25])]},
        {"method": "m", "repeat": 1, "turns": [_turn([1], [1], [0.5])]},  # later repeats: not kept
        {"method": "hf_generate", "turns": [_turn([], [1], [])]},
    ]
    out = rt.traces(records)
    assert list(out) == ["m"]
    m = out["m"]
    assert (m["drafted"], m["committed"], m["turns"]) == ([3, 0, 2], [4, 1, 2], [2, 1])
    assert m["skip_ratios"] == [0.25, 0.5] and m["plan"] == [1, -1, 0]
    assert m["alpha"] == round(4 / 5, 4) and m["M"] == round(7 / 3, 4) and m["declined"] == round(1 / 3, 4)
    assert json.loads(rt.dumps({"source": {"model": "x"}, "methods": out})) == {
        "source": {"model": "x"},
        "methods": out,
    }
    with pytest.raises(ValueError, match="no rounds of"):
        rt.traces(records, ["swift"])


def test_committed_traces_describe_their_rounds():
    """The trace files gpu_e2e.py replays are consistent: lists of one length, turns that add up,
    summaries that match the rounds."""
    files = sorted((ROOT / "docs" / "measurements" / "traces").glob("*.json"))
    files = [f for f in files if "skipset" not in f.name]
    assert files
    for f in files:
        doc = json.loads(f.read_text())
        assert doc["source"]["model"] and doc["source"]["command"]
        for name, m in doc["methods"].items():
            n = m["rounds"]
            assert len(m["drafted"]) == len(m["committed"]) == len(m["plan"]) == n == sum(m["turns"]), name
            assert all(1 <= c <= d + 1 for d, c in zip(m["drafted"], m["committed"], strict=True)), name
            assert all((p >= 0) == (d > 0) for d, p in zip(m["drafted"], m["plan"], strict=True)), name
            assert m["alpha"] == round(sum(c - 1 for c in m["committed"]) / max(1, sum(m["drafted"])), 4)


@pytest.mark.slow
def test_gpu_all_runs_its_issue_26_parts_on_a_cpu(tmp_path):
    """docs/measurements/gpu_all.sh (run on GPU machines in one call) through its CPU knobs: the
    trace replay on a tiny shape and the real-model benchmark on the tiny random model."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(
        OMP_NUM_THREADS="1",
        GPU_PARTS="engine replay real",
        GPU_ENGINE_PARTS="engine",
        GPU_REPLAY_SHAPES="tiny",
        GPU_REPLAY_TURNS="1",
        GPU_REPLAY_EXTRA="--device cpu --dtype float32 --prompts 1 --trace-methods clasp",
        GPU_REAL_MODEL="tiny-random",
        GPU_REAL_MODES="eager",
        GPU_REAL_METHODS="vanilla,swift,prompt_lookup",
        GPU_EAGER_METHODS="vanilla,swift,prompt_lookup",
        GPU_REAL_EXTRA="--dtype float32 --categories qa --max-new-tokens 8",
    )
    proc = subprocess.run(
        ["bash", "docs/measurements/gpu_all.sh", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "replay tiny: rc 0" in proc.stdout and "real eager: rc 0" in proc.stdout, proc.stdout + proc.stderr
    assert "engine: rc 0" in proc.stdout and '"forward_exact"' in proc.stdout, proc.stdout
    replay = (tmp_path / "replay-tiny.md").read_text()
    assert "| smollm2-135m-instruct/clasp | graphs |" in replay
    assert "| qwen2.5-coder-0.5b/clasp | graphs |" in replay
    records = [
        json.loads(line) for line in (tmp_path / "real-eager" / "records.jsonl").read_text().splitlines()
    ]
    assert {r["method"] for r in records} == {"vanilla", "swift", "prompt_lookup"}


def test_snippet_sections_exist():
    includes = [
        (page, path, section)
        for page in DOCS.rglob("*.md")
        for path, section in _SNIPPET.findall(page.read_text(encoding="utf-8"))
    ]
    assert includes, "no snippet includes found: did the include syntax change?"
    for page, path, section in includes:
        target = ROOT / path
        assert target.is_file(), f"{page.relative_to(ROOT)} includes missing file {path}"
        if section:
            src = target.read_text(encoding="utf-8")
            for marker in (f"--8<-- [start:{section}]", f"--8<-- [end:{section}]"):
                assert marker in src, (
                    f"{page.relative_to(ROOT)} includes {path}:{section}, but {path} has no {marker!r}"
                )


def test_measurement_folders_hold_no_markdown_pages():
    """Raw reports under docs/measurements are .txt: a .md there is a page outside mkdocs' nav,
    which the strict docs build (CI) refuses."""
    pages = sorted(str(p.relative_to(ROOT)) for p in (DOCS / "measurements").rglob("*.md"))
    assert not pages, f"rename to .md.txt: {pages}"


def test_docstring_args_name_real_parameters(caplog):
    """Every ``Args:`` entry of a docstring names one parameter of its signature, as the strict
    docs build (CI) requires: ``a, b: ...`` on one line is a warning there, and the build fails.
    Checked on every object, public or not, in a few seconds, so the quick check catches it."""
    griffe = pytest.importorskip("griffe")

    def parse(obj) -> None:
        if obj.docstring is not None:
            obj.docstring.parse("google", warn_missing_types=False, warn_unknown_params=True)
        for member in obj.members.values():
            if not member.is_alias:
                parse(member)

    with caplog.at_level(logging.WARNING, logger="griffe"):
        for package in ("framework", "strategies", "selfspec"):
            parse(griffe.load(package, search_paths=[str(ROOT)]))
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("griffe")]
    assert not warnings, "\n".join(warnings)
