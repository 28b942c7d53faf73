"""What a configuration leaves to the run is logged as it resolved (issue 48, item 8):
``draft_weights: auto`` appears in the metadata as the format the drafts run."""

from __future__ import annotations

import torch

from framework.session.presets import load_preset
from framework.session.run_config import RunConfig
from framework.session.session import Session
from framework.testing import fast_overrides, tiny_model, tiny_tokenizer


def test_auto_draft_weights_are_recorded_as_they_resolved():
    preset = load_preset("static_confidence")
    cfg = RunConfig.from_preset(
        "static_confidence", max_new_tokens=8, **fast_overrides(preset), **{"drafter.draft_vocab": 64}
    )
    assert cfg.method.drafter.config.draft_weights == "auto"
    model = tiny_model("llama", num_layers=6, seed=9, dtype=torch.float32, vocab_size=512)
    exp = Session(cfg, model, tiny_tokenizer(512), log=lambda _m: None)
    got = exp.resolved()
    assert got["drafter.draft_weights"] != "auto" and got["drafter.draft_weights"] == (
        exp.spec.drafter.draft_weights().weights
        if exp.spec.drafter.draft_weights()
        else "float32 (the model's own)"
    )
    assert got["drafter.draft_vocab"] == exp.spec.drafter.draft_head().size > 0
    vanilla = Session(RunConfig.from_preset("vanilla"), model, tiny_tokenizer(512), log=lambda _m: None)
    assert vanilla.resolved() == {}
