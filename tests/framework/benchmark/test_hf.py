"""The Hugging Face methods of the benchmark keep Hugging Face's own internal chatter off the
user's terminal, and nothing else."""

from __future__ import annotations

import logging

import pytest
from transformers.utils import logging as hf_logging

from framework.benchmark.hf import HFGenerateDecoder
from framework.engine.decoding import StopCondition
from framework.testing import random_prompt, tiny_model


@pytest.fixture
def captured_transformers_logs():
    """Every record transformers' generation logger lets through, after its filters."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("transformers.generation.utils")
    handler = Keep(level=logging.WARNING)
    log.addHandler(handler)
    hf_logging.warning_once.cache_clear()  # a message logged earlier in the process would be skipped
    yield records
    log.removeHandler(handler)


def test_early_exit_generation_does_not_print_hf_internal_deprecations(captured_transformers_logs):
    model = tiny_model("llama", num_layers=4, seed=0).float()
    dec = HFGenerateDecoder(model, "hf_early_exit", early_exit_layer=2)
    res = dec.generate(random_prompt(8, 128, 0), StopCondition(12))
    assert res.new_tokens == 12
    assert not [m for m in captured_transformers_logs if "generation_config" in m]
    # Other messages still get through: the filter is removed after the call.
    logging.getLogger("transformers.generation.utils").warning("a message of ours")
    assert "a message of ours" in captured_transformers_logs
