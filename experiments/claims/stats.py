"""The statistics behind the verdicts: bootstrap confidence intervals over prompts (paired: every
configuration is resampled with the same prompts), two-level bootstraps when a comparison is
against several random sets (prompts and sets resampled), Wilson intervals for pooled proportions,
one-sided permutation tests for rank correlations, and the per-prompt counts of a decode that
these read.

Every function is deterministic (fixed seeds) and works on plain lists, so a claim's `decide` can
be fed synthetic measurements in the unit tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: Bootstrap resamples and the confidence level of every interval in the report.
B = 2000
LEVEL = 0.95
SEED = 12345


def interval(samples: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The percentile interval of bootstrap ``samples`` (NaNs dropped)."""
    s = np.asarray(samples, dtype=float)
    s = s[np.isfinite(s)]
    if not len(s):
        return (float("nan"), float("nan"))
    a = (1 - level) / 2
    return (float(np.quantile(s, a)), float(np.quantile(s, 1 - a)))


def bootstrap(
    stat: Callable[..., float], n: int, n_sets: int = 0, *, b: int = B, seed: int = SEED
) -> dict[str, float]:
    """``stat`` on all ``n`` units (prompts, tokens) and its 95% percentile interval over ``b``
    resamples of the units. ``stat(idx)`` gets an index array; with ``n_sets`` > 0 it is
    ``stat(idx, jdx)`` and the ``n_sets`` random sets are resampled too (a two-level bootstrap).
    Returns ``{"est", "lo", "hi"}``."""
    rng = np.random.default_rng(seed)
    full = np.arange(n)
    est = stat(full, np.arange(n_sets)) if n_sets else stat(full)
    samples = None
    if not n_sets and n > 1:
        # vectorised: the metrics below accept a (b, n) index matrix and return b values
        idx = rng.integers(0, n, (b, n))
        try:
            got = np.asarray(stat(idx), dtype=float)
            if got.shape == (b,):
                samples = got
        except (TypeError, ValueError, IndexError):
            samples = None
        rng = np.random.default_rng(seed)
    if samples is not None:
        lo, hi = interval(samples)
        return {"est": float(est), "lo": lo, "hi": hi}
    samples = np.empty(b)
    for i in range(b):
        idx = rng.integers(0, n, n) if n > 1 else full
        if n_sets:
            jdx = rng.integers(0, n_sets, n_sets) if n_sets > 1 else np.arange(n_sets)
            samples[i] = stat(idx, jdx)
        else:
            samples[i] = stat(idx)
    lo, hi = interval(samples)
    return {"est": float(est), "lo": lo, "hi": hi}


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n (pooled tokens; ignores correlation within a
    prompt, so narrower than the bootstrap over prompts)."""
    if n <= 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def permutation_p(x: Sequence[float], y: Sequence[float], *, n_perm: int = 5000, seed: int = SEED) -> float:
    """One-sided p-value of Spearman's rho(x, y) > 0 against random pairings of ``y`` (with the
    observed pairing counted, so never 0)."""
    rx, ry = _ranks(x), _ranks(y)
    obs = _corr(rx, ry)
    rng = np.random.default_rng(seed)
    perms = np.argsort(rng.random((n_perm, len(ry))), axis=1)
    a = rx - rx.mean()
    b = ry[perms] - ry.mean()
    den = math.sqrt(float((a * a).sum() * (b[0] * b[0]).sum()))
    if den <= 0:
        return 1.0
    rho = (b @ a) / den
    hits = int((rho >= obs - 1e-12).sum())
    return (hits + 1) / (n_perm + 1)


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties; NaN when either side is constant)."""
    return _corr(_ranks(x), _ranks(y))


def _ranks(v: Sequence[float]) -> np.ndarray:
    a = np.asarray(v, dtype=float)
    order = np.argsort(a, kind="mergesort")
    ranks = np.empty(len(a))
    i = 0
    while i < len(a):
        j = i
        while j + 1 < len(a) and a[order[j + 1]] == a[order[i]]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2
        i = j + 1
    return ranks


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = math.sqrt(float((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / den) if den > 0 else float("nan")


# ---- per-prompt counts of a decode ----------------------------------------------------------


def counts(accepted, drafted, base=None, time=None, committed=None, rounds=None) -> dict[str, list]:
    """Per-prompt counts of one decoded configuration: accepted and drafted tokens, and for the
    modelled speedup the plain-decoding seconds of its tokens (``base``) and the cost model's
    seconds of its rounds (``time``); ``committed`` / ``rounds`` for M."""
    out: dict[str, list] = {"accepted": list(accepted), "drafted": list(drafted)}
    if base is not None:
        out["base"], out["time"] = list(base), list(time)
    if committed is not None:
        out["committed"], out["rounds"] = list(committed), list(rounds)
    return out


def _arr(c: dict[str, Any], key: str) -> np.ndarray:
    return np.asarray(c[key], dtype=float)


def _pooled(num: np.ndarray, den: np.ndarray, idx: np.ndarray | None) -> Any:
    """sum(num) / sum(den) over the prompts ``idx`` (0 where nothing was counted); with a (b, n)
    index matrix, b values."""
    if idx is not None:
        num, den = num[idx], den[idx]
    n, d = num.sum(axis=-1), den.sum(axis=-1)
    r = np.where(d > 0, n / np.where(d > 0, d, 1.0), 0.0)
    return float(r) if np.ndim(r) == 0 else r


def alpha(c: dict[str, Any], idx: np.ndarray | None = None) -> Any:
    """Pooled acceptance (accepted / drafted) of the prompts ``idx`` (default all)."""
    return _pooled(_arr(c, "accepted"), _arr(c, "drafted"), idx)


def speed(c: dict[str, Any], idx: np.ndarray | None = None) -> Any:
    """Modelled speedup (plain-decoding seconds / modelled seconds) of the prompts ``idx``."""
    return _pooled(_arr(c, "base"), _arr(c, "time"), idx)


def n_prompts(c: dict[str, Any]) -> int:
    return len(c["accepted"])


def diff(metric: Callable, a: dict, b: dict) -> dict[str, float]:
    """``metric(a) - metric(b)`` with its paired bootstrap interval over prompts."""
    return bootstrap(lambda i: metric(a, i) - metric(b, i), n_prompts(a))


def ratio(metric: Callable, a: dict, b: dict) -> dict[str, float]:
    """``metric(a) / metric(b)`` with its paired bootstrap interval over prompts."""

    def r(i):
        den = np.asarray(metric(b, i), dtype=float)
        return metric(a, i) / np.where(den != 0, den, np.nan)

    return bootstrap(r, n_prompts(a))


def diff_vs_sets(metric: Callable, a: dict, sets: list[dict], *, sign: int = 1) -> dict[str, float]:
    """``metric(a)`` minus the mean of ``metric`` over the random ``sets`` (``sign`` -1: the mean
    minus ``metric(a)``), resampling prompts (paired) and sets: a two-level bootstrap."""
    nan = float("nan")
    if not sets:
        return {"est": nan, "lo": nan, "hi": nan}
    n, k = n_prompts(a), len(sets)
    est = sign * (metric(a) - float(np.mean([metric(c) for c in sets])))
    rng = np.random.default_rng(SEED)
    idx = rng.integers(0, n, (B, n)) if n > 1 else np.zeros((B, 1), dtype=int)
    jdx = rng.integers(0, k, (B, k))
    per_set = np.stack([np.asarray(metric(c, idx), dtype=float) for c in sets])  # (k, B)
    means = per_set[jdx, np.arange(B)[:, None]].mean(axis=1)  # (B,)
    lo, hi = interval(sign * (np.asarray(metric(a, idx), dtype=float) - means))
    return {"est": est, "lo": lo, "hi": hi}


def ci_of(c: dict[str, Any], metric: Callable) -> dict[str, float]:
    """``metric`` of one configuration with its bootstrap interval over prompts."""
    return bootstrap(lambda i: metric(c, i), n_prompts(c))


def above(ci: dict[str, float], x: float = 0.0) -> bool:
    """Whether the whole interval lies above ``x`` (the contrary excluded)."""
    return bool(np.isfinite(ci["lo"]) and ci["lo"] > x)


def below(ci: dict[str, float], x: float = 0.0) -> bool:
    """Whether the whole interval lies below ``x``."""
    return bool(np.isfinite(ci["hi"]) and ci["hi"] < x)


def show(ci: dict[str, float], nd: int = 3, pct: bool = False) -> str:
    """``est [lo, hi]``, in percent with ``pct``."""
    f = 100.0 if pct else 1.0
    u = "%" if pct else ""
    return f"{f * ci['est']:.{nd}f}{u} [{f * ci['lo']:.{nd}f}{u}, {f * ci['hi']:.{nd}f}{u}]"
