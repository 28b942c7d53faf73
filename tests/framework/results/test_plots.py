"""framework.results.plots: each function writes a valid PNG, draws an empty-state figure for empty input
and rejects malformed input with a ValueError."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from framework.results import plots  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path, returned: Path) -> tuple[int, int]:
    from matplotlib.image import imread

    assert Path(returned) == path
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000
    img = imread(path)
    assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 50
    return img.shape[0], img.shape[1]


def test_speedup_by_category(tmp_path):
    rows = {
        "swift": {"mt_bench": 1.2, "qa": 0.9, "overall": 1.05},
        "hf_prompt_lookup": {"overall": 1.4, "mt_bench": float("nan"), "qa": 1.6},  # NaN: bar left out
    }
    p = tmp_path / "sub" / "speedup.png"  # parent directories are created
    assert_png(p, plots.speedup_by_category(rows, p))


def test_accept_length_histogram(tmp_path):
    p = tmp_path / "accept.png"
    data = {"clasp": [1, 2, 3, 3, 5, 1], "hf_prompt_lookup": [1, 1, 11], "idle": []}
    assert_png(p, plots.accept_length_histogram(data, p))


def test_skip_heatmap(tmp_path):
    n = 4
    plans = [[1, 0, 0, 1, 0, 1, 0, 0], [True, False, False, False, False, True, True, False]] * 10
    p = tmp_path / "skip.png"
    assert_png(p, plots.skip_heatmap(plans, n, p, title="swift"))


def test_exit_layer_over_time(tmp_path):
    p = tmp_path / "exit.png"
    assert_png(p, plots.exit_layer_over_time([3, 5, None, 7, 7, 2, None], 8, p))


@pytest.mark.parametrize(
    "draw",
    [
        lambda p: plots.speedup_by_category({}, p),
        lambda p: plots.speedup_by_category({"m": {}}, p),
        lambda p: plots.accept_length_histogram({}, p),
        lambda p: plots.accept_length_histogram({"m": []}, p),
        lambda p: plots.skip_heatmap([], 4, p),
        lambda p: plots.exit_layer_over_time([], 4, p),
    ],
)
def test_empty_input_draws_an_empty_state_figure(tmp_path, draw):
    p = tmp_path / "empty.png"
    assert_png(p, draw(p))


@pytest.mark.parametrize(
    "draw, match",
    [
        (lambda p: plots.speedup_by_category([1.0], p), "rows must be a dict"),
        (lambda p: plots.speedup_by_category({"m": 1.2}, p), r"rows\['m'\] must be a dict"),
        (lambda p: plots.speedup_by_category({"m": {"qa": "fast"}}, p), "'m' in 'qa' must be a number"),
        (lambda p: plots.speedup_by_category({"m": {"qa": -1.0}}, p), "finite and >= 0"),
        (lambda p: plots.accept_length_histogram({"m": [1, 0]}, p), r"\['m'\]\[1\] = 0"),
        (lambda p: plots.accept_length_histogram({"m": [1.5]}, p), "integer >= 1"),
        (lambda p: plots.accept_length_histogram({"m": "123"}, p), "list of integers"),
        (lambda p: plots.skip_heatmap([[0] * 8, [0] * 7], 4, p), r"plans\[1\] must have 2 \* num_layers = 8"),
        (lambda p: plots.skip_heatmap([[0] * 7 + [2]], 4, p), r"plans\[0\]\[7\] = 2"),
        (lambda p: plots.skip_heatmap([[0.5] * 8], 4, p), "a skip bit must be 0 or 1"),
        (lambda p: plots.skip_heatmap([[0] * 8], 0, p), "num_layers must be an integer >= 1"),
        (lambda p: plots.exit_layer_over_time([1, 9], 8, p), r"exit_layers\[1\] = 9"),
        (lambda p: plots.exit_layer_over_time([0], 8, p), r"in \[1, 8\]"),
        (lambda p: plots.exit_layer_over_time([2.5], 8, p), "an exit layer must be an integer"),
    ],
)
def test_malformed_input_is_rejected(tmp_path, draw, match):
    p = tmp_path / "bad.png"
    with pytest.raises(ValueError, match=match):
        draw(p)
    assert not p.exists()


def test_importing_the_framework_does_not_import_matplotlib():
    code = "import sys, framework.results.plots, framework.benchmark; print('matplotlib' in sys.modules)"
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
