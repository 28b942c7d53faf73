"""Fixtures of the runner's tests."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def data(tmp_path):
    """Five one-turn prompts in two categories (qa: 1, 2, 5; rag: 3, 4), as a JSONL file (a test
    module may define a `data` of its own)."""
    rows = [
        {"question_id": i, "category": cat, "turns": [f"w{i} w{i + 1} w{i + 2}"]}
        for i, cat in zip(range(1, 6), ["qa", "qa", "rag", "rag", "qa"], strict=True)
    ]
    p = tmp_path / "q.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p
