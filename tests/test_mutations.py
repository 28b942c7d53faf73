"""The mutation suite (experiments/mutations.py, issue 31): every planted bug in its named list is
caught by a test. One test per mutation (slow), so that xdist spreads them over the workers: each
worker mutates its own copy of the repository, and runs each mutation's tests in a fork of one warm
interpreter (`mutations.WarmRunner`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
try:
    import mutations
finally:
    sys.path.pop(0)

BY_NAME = {m.name: m for m in mutations.MUTATIONS}


def test_the_mutation_list_is_well_formed():
    names = [m.name for m in mutations.MUTATIONS]
    assert len(names) == len(set(names)) >= 33
    for m in mutations.MUTATIONS:
        text = (ROOT / m.path).read_text()
        assert text.count(m.old) == 1, f"{m.name}: its text occurs {text.count(m.old)} times in {m.path}"
        assert m.new != m.old and m.tests
        for t in m.tests:
            assert (ROOT / t.split("::")[0]).exists(), f"{m.name}: no test file {t}"


@pytest.fixture(scope="session")
def mutation_runner(tmp_path_factory):
    """This worker's copy of the repository and its warm interpreter."""
    repo = tmp_path_factory.mktemp("mutated-repo")
    mutations.copy_repo(repo)
    with mutations.WarmRunner(repo) as runner:
        yield runner


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BY_NAME))
def test_the_mutation_is_killed(name, mutation_runner):
    m = BY_NAME[name]
    if not mutations.host_runs(m.needs):
        pytest.skip(f"the mutated code does not run on this host (it needs {m.needs}); its twin does")
    status, seconds, detail = mutation_runner.run(m)
    assert status == "killed", f"{name} ({m.why}): {status} after {seconds:.1f} s: {detail}"
