"""The files ``run.py`` and ``bench.py`` write keep their shape across refactors (issue 39, item 2).

`shape` reduces an output folder to what must not change: every file's name; every JSON, JSONL
and YAML key, with each value's type; the values that are deterministic on a tiny random model
(the prompts, the methods, the configuration); the headings and
table columns of the reports; the CSV tracker's metric names (the same keys go to W&B). Timings,
time stamps, the machine, the code's commit and the tokens decoded are reduced to their types.

The expected shapes (``data/output_shapes.json``) were written by the drivers before they
shared one module (commit b72c85a: ``PYTHONPATH=<its checkout> python
tests/experiments/test_output_compat.py --write``). The resume fixture (``data/resume/``) is a results file that
version wrote and an interruption cut short: the current runner must continue it.

Changed on purpose since: ``exact`` is a boolean, or null where unset (it was the string
auto/on/off; issue 48). A results file that wrote the string still resumes
(`framework.results.records.config_differences` reads it as the boolean), and so does a saved
config (``auto`` parses as unset). The generation section has the processors' settings
(``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``, ``bad_words``,
``suppress_tokens``, ``begin_suppress_tokens``, ``eos_token_ids``; issue 47): a results file
without them resumes as written with their neutral values. Added since (issues 47 and 48), each a new
key with a neutral value, nothing renamed or removed: the generation section's grammars
(``json_schema``, ``regex``, ``grammar``: null), the method section's ``imports`` (``[]``; a saved
configuration records ``{module, sha256}`` per module) and ``synthetic_acceptance`` (null), the
metadata's and the CSV logger's ``resolved`` (what ``auto`` settings resolved to), and the CSV
tracker's ``prompt/question_id`` and ``prompt/category`` columns. Migration: none needed; an older
results file resumes (its missing keys read as their neutral values) and an older saved
configuration loads (its missing keys keep their defaults).

Added by issue 55 (shapes regenerated, the resume fixture kept as the earlier version wrote it):
the compare section's ``synthetic`` (null: ``bench.py --synthetic-acceptance`` for every preset),
``cost_model.json``'s ``inconsistent`` (``""``: what stayed inconsistent on a loaded machine) and the
metadata's ``host_work`` (each speculative method's host work a round, counted in its first warm-up
decode). Nothing renamed or removed.

Changed on purpose by the one pipeline (issue 48; shapes regenerated then, the resume fixture kept
as the earlier version wrote it):

- ``run.py``: each record has ``repeat`` (0) and ``kind`` (``baseline``/``preset``); the metadata
  has ``prompts``, ``methods`` (what each method resolved to), ``load``, ``vanilla_repeat_spread``
  and ``warnings``, as the benchmark's had; ``<stem>/cost_model.json`` is new (the measured cost
  model, reusable with ``--cost-model``); the configuration (``.config.yaml``, the metadata, the
  tracker) has the ``compare`` section's keys at their neutral values (``methods: []`` is
  run.py's run).
- ``bench.py``: each record has ``rank``; ``config.yaml`` is new (``--config`` reruns the
  benchmark); the metadata's ``config`` is the whole `RunConfig` (``out`` is spelled ``output``,
  and the method section's defaults are there, unused) and it gains ``dtype_resolved``,
  ``method`` and ``resolved`` (per method); ``hf`` went: an HF method's description is its entry
  in ``methods``; the tracker's config is run.py's (the flat keys, ``provenance``, ``notes``,
  ``resolved``, ``methods`` nested), no longer the metadata flattened into ``a/b`` keys; the CSV
  tracker logs run.py's per-prompt rows too (``prompt/<method>_tokens_per_s``, ...); a method
  whose plan varies gets its skip-set plot.

Migration: a results file of the earlier ``run.py`` resumes (`read_records` reads a record
without ``repeat``/``kind`` as repeat 0 of a baseline or preset; the missing ``compare`` keys read
as their neutral values), and an earlier saved configuration loads (missing keys keep their
defaults). The earlier ``bench.py`` had no ``--resume``. A script that read ``meta["hf"]`` reads
``meta["methods"][name]``; one that read ``meta["config"]["out"]`` reads ``["output"]``; a W&B
query of the benchmark's ``config/a/b`` keys reads the nested ``a.b``.

Changed on purpose by issue 56 (one output contract; shapes regenerated, the resume fixture kept
as the earlier ``run.py`` wrote it):

- ``run.py`` writes ``bench.py``'s folder: ``--output DIR`` holds ``records.jsonl``, ``meta.json``,
  ``config.yaml``, ``bench.md`` (the benchmark's report, for one method as for several),
  ``cost_model.json``, the plots (``skip_<method>.png`` / ``exit_layer_<method>.png``, no longer
  ``plots/skip_sets.png`` / ``exit_layers.png``) and ``tracking/`` (the CSV or W&B logger). It
  used to write ``<stem>.jsonl`` beside ``<stem>.meta.json``, ``<stem>.config.yaml`` and
  ``<stem>.md``, with ``<stem>/`` for the plots, tracker and cost model. ``--output x.jsonl`` now
  names the folder ``x``; without ``--output`` the folder is ``runs/<method>-<time>``.
- ``run.py``'s metadata: ``notes`` and ``resolved`` are per method (``{method: ...}``), as the
  benchmark's were; its report's command line is the one that ran, and its configuration
  (``config.yaml``, the metadata's and the tracker's ``config``) records it as
  ``compare.command``, as ``bench.py``'s does (it was ``""``; ``--resume`` ignores it).
- The tracker logs one key set whatever the number of methods: per prompt
  ``prompt/<method>_tokens_per_s`` and, for each speculative method, ``prompt/<method>_speedup``,
  ``_M``, ``_alpha``, ``_lossless`` and its strategies' statistics as ``<method>/<kind>/<name>``;
  at the end ``<method>/speedup/<category>``, ``<method>/M``, ``<method>/alpha``, ... (``run.py``
  logged ``prompt/method_tokens_per_s``, ``prompt/speedup``, ``selector/...`` and
  ``summary/<category>/<metric>``).
- ``run()`` (the Python API) returns the benchmark's ``summary`` and ``{name: path}`` plots for
  every run; ``table`` is the report's results table; ``run_dir`` and ``breakdown`` went.

Migration: ``--resume`` with ``--output x.jsonl`` of an earlier ``run.py`` copies ``x.jsonl`` and
``x.meta.json`` into the folder ``x`` (as ``records.jsonl`` and ``meta.json``; the file stays)
and continues there (`framework.runner.pipeline.migrate_results_file`). A script that read
``x.jsonl`` reads ``x/records.jsonl`` (`framework.results.records.read_records` takes the folder
too); one that read ``summary/overall/speedup`` reads ``<method>/speedup/overall``; W&B charts of
``prompt/speedup`` chart ``prompt/<method>_speedup``.

Regenerate the shapes only when an output format changes on purpose:
``python tests/experiments/test_output_compat.py --write``.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from framework.results.records import read_records
from framework.runner.cli import bench_main
from framework.runner.cli import main as run_main

DATA = Path(__file__).with_name("data")
SHAPES = DATA / "output_shapes.json"
COMMON = ["--model", "tiny-random", "--limit", "1", "--max-new-tokens", "12", "--device", "cpu"]
COMMON += ["--dtype", "float32", "--logger", "csv", "--threads", "1"]
#: The draft gate off: its decisions follow measured costs, so what it drafts (and whether a
#: method has an alpha to report) would depend on the machine's speed.
NO_GATE = ["--gate.enabled", "false"]

#: The commands, by the folder they write into (``{out}``: that folder).
COMMANDS: dict[str, tuple[Any, list[str]]] = {
    "run": (
        run_main,
        [*COMMON, *NO_GATE, "--method", "static_confidence", "--output", "{out}"]
        + ["--specbench-answers", "{out}/answers"],
    ),
    "run_vanilla": (run_main, [*COMMON, "--method", "vanilla", "--no-plots", "--output", "{out}"]),
    "bench": (
        bench_main,
        [*COMMON, "--methods", "vanilla,static_confidence,hf_generate", "--out", "{out}"]
        + ["--preset-args", "static_confidence=" + " ".join(NO_GATE), "--specbench-answers", "{out}/answers"],
    ),
}

#: Keys whose scalar values (or lists of scalars) are deterministic on any machine and kept as
#: they are. The tokens and texts decoded are not among them: on a random model a near-tie may
#: fall the other way on another CPU (the resume test checks the method's tokens equal vanilla's).
KEEP = {
    "question_id",
    "category",
    "subcategory",
    "method",
    "kind",
    "repeat",
    "position",
    "lossless",
    "prompt_tokens",
    "model_id",
    "prompts",
}
#: Keys whose whole subtree is kept: the resolved configuration.
KEEP_TREE = {"config", "methods"}
#: Subtrees that depend on the machine or the code's version: their keys are not part of the format.
OPAQUE = {"environment", "provenance", "load", "cuda_graphs"}


def _value(value: Any, out: Path) -> Any:
    if isinstance(value, str):
        return value.replace(str(out), "<out>")
    return value


def _type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "str"
    return "list" if isinstance(value, list) else type(value).__name__


def _tree(obj: Any, out: Path, key: str = "", keep: bool = False) -> Any:
    """``obj`` with its undeterministic leaves replaced by their types."""
    if key in OPAQUE and isinstance(obj, dict):
        return "dict"
    if key.split("/", 1)[0] in OPAQUE and "/" in key:  # a tracker's flattened key: environment/cpu
        return "any"
    keep = keep or key in KEEP_TREE
    if isinstance(obj, tuple):
        obj = list(obj)
    if isinstance(obj, dict):
        return {
            str(k): _tree(v, out, str(k), keep) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))
        }
    scalar = obj is None or isinstance(obj, (str, int, float, bool))
    if isinstance(obj, list) and not all(x is None or isinstance(x, (str, int, float, bool)) for x in obj):
        return [_tree(x, out, key, keep) for x in obj]
    if keep or key in KEEP:
        return [_value(x, out) for x in obj] if isinstance(obj, list) else _value(obj, out)
    return _type(obj) if scalar or isinstance(obj, list) else repr(type(obj))


def _markdown(text: str) -> list[str]:
    """A report's headings and the header rows of its tables."""
    lines = text.splitlines()
    keep = [ln for ln in lines if ln.startswith("#")]
    headers = [lines[i - 1] for i, ln in enumerate(lines) if i and ln.startswith("| ---")]
    return keep + [" | ".join(cell.strip() for cell in row.strip("|").split("|")) for row in headers]


def shape(out: Path) -> dict[str, Any]:
    """The shape of every file under ``out`` (see the module's docstring)."""
    files: dict[str, Any] = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        name = str(path.relative_to(out))
        if path.suffix == ".jsonl":
            files[name] = [_tree(json.loads(ln), out) for ln in path.read_text().splitlines() if ln.strip()]
        elif path.suffix == ".json":
            files[name] = _tree(json.loads(path.read_text()), out)
        elif path.suffix == ".yaml":
            # Lightning's hparams.yaml tags tuples as Python objects
            data = yaml.load(path.read_text(), Loader=yaml.Loader)  # noqa: S506 - our own file
            files[name] = _tree(data, out, keep=path.name.endswith("config.yaml"))
        elif path.suffix == ".md":
            files[name] = _markdown(path.read_text())
        elif path.suffix == ".csv":
            with path.open() as fh:
                files[name] = sorted(next(csv.reader(fh)))
        else:
            files[name] = path.suffix
    return files


def write_outputs(root: Path) -> dict[str, Any]:
    """Run every command into ``root/<name>``; returns ``{name: shape}``."""
    shapes = {}
    for name, (main, argv) in COMMANDS.items():
        out = root / name
        out.mkdir(parents=True)
        assert main([a.replace("{out}", str(out)) for a in argv]) == 0, name
        shapes[name] = shape(out)
    return shapes


@pytest.mark.slow
def test_run_and_bench_write_the_files_the_previous_version_wrote(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = write_outputs(tmp_path / "out")
    want = json.loads(SHAPES.read_text())
    for name in COMMANDS:
        assert sorted(got[name]) == sorted(want[name]), f"{name}: the files written changed"
        for file, expected in want[name].items():
            assert got[name][file] == expected, f"{name}/{file} changed its format"


def test_run_and_bench_write_one_folder_shape():
    """Issue 56: run.py (one method) and bench.py (several) write the same files, the same
    metadata keys, the same report headings and the same tracker columns per method."""
    want = json.loads(SHAPES.read_text())
    run, bench = want["run"], want["bench"]
    assert set(run) == set(bench) - {"answers/hf_generate.jsonl"}
    assert set(run["meta.json"]) == set(bench["meta.json"])
    assert [h for h in run["bench.md"] if h.startswith("#")] == [
        h for h in bench["bench.md"] if h.startswith("#")
    ]
    run_cols, bench_cols = set(run["tracking/csv/metrics.csv"]), set(bench["tracking/csv/metrics.csv"])
    assert run_cols and run_cols <= bench_cols | {c for c in run_cols if "static_confidence" in c}
    assert {c for c in bench_cols if "static_confidence" in c} == {
        c for c in run_cols if "static_confidence" in c
    }


def test_a_results_file_of_the_previous_version_resumes(tmp_path, monkeypatch, capsys):
    """The fixture is a results file as ``run.py`` wrote it before issue 56 (``out.jsonl`` beside
    ``out.meta.json``): ``--output out.jsonl --resume`` continues it in the folder ``out``."""
    monkeypatch.chdir(tmp_path)
    for f in (DATA / "resume").iterdir():
        shutil.copy(f, tmp_path / f.name)
    before = read_records(tmp_path / "out.jsonl")
    done = {(r["question_id"], r["method"]) for r in before}
    argv = [*COMMON, *NO_GATE, "--method", "static_confidence", "--no-plots", "--output", "out.jsonl"]
    argv.append("--resume")
    assert run_main(argv) == 0
    said = capsys.readouterr().out
    assert "out.jsonl (an earlier run.py's results file) continues in the folder out" in said
    assert f"{len(done) // 2} of 7 prompts already in out/records.jsonl" in said
    assert read_records(tmp_path / "out.jsonl") == before  # the earlier file stays as it was
    after = read_records(tmp_path / "out")
    assert after[: len(before)] == before  # kept as written
    assert len({(r["question_id"], r["method"]) for r in after}) == 14
    for qid in {r["question_id"] for r in after}:
        pair = {r["method"]: r["turns"] for r in after if r["question_id"] == qid}
        assert [t["tokens"] for t in pair["vanilla"]] == [t["tokens"] for t in pair["static_confidence"]]


def _write_fixtures() -> None:  # pragma: no cover - run by hand when a format changes on purpose
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        shapes = write_outputs(Path(tmp) / "out")
        SHAPES.write_text(json.dumps(shapes, indent=1, sort_keys=True) + "\n")
    # the resume fixture (data/resume/) stays as run.py wrote it before issue 56: a results file
    print(f"wrote {SHAPES}")


if __name__ == "__main__":  # pragma: no cover
    if sys.argv[1:] == ["--write"]:
        _write_fixtures()
    else:
        sys.exit("usage: python tests/experiments/test_output_compat.py --write")
