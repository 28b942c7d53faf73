"""Prompt loading: the built-in suite, Spec-Bench-format JSONL, errors with file:line."""

from __future__ import annotations

import json

import pytest

from framework.data.prompts import DataError, encode_chat, load_prompts, read_jsonl

SPEC_BENCH_CATEGORIES = {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}


def write(tmp_path, lines, name="q.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def test_builtin_suite_covers_every_category_with_five_prompts():
    prompts = load_prompts()
    counts = {}
    for p in prompts:
        counts[p.category] = counts.get(p.category, 0) + 1
    assert SPEC_BENCH_CATEGORIES | {"code"} <= set(counts)
    assert all(n >= 5 for n in counts.values()), counts
    assert all(len(p.turns) == 2 for p in prompts if p.category == "mt_bench")
    assert len({p.question_id for p in prompts}) == len(prompts)


def test_mt_bench_categories_are_grouped_and_selectable_both_ways(tmp_path):
    path = write(
        tmp_path,
        [
            json.dumps({"question_id": 81, "category": "writing", "turns": ["a", "b"]}),
            json.dumps({"question_id": 82, "category": "roleplay", "turns": ["c"]}),
            json.dumps({"question_id": 1, "category": "qa", "turns": ["d"], "reference": ["x"]}),
        ],
    )
    prompts = load_prompts(path)
    assert [p.category for p in prompts] == ["mt_bench", "mt_bench", "qa"]
    assert [p.subcategory for p in prompts] == ["writing", "roleplay", "qa"]
    assert [p.question_id for p in load_prompts(path, categories=["writing"])] == [81]
    assert [p.question_id for p in load_prompts(path, categories=["mt_bench"])] == [81, 82]


def test_limit_is_per_category(tmp_path):
    lines = [
        json.dumps({"question_id": i, "category": "qa" if i % 2 else "rag", "turns": [f"q{i}"]})
        for i in range(10)
    ]
    prompts = load_prompts(write(tmp_path, lines), limit=2)
    assert [p.question_id for p in prompts] == [0, 1, 2, 3]


def test_offset_skips_the_first_prompts_of_each_category_before_the_limit(tmp_path):
    lines = [
        json.dumps({"question_id": i, "category": "qa" if i % 2 else "rag", "turns": [f"q{i}"]})
        for i in range(10)
    ]
    path = write(tmp_path, lines)
    assert [p.question_id for p in load_prompts(path, limit=1, offset=2)] == [4, 5]  # the third of each
    assert [p.question_id for p in load_prompts(path, offset=3)] == [6, 7, 8, 9]  # no limit: the rest
    assert [p.question_id for p in load_prompts(path, limit=2, offset=4)] == [8, 9]  # what is left
    with pytest.raises(DataError, match="--offset must be >= 0"):
        load_prompts(path, offset=-1)
    with pytest.raises(DataError, match="selection is empty"):
        load_prompts(path, offset=5)


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"category": "qa", "turns": ["x"]}), "missing key 'question_id'"),
        (
            json.dumps({"question_id": 1, "category": "", "turns": ["x"]}),
            "category must be a non-empty string",
        ),
        (json.dumps({"question_id": 1, "category": "qa", "turns": []}), "turns must be a non-empty list"),
        (json.dumps({"question_id": 1, "category": "qa", "turns": ["  "]}), "turn 0 is empty"),
        (json.dumps({"question_id": True, "category": "qa", "turns": ["x"]}), "question_id must be"),
    ],
)
def test_malformed_lines_report_file_and_line(tmp_path, line, fragment):
    good = json.dumps({"question_id": 0, "category": "qa", "turns": ["fine"]})
    path = write(tmp_path, [good, "", line])
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    assert f"{path}:3" in str(err.value)
    assert fragment in str(err.value)


def test_duplicate_ids_empty_files_and_missing_files(tmp_path):
    row = json.dumps({"question_id": 5, "category": "qa", "turns": ["x"]})
    with pytest.raises(DataError, match=r":2: duplicate question_id 5 \(first on line 1\)"):
        read_jsonl(write(tmp_path, [row, row]))
    with pytest.raises(DataError, match="contains no prompts"):
        read_jsonl(write(tmp_path, ["", "  "], "empty.jsonl"))
    with pytest.raises(DataError, match="no such file"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_unknown_category_lists_available_and_bad_limit(tmp_path):
    path = write(tmp_path, [json.dumps({"question_id": 1, "category": "qa", "turns": ["x"]})])
    with pytest.raises(DataError, match="unknown 'nope'; available: qa"):
        load_prompts(path, categories=["nope"])
    with pytest.raises(DataError, match="--limit must be >= 1"):
        load_prompts(path, limit=0)


def test_encode_chat_uses_the_template_and_falls_back_without_one():
    class Templated:
        chat_template = "x"

        def apply_chat_template(self, messages, add_generation_prompt):
            assert add_generation_prompt
            return {"input_ids": [1, 2, len(messages)]}

    class Plain:
        chat_template = None

        def __call__(self, text):
            return {"input_ids": [ord(c) for c in text]}

    assert encode_chat(Templated(), [{"role": "user", "content": "hi"}]) == [1, 2, 1]
    ids = encode_chat(Plain(), [{"role": "user", "content": "hi"}])
    assert "".join(map(chr, ids)) == "User: hi\nAssistant:"
