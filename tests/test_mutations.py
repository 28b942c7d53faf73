"""The mutation suite (experiments/mutations.py, issue 31): every planted bug in its named list is
caught by a test. Slow (about two minutes): it runs each mutation's tests in a copy of the
repository."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_mutation_list_is_well_formed():
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import mutations
    finally:
        sys.path.pop(0)
    names = [m.name for m in mutations.MUTATIONS]
    assert len(names) == len(set(names)) >= 33
    for m in mutations.MUTATIONS:
        text = (ROOT / m.path).read_text()
        assert text.count(m.old) == 1, f"{m.name}: its text occurs {text.count(m.old)} times in {m.path}"
        assert m.new != m.old and m.tests
        for t in m.tests:
            assert (ROOT / t.split("::")[0]).exists(), f"{m.name}: no test file {t}"


@pytest.mark.slow
def test_every_named_mutation_is_killed():
    proc = subprocess.run(
        [sys.executable, "experiments/mutations.py"], cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "SURVIVED" not in proc.stdout and " of " in proc.stdout
