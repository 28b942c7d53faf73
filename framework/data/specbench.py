"""Spec-Bench answer files: our results records in the format Spec-Bench's own evaluation reads.

Spec-Bench (Xia et al., 2024) compares methods with ``evaluation/speed.py`` (speedup, mean
accepted tokens) and ``evaluation/equal.py`` (are two methods' answers identical), which read one
answer file per method, one JSON line per question. `write_answer_files` turns the records of a
results JSONL (``run.py``'s ``--output``, ``bench.py``'s ``records.jsonl``; several methods in one
file, told apart by ``method``) into such files, ``<dir>/<method>.jsonl``: ``vanilla.jsonl`` is the
baseline. With several repeats (``bench.py --repeats N``) each repeat gets its own directory,
``<dir>/run_1/``, ..., ``<dir>/run_N/``, as Spec-Bench keeps its runs.

One line (keys as Spec-Bench's ``evaluation/eval.py`` writes them)::

    {"question_id": 81, "category": "writing", "answer_id": "...", "model_id": "<model>-<method>",
     "tstamp": 1700000000.0, "choices": [{"index": 0, "turns": ["answer 1", "answer 2"],
     "decoding_steps": [40, 35], "new_tokens": [128, 97], "wall_time": [2.1, 1.7],
     "accept_lengths": [3, 1, 4, ...]}]}

- ``category`` is the category as written in the question file (our records' ``subcategory``:
  ``writing``, not our reporting group ``mt_bench``), which ``speed.py`` filters on;
- ``turns``, ``decoding_steps``, ``new_tokens``, ``wall_time``: one entry per turn (the turn's
  text, verification rounds, new tokens, seconds);
- ``accept_lengths``: **one flat list over all turns** of the tokens committed per verification
  round (accepted draft tokens + 1, the bonus token included), as Spec-Bench's ``eval.py`` extends
  it turn after turn and ``speed.py`` averages it into "mean accepted tokens". This is exactly what
  our turns record (`GenerationResult.accept_lengths`), so it is copied unchanged and the mean is
  our M. The token the prefill yields is in no round (our convention; Spec-Bench's own baseline
  counts it as a step of 1): vanilla's list is ``[1] * (new_tokens - 1)`` per turn, every step
  commits one token and its mean is 1.

Lines are sorted by question id (``equal.py`` compares two files line by line); a question decoded
twice (a resumed run) keeps its last record; records of a failed method (``error``) are left out.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from framework.config_fields import ConfigError

#: The flag that turns the answer files on (``run.py`` and ``bench.py``).
FLAG = "--specbench-answers"
#: The baseline's file (``speed.py --base-path``).
BASELINE_FILE = "vanilla.jsonl"
#: Keys of an answer line and of its ``choices[0]``.
ANSWER_KEYS = ("question_id", "category", "answer_id", "model_id", "tstamp", "choices")
CHOICE_KEYS = ("index", "turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths")


class AnswerFileError(ValueError):
    """A file that is not a valid Spec-Bench answer file (the message names ``file:line``)."""


def file_name(method: str) -> str:
    """The answer file of ``method``: its label with characters other than letters, digits,
    ``-``, ``_``, ``+`` and ``.`` replaced by ``_`` (``swift_safe:raw`` -> ``swift_safe_raw.jsonl``)."""
    safe = "".join(ch if ch.isalnum() or ch in "-_+." else "_" for ch in method)
    return f"{safe}.jsonl"


def answer_path(directory: str | Path, method: str, repeat: int | None = None) -> Path:
    """Where `write_answer_files` puts ``method``'s file: ``<directory>/<method>.jsonl``, or
    ``<directory>/run_<repeat + 1>/<method>.jsonl`` for one repeat of several."""
    base = Path(directory) if repeat is None else Path(directory) / f"run_{repeat + 1}"
    return base / file_name(method)


def model_id(method: str, model: str | None = None) -> str:
    """Spec-Bench's ``model_id``: ``<model>-<method>`` (the model's last path component), or the
    method alone when the model is unknown."""
    return f"{Path(model).name}-{method}" if model else method


def _qid_key(qid: Any) -> tuple[int, float, str]:
    """Integer ids in numeric order, then the others as strings."""
    if isinstance(qid, int) and not isinstance(qid, bool):
        return (0, qid, "")
    return (1, 0, str(qid))


def answer_record(
    rec: dict[str, Any], model: str | None = None, tstamp: float | None = None
) -> dict[str, Any]:
    """One answer line from one of our records (a prompt decoded by one method; see the module
    docstring for the fields)."""
    turns = rec["turns"]
    mid = model_id(rec["method"], model)
    return {
        "question_id": rec["question_id"],
        "category": rec.get("subcategory") or rec["category"],
        "answer_id": uuid.uuid5(
            uuid.NAMESPACE_URL, f"selfspec/{mid}/{rec.get('repeat', 0)}/{rec['question_id']}"
        ).hex,
        "model_id": mid,
        "tstamp": time.time() if tstamp is None else tstamp,
        "choices": [
            {
                "index": 0,
                "turns": [t["text"] for t in turns],
                "decoding_steps": [len(t.get("accept_lengths") or []) for t in turns],
                "new_tokens": [int(t["new_tokens"]) for t in turns],
                "wall_time": [float(t["wall_time"]) for t in turns],
                "accept_lengths": [int(a) for t in turns for a in t.get("accept_lengths") or []],
            }
        ],
    }


def answer_files(
    records: Iterable[dict[str, Any]], model: str | None = None, tstamp: float | None = None
) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """``{repeat: {method: answer lines sorted by question id}}`` from results records (a run's
    records have no ``repeat``: 0). Failed methods' ``error`` records are left out; a question
    recorded twice for a method and repeat keeps its last record."""
    last: dict[int, dict[str, dict[str, dict[str, Any]]]] = {}
    for rec in records:
        if rec.get("error") or "turns" not in rec:
            continue
        by_qid = last.setdefault(int(rec.get("repeat", 0)), {}).setdefault(rec["method"], {})
        by_qid[str(rec["question_id"])] = rec
    return {
        rep: {
            method: [
                answer_record(r, model, tstamp)
                for r in sorted(by_qid.values(), key=lambda r: _qid_key(r["question_id"]))
            ]
            for method, by_qid in methods.items()
        }
        for rep, methods in sorted(last.items())
    }


def check_answer_dir(
    directory: str | Path | None, methods: Sequence[str] = (), protect: Iterable[str | Path] = ()
) -> Path | None:
    """Validate ``--specbench-answers`` before a run writes anything; ``None`` when it is off.

    Raises:
        ConfigError: the path (or a parent) is an existing file, two methods would share an answer
            file, or an answer file would overwrite a file in ``protect`` (the results file).
    """
    if not directory:
        return None
    path = Path(directory)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise ConfigError(FLAG, str(directory), f"a directory for the answer files ({p} is a file)")
            break
    names: dict[str, str] = {}
    for m in methods:
        other = names.setdefault(file_name(m), m)
        if other != m:
            raise ConfigError(
                FLAG, str(directory), f"a run whose methods have distinct file names ({other!r} and {m!r})"
            )
    guarded = {Path(p).resolve() for p in protect}
    for name in names:
        for candidate in (path / name, path / "run_1" / name):
            if candidate.resolve() in guarded:
                raise ConfigError(
                    FLAG,
                    str(directory),
                    f"a directory where no answer file overwrites the results file {candidate}",
                )
    return path


def write_answer_files(
    records: Iterable[dict[str, Any]],
    directory: str | Path,
    *,
    model: str | None = None,
    repeats: int | None = None,
    protect: Iterable[str | Path] = (),
) -> dict[str, Path]:
    """Write the Spec-Bench answer files of ``records`` (as `read_records` returns them) into
    ``directory``, each file rewritten whole: ``<method>.jsonl`` with one repeat, else
    ``run_<r>/<method>.jsonl`` per repeat. Returns ``{"<method>" or "run_<r>/<method>": path}``.

    Args:
        records: the results records (several methods, optionally several repeats).
        directory: where the files go (created).
        model: the model's name, for ``model_id`` (`model_name`).
        repeats: the run's repeats (``run_<r>/`` directories when > 1, even for an interrupted
            run that finished one); default: as many as the records hold.
        protect: files never to overwrite (the results file).

    Raises:
        ConfigError: as `check_answer_dir`.
    """
    records = list(records)
    synthetic = sorted({str(r.get("method")) for r in records if r.get("synthetic_acceptance") is not None})
    if synthetic:
        raise AnswerFileError(
            f"no Spec-Bench answer files for a synthetic acceptance ({', '.join(synthetic)}): its output is "
            "not the model's"
        )
    files = answer_files(records, model)
    methods = sorted({m for by_method in files.values() for m in by_method})
    check_answer_dir(directory, methods, protect)
    out: dict[str, Path] = {}
    several = (repeats or len(files)) > 1
    for rep, by_method in files.items():
        for method, lines in by_method.items():
            path = answer_path(directory, method, rep if several else None)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
            tmp.replace(path)
            out[f"run_{rep + 1}/{method}" if several else method] = path
    return out


@contextlib.contextmanager
def written_on_interrupt(write: Callable[[], Any] | None) -> Iterator[None]:
    """Call ``write`` (e.g. a `write_answer_files` of the records so far) when the block is
    interrupted by Ctrl-C, then let the interruption go on; ``None``: nothing to write."""
    try:
        yield
    except KeyboardInterrupt:
        if write is not None:
            write()
        raise


def _fail(where: str, msg: str) -> AnswerFileError:
    return AnswerFileError(f"{where}: {msg}")


def _check_line(obj: Any, where: str) -> None:
    if not isinstance(obj, dict):
        raise _fail(where, f"expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ANSWER_KEYS if k not in obj]
    if missing:
        raise _fail(where, f"missing key(s) {missing}")
    if not isinstance(obj["category"], str) or not obj["category"]:
        raise _fail(where, "category must be a non-empty string")
    choices = obj["choices"]
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _fail(where, "choices must be a non-empty list of objects")
    c = choices[0]
    missing = [k for k in CHOICE_KEYS if k not in c and k != "decoding_steps"]
    if missing:
        raise _fail(where, f"choices[0] is missing key(s) {missing}")
    if c["index"] != 0:
        raise _fail(where, f"choices[0].index must be 0, got {c['index']!r}")
    turns = c["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise _fail(where, "choices[0].turns must be a non-empty list of strings")
    for key in ("new_tokens", "wall_time", "decoding_steps"):
        if key not in c:
            continue
        vals = c[key]
        if not isinstance(vals, list) or len(vals) != len(turns):
            raise _fail(where, f"choices[0].{key} must be a list with one entry per turn ({len(turns)})")
        for v in vals:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            if not ok or (key != "wall_time" and not isinstance(v, int)):
                raise _fail(where, f"choices[0].{key} holds {v!r}")
    acc = c["accept_lengths"]
    if not isinstance(acc, list) or not all(
        isinstance(a, int) and not isinstance(a, bool) and a >= 1 for a in acc
    ):
        raise _fail(where, "choices[0].accept_lengths must be a flat list of integers >= 1 (one per step)")


def read_answer_file(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a Spec-Bench answer file, validated: every key Spec-Bench's evaluation reads,
    per-turn lists as long as ``turns``, a flat ``accept_lengths`` of integers >= 1, distinct
    question ids.

    Raises:
        AnswerFileError: a missing file or an invalid line (``file:line``).
    """
    path = Path(path)
    if not path.is_file():
        raise AnswerFileError(f"{path}: no such answer file")
    out: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise _fail(where, f"not valid JSON ({err.msg})") from None
        _check_line(obj, where)
        qid = str(obj["question_id"])
        if qid in seen:
            raise _fail(where, f"duplicate question_id {obj['question_id']!r} (first on line {seen[qid]})")
        seen[qid] = lineno
        out.append(obj)
    return out


__all__ = [
    "BASELINE_FILE",
    "FLAG",
    "AnswerFileError",
    "answer_files",
    "answer_path",
    "answer_record",
    "check_answer_dir",
    "file_name",
    "model_id",
    "read_answer_file",
    "write_answer_files",
    "written_on_interrupt",
]
