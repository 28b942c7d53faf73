"""Shared fixtures: tiny random models per architecture (float64, built once per session).

The built-in strategies are registered at import time, before collection, so that tests can
parametrize over the registries (a newly registered strategy is then covered automatically).
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

# Bytecode. Where the environment says not to write it (PYTHONDONTWRITEBYTECODE, set on this
# project's CI hosts), every test process compiles the project's sources and pytest rewrites the
# asserts of every test module again: a third of a worker's collection (15 s -> 10 s on the
# development machine), and as much again in each test that starts a Python process. The suite
# writes it (into __pycache__, which git ignores), except in a mutation runner's copy
# (``SELFSPEC_MUTANT``), whose mutated sources must never leave bytecode behind.
if not os.environ.get("SELFSPEC_MUTANT"):
    sys.dont_write_bytecode = False

import pytest  # noqa: E402
import torch  # noqa: E402

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `pytest` as well as `python -m pytest` from the repo root
    sys.path.insert(0, str(_ROOT))

from framework.engine.adapter import adapter_for  # noqa: E402
from framework.engine.cost_model import CostModel  # noqa: E402
from framework.testing import ARCHS, cached_tiny_model, tiny_model  # noqa: E402

# The tiny models' matmuls are far too small to gain from intra-op threads; on a small or busy CPU
# the thread hand-offs cost several times the arithmetic (measured: 5x slower with 2 threads).
torch.set_num_threads(1)

# Tests never talk to a W&B server, even on a machine logged in to one (tests that check the
# automatic online/offline choice clear this themselves).
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


# ---- the cost model, measured once per model and test process ---------------------------------
# A run (run.py, bench.py, `Decoder.benchmark`) measures its model's cost model when it ends: on
# the tiny models a quarter of a second, more where the noise of two busy cores makes it measure
# again, for numbers that only fill the report. The tests measure each model once per process:
# the same model (architecture, config, weights, dtype, device, kernels) with the same settings
# reuses that measurement. `tests/framework/engine/test_cost_model.py` and tests marked
# ``measures_costs`` measure every time.
_measured: dict[tuple, CostModel] = {}
_measure = CostModel.measure.__func__


def _model_key(adapter) -> tuple:
    model = adapter.arch.model
    params = list(model.parameters())
    sums = tuple(float(p.detach().double().sum()) for p in (params[0], params[-1]))
    place = getattr(adapter, "placement", None)
    return (
        type(model).__name__,
        model.config.to_json_string(use_diff=False),
        str(params[0].dtype),
        str(params[0].device),
        sums,
        bool(getattr(adapter, "fast_kernels", False)),
        bool(getattr(adapter, "exact", False)),
        repr(place),
    )


def _measure_once_per_model(cls, adapter, **kwargs):
    head, weights = kwargs.get("draft_head"), kwargs.get("draft_weights")
    settings = {k: v for k, v in kwargs.items() if k not in ("draft_head", "draft_weights")}
    key = (
        _model_key(adapter),
        None if head is None else head.graph_key,
        None if weights is None else (type(weights).__name__, getattr(weights, "weights", None)),
        tuple(sorted(settings.items())),
    )
    if key not in _measured:
        _measured[key] = _measure(cls, adapter, **kwargs)
    return _measured[key]


@pytest.fixture(autouse=True)
def _cost_models_measured_once(request, monkeypatch):
    if request.node.get_closest_marker("measures_costs") or request.node.path.name == "test_cost_model.py":
        return
    monkeypatch.setattr(CostModel, "measure", classmethod(_measure_once_per_model))


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
def default_model():
    """The real default model (SmolLM2-135M-Instruct, float32, CPU) and its tokenizer, loaded once
    per test process (converted on the machine's first use, ~30 s): every test of the real model
    shares it and only reads it."""
    from framework.models.loading import load_model

    return load_model(None, "float32", "cpu")


@pytest.fixture(scope="session")
def default_prepared():
    """One `PreparedCache` for the sessions built on `default_model` (a token ranking, a cost
    model measured once), as a benchmark's methods share one."""
    from framework.engine.context import PreparedCache

    return PreparedCache()


@pytest.fixture(scope="session")
def deep_adapters() -> dict:
    """{arch: adapter} over 6-layer models, where the default static selector skips a sub-layer
    (on 4 layers its default ratio 0.2 rounds down to skipping nothing)."""
    return {
        arch: adapter_for(tiny_model(arch, num_layers=6, seed=1)) for arch in ("llama", "qwen2", "mistral")
    }


# ---- the quick check and the full suite ------------------------------------------------------
# The README's first test command runs ``-m "not slow"``; CI (`.ci/run`) runs everything. Besides
# the tests marked slow in their files (the mutation suite, the real default model, builds and
# installs, the reproduction pages), every test that took SLOW_SECONDS or more in the committed
# record `durations.txt` is marked slow here (the strategies' own tests from 5 s). Refresh the record
# after adding or speeding up tests:
#     python -m pytest -q -n auto -p no:randomly --record-durations tests/durations.txt
DURATIONS = Path(__file__).with_name("durations.txt")
SLOW_SECONDS = 1.0
#: Tests of the strategies themselves: marked slow only from STRATEGY_SLOW_SECONDS (the issue's
#: "anything over 5 s"), so that the quick check holds every unit test of every strategy; their
#: statistical checks over many decodes are marked in place.
STRATEGY_TESTS = "tests/strategies/"
STRATEGY_SLOW_SECONDS = 5.0


def _recorded_durations(path: Path = DURATIONS) -> dict[str, float]:
    """{node id: seconds} from a record written by ``--record-durations`` (empty if none)."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            seconds, nodeid = line.split(maxsplit=1)
            out[nodeid] = float(seconds)
    return out


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        metavar="PATH",
        default=None,
        help="write each test's duration (setup + call + teardown, seconds) to PATH at the end",
    )


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    recorded = _recorded_durations()
    for item in items:
        limit = STRATEGY_SLOW_SECONDS if item.nodeid.startswith(STRATEGY_TESTS) else SLOW_SECONDS
        if recorded.get(item.nodeid, 0.0) >= limit:
            item.add_marker(pytest.mark.slow)


class _DurationRecorder:
    """Sums each test's phases as the reports arrive (from every xdist worker) and writes them,
    slowest first, when the session ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if getattr(session.config, "workerinput", None) is not None:
            return  # an xdist worker: the controller writes the record
        rows = sorted(self.seconds.items(), key=lambda kv: (-kv[1], kv[0]))
        lines = [
            "# Each test's duration in seconds (setup + call + teardown), slowest first; tests under",
            "# 0.05 s are left out. Written by `python -m pytest -q -n auto --record-durations PATH`",
            "# on the 2-core development machine. tests/conftest.py marks every test listed at",
            f"# {SLOW_SECONDS} s or more as slow, those under {STRATEGY_TESTS} from {STRATEGY_SLOW_SECONDS} s (the",
            "# README's quick check skips them; CI runs all).",
        ]
        lines += [f"{s:.2f} {nodeid}" for nodeid, s in rows if s >= 0.05]
        self.path.write_text("\n".join(lines) + "\n")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what the imports and the collection made (torch, transformers, the test modules: a
    few million objects that live as long as the process): each full collection the garbage
    collector makes during the tests then walks only the tests' own objects (0.3 s a collection
    else, 10 s of each worker's quick check on the development machine)."""
    gc.collect()
    gc.freeze()


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--record-durations")
    if path:
        config.pluginmanager.register(_DurationRecorder(Path(path)), "selfspec-duration-recorder")
