"""PNG plots of benchmark and run results (matplotlib, Agg canvas).

Every function takes plain Python data, writes one PNG and returns its path. matplotlib is
imported only when a plot is drawn, so the framework imports without it. The figures are drawn on a
`matplotlib.figure.Figure` with the Agg canvas directly: pyplot's global state and the session's
backend are left alone (safe in notebooks and threads).

Conventions:

- **Empty input** (no methods, no rounds) draws an *empty-state* figure that says "no data" and
  still returns the path, so that a report never fails because, say, a method drafted nothing.
- **Malformed input** (a plan row of the wrong length, a skip bit other than 0/1, an exit layer
  outside ``[1, L]``, a non-numeric speedup, an accepted length < 1) raises `ValueError` naming the
  offending method, row or round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from pathlib import Path
from typing import Any

from framework.utils import require

__all__ = ["accept_length_histogram", "exit_layer_over_time", "skip_heatmap", "speedup_by_category"]


def _figure(width: float, height: float, nrows: int = 1) -> tuple[Any, list[Any]]:
    require("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(nrows, 1, i + 1) for i in range(nrows)]
    return fig, axes


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _empty(path: str | Path, title: str, what: str) -> Path:
    fig, (ax,) = _figure(6.0, 3.0)
    ax.set_title(title)
    ax.text(0.5, 0.5, f"no data: {what}", ha="center", va="center", transform=ax.transAxes, fontsize=12)
    ax.set_axis_off()
    return _save(fig, path)


def _is_int(x: Any) -> bool:
    """An integer (Python or numpy), not a bool and not a float."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_bit(x: Any) -> bool:
    """0 / 1 as an int or a bool (Python or numpy)."""
    return (isinstance(x, (bool, Integral)) or type(x).__name__ == "bool_") and x in (0, 1)


def _check_num_layers(num_layers: Any) -> int:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
    return num_layers


# ---------------------------------------------------------------------------------------------


def speedup_by_category(rows: dict[str, dict[str, float]], path: str | Path) -> Path:
    """Grouped bar chart of speedups: one group per category (``overall`` last), one bar per method,
    and a dashed line at 1.0 (the baseline).

    Args:
        rows: ``{method: {category: speedup}}``. A category a method lacks, or a NaN speedup, leaves
            that bar out. Categories appear in first-seen order, ``overall`` last.
        path: the PNG to write.

    Raises:
        ValueError: ``rows`` is not a mapping of mappings, or a speedup is not a number >= 0.
    """
    if not isinstance(rows, Mapping):
        raise ValueError(f"rows must be a dict {{method: {{category: speedup}}}}, got {type(rows).__name__}")
    cats: list[str] = []
    for method, by_cat in rows.items():
        if not isinstance(by_cat, Mapping):
            raise ValueError(f"rows[{method!r}] must be a dict {{category: speedup}}, got {by_cat!r}")
        for cat, val in by_cat.items():
            if isinstance(val, bool) or not isinstance(val, Real):
                raise ValueError(f"speedup of {method!r} in {cat!r} must be a number, got {val!r}")
            if not math.isnan(val) and (val < 0 or math.isinf(val)):
                raise ValueError(f"speedup of {method!r} in {cat!r} must be finite and >= 0, got {val!r}")
            if cat not in cats:
                cats.append(cat)
    title = "Speedup over the vanilla baseline"
    if not rows or not cats:
        return _empty(path, title, "no method has a speedup")
    if "overall" in cats:
        cats.remove("overall")
        cats.append("overall")
    methods = list(rows)
    fig, (ax,) = _figure(
        max(6.0, 1.1 * len(cats) * max(1, len(methods)) ** 0.5 + 2), 4.2 + 0.25 * (len(methods) // 4)
    )
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        xs, ys = [], []
        for i, cat in enumerate(cats):
            val = rows[method].get(cat, float("nan"))
            if not math.isnan(val):
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(float(val))
        bars = ax.bar(xs, ys, width=width, label=method)
        if len(methods) * len(cats) <= 40:
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels(cats, rotation=20, ha="right")
    ax.set_ylabel("speedup (x)")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=min(4, len(methods)), loc="upper center", bbox_to_anchor=(0.5, -0.2))
    return _save(fig, path)


def accept_length_histogram(accept_lengths: dict[str, list[int]], path: str | Path) -> Path:
    """Per method, the share of verification rounds that committed 1, 2, ... tokens (bonus token
    included, so every value is >= 1); bars side by side per length.

    Methods with no rounds are listed in the legend as ``(no rounds)``.

    Raises:
        ValueError: not a mapping of lists, or a value that is not an integer >= 1.
    """
    if not isinstance(accept_lengths, Mapping):
        raise ValueError(
            f"accept_lengths must be a dict {{method: [int]}}, got {type(accept_lengths).__name__}"
        )
    clean: dict[str, list[int]] = {}
    for method, vals in accept_lengths.items():
        if isinstance(vals, (str, bytes)) or not isinstance(vals, Sequence):
            raise ValueError(f"accept_lengths[{method!r}] must be a list of integers, got {vals!r}")
        for i, v in enumerate(vals):
            if not _is_int(v) or v < 1:
                raise ValueError(
                    f"accept_lengths[{method!r}][{i}] = {v!r}: accepted tokens per round (bonus included) "
                    "must be an integer >= 1"
                )
        clean[method] = [int(v) for v in vals]
    title = "Tokens committed per verification round (bonus included)"
    if not any(clean.values()):
        return _empty(path, title, "no verification rounds")
    top = max(max(v) for v in clean.values() if v)
    methods = list(clean)
    fig, (ax,) = _figure(max(6.0, 0.45 * top + 3), 4.0)
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        vals = clean[method]
        if not vals:
            ax.bar([], [], label=f"{method} (no rounds)")
            continue
        counts = [0] * (top + 1)
        for v in vals:
            counts[v] += 1
        xs = [k - 0.4 + width * (j + 0.5) for k in range(1, top + 1)]
        mean = sum(vals) / len(vals)
        ax.bar(xs, [c / len(vals) for c in counts[1:]], width=width, label=f"{method} (mean {mean:.2f})")
    ax.set_xticks(range(1, top + 1))
    ax.set_xlabel("tokens committed in the round")
    ax.set_ylabel("share of rounds")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def skip_heatmap(plans: list[list[int]], num_layers: int, path: str | Path, title: str = "") -> Path:
    """The skip set over rounds: two panels (attention, MLP), block index on the y axis, round on
    the x axis, a dark cell where the sub-layer was skipped.

    Args:
        plans: one row per round of ``2 * num_layers`` bits in `LayerPlan.from_bits` order
            (``row[i]`` attention of block i, ``row[L + i]`` its MLP); 1 (or True) = skipped.
        num_layers: L.
        title: figure title (e.g. the method).

    Raises:
        ValueError: ``num_layers`` < 1, a row of another length, or a bit other than 0/1.
    """
    n = _check_num_layers(num_layers)
    if isinstance(plans, (str, bytes)) or not isinstance(plans, Sequence):
        raise ValueError(f"plans must be a list of rows of {2 * n} bits, got {type(plans).__name__}")
    for r, row in enumerate(plans):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) != 2 * n:
            got = len(row) if isinstance(row, Sequence) else type(row).__name__
            raise ValueError(
                f"plans[{r}] must have 2 * num_layers = {2 * n} bits (attention then MLP), got {got}"
            )
        for i, b in enumerate(row):
            if not _is_bit(b):
                raise ValueError(f"plans[{r}][{i}] = {b!r}: a skip bit must be 0 or 1")
    heading = title or "Skipped sub-layers per round"
    if not plans:
        return _empty(path, heading, "no rounds")
    rounds = len(plans)
    attn = [[int(plans[r][i]) for r in range(rounds)] for i in range(n)]
    mlp = [[int(plans[r][n + i]) for r in range(rounds)] for i in range(n)]
    fig, axes = _figure(min(14.0, max(6.0, 0.05 * rounds + 4)), max(4.0, 0.12 * n * 2 + 2), nrows=2)
    for ax, grid, name in ((axes[0], attn, "attention"), (axes[1], mlp, "MLP")):
        ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="Greys", vmin=0, vmax=1, origin="lower")
        ax.set_ylabel(f"{name} block")
        share = sum(map(sum, grid)) / (rounds * n)
        ax.set_title(f"{name} sub-layers skipped (dark; {100 * share:.0f}% of cells)", fontsize=9)
    axes[1].set_xlabel("round")
    fig.suptitle(heading)
    return _save(fig, path)


def exit_layer_over_time(exit_layers: list[int | None], num_layers: int, path: str | Path) -> Path:
    """The draft's exit layer per round (early exit, DEL); ``None`` is full depth (drawn at L with
    a distinct marker).

    Raises:
        ValueError: ``num_layers`` < 1, or an exit layer that is not an integer in ``[1, L]``.
    """
    n = _check_num_layers(num_layers)
    if isinstance(exit_layers, (str, bytes)) or not isinstance(exit_layers, Sequence):
        raise ValueError(f"exit_layers must be a list of int or None, got {type(exit_layers).__name__}")
    for r, e in enumerate(exit_layers):
        if e is None:
            continue
        if not _is_int(e) or not 1 <= e <= n:
            raise ValueError(
                f"exit_layers[{r}] = {e!r}: an exit layer must be an integer in [1, {n}] or None"
            )
    title = "Draft exit layer per round"
    if not exit_layers:
        return _empty(path, title, "no rounds")
    xs = list(range(len(exit_layers)))
    ys = [n if e is None else int(e) for e in exit_layers]
    fig, (ax,) = _figure(min(14.0, max(6.0, 0.04 * len(xs) + 4)), 3.6)
    ax.step(xs, ys, where="mid", linewidth=1)
    full = [x for x, e in zip(xs, exit_layers, strict=True) if e is None]
    if full:
        ax.scatter(
            full, [n] * len(full), marker="^", color="tab:red", s=14, label="full depth (None)", zorder=3
        )
        ax.legend(fontsize=8)
    ax.set_ylim(0, n + 1)
    ax.set_xlabel("round")
    ax.set_ylabel(f"exit layer (of {n})")
    ax.set_title(title)
    return _save(fig, path)
