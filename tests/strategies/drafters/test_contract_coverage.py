"""Every registered drafter inherits the drafter contract (issue 54, class 3): some contract class
in this folder makes an instance of it, so a draft longer than its ``max_tokens`` (forced runs
under a grammar included) fails a test whatever the drafter."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

from framework import REGISTRIES
from framework.testing import DrafterContract


def _contract_classes() -> list[type]:
    out = []
    loaded = {Path(getattr(m, "__file__", "") or "").resolve(): m for m in list(sys.modules.values())}
    for path in sorted(Path(__file__).resolve().parent.glob("test_*.py")):
        module = loaded.get(path)
        if module is None:  # this folder not collected whole: load the file
            spec = importlib.util.spec_from_file_location(f"_contracts_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        out += [
            c
            for _, c in inspect.getmembers(module, inspect.isclass)
            if issubclass(c, DrafterContract) and c.__name__.startswith("Test")
        ]
    return out


def test_every_registered_drafter_has_a_contract_class():
    covered = {type(cls().make()) for cls in _contract_classes()}
    registry = REGISTRIES["drafter"]
    missing = [n for n in registry.names() if registry.get(n) not in covered]
    assert not missing, (
        f"registered drafters without a DrafterContract class in tests/strategies/drafters/: {missing}"
    )
