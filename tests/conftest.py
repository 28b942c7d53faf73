"""Shared fixtures: tiny random models per architecture (float64, built once per session).

The built-in strategies are registered at import time, before collection, so that tests can
parametrize over the registries (a newly registered strategy is then covered automatically).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `pytest` as well as `python -m pytest` from the repo root
    sys.path.insert(0, str(_ROOT))

from framework.engine.adapter import adapter_for  # noqa: E402
from framework.testing import ARCHS, cached_tiny_model, tiny_model  # noqa: E402

# The tiny models' matmuls are far too small to gain from intra-op threads; on a small or busy CPU
# the thread hand-offs cost several times the arithmetic (measured: 5x slower with 2 threads).
torch.set_num_threads(1)

# Tests never talk to a W&B server, even on a machine logged in to one (tests that check the
# automatic online/offline choice clear this themselves).
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, torch.nn.Module]:
    """{arch: 4-layer float64 random model} for every arch in ARCHS (shared; do not mutate)."""
    return {arch: cached_tiny_model(arch, 4) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> torch.nn.Module:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def llama_adapter(tiny_llama):
    return adapter_for(tiny_llama)


@pytest.fixture(scope="session")
def adapters(tiny_models) -> dict:
    """{arch: ModelAdapter} over the session's tiny models."""
    return {arch: adapter_for(m) for arch, m in tiny_models.items()}


@pytest.fixture(scope="session")
def deep_adapters() -> dict:
    """{arch: adapter} over 6-layer models, where the default static selector skips a sub-layer
    (on 4 layers its default ratio 0.2 rounds down to skipping nothing)."""
    return {
        arch: adapter_for(tiny_model(arch, num_layers=6, seed=1)) for arch in ("llama", "qwen2", "mistral")
    }
