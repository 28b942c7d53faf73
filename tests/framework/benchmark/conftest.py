"""Fixtures of the benchmark tests: a tiny random model and a small Spec-Bench-format prompt file."""

from __future__ import annotations

import json

import pytest

from framework.testing import tiny_model, tiny_tokenizer

VOCAB = 128


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", num_layers=4, vocab_size=VOCAB, max_position_embeddings=256)
    return model, tiny_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["w1 w2 w3 w4", "w5 w6"]},
        {"question_id": 2, "category": "qa", "turns": ["w7 w8 w9 w7 w8 w9"]},
        {"question_id": 3, "category": "qa", "turns": ["w10 w11 w12 w13 w14"]},
        {"question_id": 4, "category": "rag", "turns": ["w20 w21 w22"]},
    ]
    p = tmp_path_factory.mktemp("data") / "question.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p
