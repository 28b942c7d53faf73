"""Fixtures of the runner-level tests (runner, Lightning loop, tracking)."""

from __future__ import annotations

import pytest

from framework.testing import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tiny():
    """A 4-block random Llama with the word-level tiny tokenizer (vocabulary 128), for `run()`."""
    return tiny_model("llama", num_layers=4, vocab_size=128, max_position_embeddings=256), tiny_tokenizer()
