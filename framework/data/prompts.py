"""Prompts: the built-in suite and any JSONL file in Spec-Bench's ``question.jsonl`` format.

One JSON object per line::

    {"question_id": 81, "category": "writing", "turns": ["first user message", "follow-up"]}

An optional ``"json_schema"`` (a JSON object) constrains the answers to that schema (the
structured-output task set, `BUILTIN_STRUCTURED`). ``reference`` and other extra keys are ignored. Spec-Bench's eight MT-Bench categories (writing,
roleplay, reasoning, math, coding, extraction, stem, humanities) are grouped as ``mt_bench``, as
Spec-Bench reports them; ``--categories`` accepts either the group or the original category.
Lines are validated here (errors name ``file:line``) and the records are held in a
`datasets.Dataset`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework.utils import require

BUILTIN_PROMPTS = Path(__file__).parent / "assets" / "prompts.jsonl"
#: Eight prompts (one per category, two for mt_bench) disjoint from the built-in suite: the default
#: calibration set of offline searches (``selfsd_bo``), so that a search never sees a test prompt.
BUILTIN_CALIBRATION = Path(__file__).parent / "assets" / "calibration.jsonl"
#: The structured-output task set (``--data structured``): each prompt asks for JSON that matches
#: its own ``json_schema`` (extraction, form filling, function-call arguments).
BUILTIN_STRUCTURED = Path(__file__).parent / "assets" / "structured.jsonl"
#: Names ``--data`` accepts for the built-in files.
BUILTIN_SETS = {"structured": BUILTIN_STRUCTURED}
MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)
#: Spec-Bench's reporting order; other categories (e.g. our ``code``) follow alphabetically.
CATEGORY_ORDER = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


class DataError(ValueError):
    """A prompt file or a prompt selection is unusable (the message names file:line or the flag)."""


@dataclass(frozen=True)
class Prompt:
    """One benchmark question.

    Attributes:
        question_id: the file's id (unique within a file).
        category: the reporting group (``mt_bench`` for the MT-Bench categories).
        subcategory: the category as written in the file.
        turns: user messages; each turn is answered before the next is asked.
        json_schema: the JSON text of a schema every answer must match, or ``None``.
    """

    question_id: int | str
    category: str
    subcategory: str
    turns: tuple[str, ...]
    json_schema: str | None = None


def _parse_line(line: str, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("question_id", "category", "turns"):
        if key not in obj:
            raise DataError(f"{where}: missing key {key!r} (need question_id, category, turns)")
    qid, cat, turns = obj["question_id"], obj["category"], obj["turns"]
    if not isinstance(qid, (int, str)) or isinstance(qid, bool):
        raise DataError(f"{where}: question_id must be an integer or string, got {qid!r}")
    if not isinstance(cat, str) or not cat.strip():
        raise DataError(f"{where}: category must be a non-empty string, got {cat!r}")
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: turns must be a non-empty list of strings")
    for i, t in enumerate(turns):
        if not isinstance(t, str) or not t.strip():
            raise DataError(f"{where}: turn {i} is empty or not a string")
    schema = obj.get("json_schema")
    if schema is not None and not isinstance(schema, dict):
        raise DataError(f"{where}: json_schema must be a JSON object, got {type(schema).__name__}")
    group = "mt_bench" if cat in MT_BENCH_CATEGORIES else cat
    return {
        "question_id": str(qid),
        "qid_is_int": isinstance(qid, int),
        "category": group,
        "subcategory": cat,
        "turns": turns,
        "json_schema": None if schema is None else json.dumps(schema),
    }


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read and validate a Spec-Bench-format JSONL file.

    Raises:
        DataError: unreadable file, malformed line (``file:line``), duplicate question_id, or no
            prompts at all.
    """
    path = BUILTIN_SETS.get(str(path), Path(path))
    if not path.is_file():
        raise DataError(f"--data {str(path)!r}: no such file")
    records, seen = [], {}
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            rec = _parse_line(line, f"{path}:{lineno}")
            if rec["question_id"] in seen:
                raise DataError(
                    f"{path}:{lineno}: duplicate question_id {rec['question_id']} (first on line {seen[rec['question_id']]})"
                )
            seen[rec["question_id"]] = lineno
            records.append(rec)
    if not records:
        raise DataError(f"--data {str(path)!r}: the file contains no prompts")
    return records


def category_sort_key(cat: str) -> tuple[int, str]:
    return (CATEGORY_ORDER.index(cat), "") if cat in CATEGORY_ORDER else (len(CATEGORY_ORDER), cat)


def load_prompts(
    path: str | Path | None = None,
    categories: Sequence[str] | None = None,
    limit: int | None = None,
    offset: int = 0,
) -> list[Prompt]:
    """Load prompts through `datasets`, filtered by category, at most ``limit`` per category.

    Args:
        path: a JSONL file; ``None`` for the built-in suite.
        categories: keep these groups (``mt_bench``) or original categories (``writing``).
        limit: at most this many prompts per category (file order), ``None`` for all.
        offset: skip the first ``offset`` prompts of each category (file order) before ``limit``
            counts: prompts a configuration was not tuned on (``--limit 1 --offset 5``).

    Raises:
        DataError: bad file, unknown category (the message lists the available ones), limit < 1,
            offset < 0, or an empty selection.
    """
    datasets = require("datasets", "datasets")
    records = read_jsonl(BUILTIN_PROMPTS if path is None else path)
    ds = datasets.Dataset.from_list(records)
    if categories:
        available = sorted(set(ds["category"]) | set(ds["subcategory"]))
        unknown = [c for c in categories if c not in available]
        if unknown:
            raise DataError(
                f"--categories: unknown {', '.join(map(repr, unknown))}; available: {', '.join(available)}"
            )
        wanted = set(categories)
        ds = ds.filter(lambda r: r["category"] in wanted or r["subcategory"] in wanted)
    if limit is not None and limit < 1:
        raise DataError(f"--limit must be >= 1, got {limit}")
    if offset < 0:
        raise DataError(f"--offset must be >= 0, got {offset}")
    if limit is not None or offset:
        counts: dict[str, int] = {}
        keep = []
        for i, cat in enumerate(ds["category"]):
            counts[cat] = counts.get(cat, 0) + 1
            if counts[cat] > offset and (limit is None or counts[cat] <= offset + limit):
                keep.append(i)
        ds = ds.select(keep)
    if len(ds) == 0:
        raise DataError("the prompt selection is empty (check --data / --categories)")
    return [
        Prompt(
            int(r["question_id"]) if r["qid_is_int"] else r["question_id"],
            r["category"],
            r["subcategory"],
            tuple(r["turns"]),
            r["json_schema"],
        )
        for r in ds
    ]


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation with the model's chat template and a generation prompt.

    Falls back to a plain ``User:``/``Assistant:`` layout when the tokenizer has no template.
    """
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return list(ids)
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
    return list(tokenizer(text)["input_ids"])


#: End-of-turn markers of common chat templates; any that the tokenizer knows as a single token
#: is used as an extra EOS id.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


def stop_token_ids(tokenizer: Any, model_config: Any = None) -> list[int]:
    """EOS ids: the tokenizer's and generation config's EOS plus single-token end-of-turn markers."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model_config, "eos_token_id", None)
    if isinstance(gen, int):
        ids.add(gen)
    elif isinstance(gen, (list, tuple)):
        ids.update(int(x) for x in gen)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    template = getattr(tokenizer, "chat_template", None) or ""
    for marker in END_OF_TURN_TOKENS:
        if marker in vocab and marker in template:
            ids.add(int(vocab[marker]))
    return sorted(ids)


def calibration_texts(source: str = "", categories: tuple[str, ...] = ()) -> list[str]:
    """The first turns of ``source`` (a Spec-Bench JSONL file; empty: the built-in calibration
    set), filtered by category: what `PrepareContext.load_prompts` serves to strategies.

    Raises:
        DataError: as `load_prompts`.
    """
    return [p.turns[0] for p in load_prompts(source or BUILTIN_CALIBRATION, categories or None)]
