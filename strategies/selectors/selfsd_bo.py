"""``selfsd_bo``: Draft & Verify's skip set, found offline by Gaussian-process Bayesian optimisation.

Zhang et al., "Draft & Verify: Lossless Large Language Model Acceleration via Self-Speculative
Decoding", ACL 2024 (Self-SD). The draft model is the target with a fixed set of attention and MLP
sub-layers bypassed; the set is searched once per model over ``z in {0, 1}^{2L}`` (one bit per
sub-layer, any number of bits set) by maximising the decoding speed of self-speculative decoding on
a few calibration prompts, then frozen for every prompt of every task.

The search (``prepare``) runs when no saved set is given, and writes its result (the set, its
objective, the whole trace, the model fingerprint and dtype) to a JSON file that ``skip_set`` reuses
without searching. Per candidate it decodes every calibration prompt with the search-time decoder
of the released code (adaptive draft-exit threshold from 0.8, at most 8 draft tokens, greedy, no
EOS stop) and scores it by tokens per second:

- ``objective = "cost_model"`` (default): tokens / *modelled* seconds, where the rounds of each
  decode are counted (draft steps, verification sizes) and priced by a `CostModel` measured once
  at the start of the search. Greedy fp32 decoding is deterministic, so the same set always gets
  the same score: a noisy neighbour on a shared machine cannot steer the search;
- ``objective = "wall_time"``: tokens / measured seconds, the paper's objective.

Both are recorded for every candidate in the trace.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from framework import (
    REGISTRIES,
    LayerPlan,
    LayerSelector,
    ModelInfo,
    PrepareView,
    RoundView,
    register_selector,
)
from framework.config_fields import ConfigError, build_config, check_range, check_types, param
from framework.search.bayesopt import BinaryBayesOpt
from framework.types import CostPrices, weights_key
from framework.utils import cache_dir
from strategies.selectors.static import uniform_plan

#: Version tag of the saved-result format.
FORMAT = "selfspec-skipset/1"


@dataclass(frozen=True)
class SelfSDConfig:
    skip_set: str = param(
        "", help="a saved search result (JSON) to use as is; empty: search first (see save_to)"
    )
    save_to: str = param(
        "",
        help="where the search writes its result; empty: <results file>.skipset.json next to the run's "
        "output (nowhere when the strategy is used without the runner)",
    )
    calib_data: str = param(
        "", help="calibration prompts (Spec-Bench JSONL); empty: the built-in calibration set"
    )
    calib_categories: tuple[str, ...] = param((), help="keep only these categories of calib_data")
    calib_limit: int = param(4, help="calibration prompts used (the paper: 8); in [1, 64]")
    calib_max_new_tokens: int = param(
        32, help="tokens decoded per calibration prompt, no EOS stop (the released code: 32); in [4, 512]"
    )
    iterations: int = param(
        16,
        help="candidates evaluated, probes included (the paper: 1000; 16 take about 4 minutes on a "
        "2-core CPU with the default model); in [1, 10000]",
    )
    objective: Literal["cost_model", "wall_time"] = param(
        "cost_model",
        help="'cost_model': tokens per modelled second (deterministic); 'wall_time': tokens per "
        "measured second (the paper)",
    )
    probe_ratios: tuple[float, ...] = param(
        (0.1, 0.2),
        help="uniform skip sets at these ratios are evaluated first (the released code warm-starts "
        "with two sets chosen by hand); each in [0, 1)",
    )
    initial_random: int = param(
        0, help="random sets evaluated after the probes, before the GP proposes (the code: 0); >= 0"
    )
    kappa: float = param(2.576, help="UCB exploration weight (bayes_opt's default, used by Self-SD); > 0")
    gp_noise: float = param(
        0.01, help="observation noise of the GP on standardised objectives (the code: 1e-2); > 0"
    )
    keep_first_last: bool = param(
        False, help="never skip the first and last block (SWIFT's rule; Self-SD has none)"
    )
    search_max_length: int = param(8, help="draft cap K while searching (the code: 8); in [1, 64]")
    search_exit_threshold: float = param(
        0.8, help="initial draft-exit threshold while searching (the code: 0.8); in [0.001, 0.999]"
    )
    search_target_accept_rate: float = param(
        0.9, help="target acceptance rate of the threshold while searching (the code: 0.9); in [0, 1]"
    )
    seed: int = param(1, help="seeds the GP's random starts and random sets (the code: random_state=1)")
    cache: bool = param(
        False,
        help="keep every search in <cache>/skipsets/ (the cache directory: $SELFSPEC_CACHE, else "
        "~/.cache/selfspec) and reuse it for the same weights, dtype, device, draft head and search "
        "settings, so a model is searched once (the Self-SD presets turn it on)",
    )

    def __post_init__(self) -> None:
        check_types(self)
        check_range("calib_limit", self.calib_limit, 1, 64, integer=True)
        check_range("calib_max_new_tokens", self.calib_max_new_tokens, 4, 512, integer=True)
        check_range("iterations", self.iterations, 1, 10000, integer=True)
        for r in self.probe_ratios:
            check_range("probe_ratios", r, 0.0, 1.0, hi_open=True)
        check_range("initial_random", self.initial_random, 0, integer=True)
        check_range("kappa", self.kappa, 0.0, lo_open=True)
        check_range("gp_noise", self.gp_noise, 0.0, lo_open=True)
        check_range("search_max_length", self.search_max_length, 1, 64, integer=True)
        check_range("search_exit_threshold", self.search_exit_threshold, 1e-3, 1 - 1e-3)
        check_range("search_target_accept_rate", self.search_target_accept_rate, 0.0, 1.0)


@dataclass(frozen=True)
class _SearchResult:
    plan: LayerPlan
    objective: float
    data: dict[str, Any]  # the saved JSON


@register_selector("selfsd_bo", config=SelfSDConfig)
class SelfSDSelector(LayerSelector):
    """Draft & Verify (Self-SD): one skip set for the whole run, searched offline by GP-UCB Bayesian
    optimisation over the 2L attention/MLP bits (free cardinality), scored by decoding speed."""

    shares_plan = True  # one plan for every row of a batch

    requires = ("botorch", "gpytorch")  # its Gaussian-process Bayesian optimisation

    def __init__(self, config: SelfSDConfig | None = None) -> None:
        super().__init__(config)
        self._result: _SearchResult | None = None
        self._info: ModelInfo | None = None
        self.source = ""  # "file", "search" or "cache"

    # ---- lifecycle -------------------------------------------------------------------------
    def setup(self, info: ModelInfo) -> None:
        self._info = info
        if self.config.skip_set:
            self._result = load_skip_set(self.config.skip_set, info.num_layers)
            self.source = "file"

    def prepare(self, ctx: PrepareView) -> None:
        c = self.config
        if c.skip_set:
            expected = self._result.data.get("fingerprint") if self._result else None
            actual = ctx.fingerprint()
            if expected and expected != actual:
                raise ConfigError(
                    "--selector.skip_set",
                    c.skip_set,
                    f"a skip set searched on this model (the file's fingerprint is {expected}, the model's "
                    f"is {actual}: it was searched on other weights)",
                )
            if self._result and self._result.data.get("dtype") not in (None, ctx.dtype):
                ctx.log(
                    f"[selfsd_bo] note: {c.skip_set} was searched in {self._result.data['dtype']}, "
                    f"this run uses {ctx.dtype}"
                )
            return
        head = ctx.draft_head.key if ctx.draft_head is not None else ""
        key = (head, _weights(ctx), json.dumps(asdict(c), sort_keys=True, default=str))
        self._result = ctx.once(SelfSDSelector, key, lambda: _cached_or_search(ctx, c))
        self.source = "cache" if self._result.data.get("from_cache") else "search"

    def plan(self, state: RoundView) -> LayerPlan:
        if self._result is None:
            raise RuntimeError(
                "selfsd_bo has no skip set: give --selector.skip_set FILE (a saved search) or let the "
                "runner call prepare() to search one"
            )
        return self._result.plan

    def summary(self) -> dict[str, Any]:
        if self._result is None:
            return {}
        d = self._result.data
        return {
            "plan": self._result.plan.describe(),
            "objective": d["objective"],
            "source": self.source,
            "skip_set": d.get("path", ""),
            "search_seconds": d["search_seconds"],
            "iterations": len(d["trace"]),
        }


# -------------------------------------------------------------------------------------------
# The search
# -------------------------------------------------------------------------------------------


def _cached_or_search(ctx: PrepareView, c: SelfSDConfig) -> _SearchResult:
    """The cached search of ``c`` on this model (with ``cache``), else a new search."""
    cached = cached_search(ctx, c) if c.cache else None
    if cached is None:
        return search(ctx, c)
    ctx.log(
        f"[selfsd_bo] reusing the search of {cached.data['created']} ({len(cached.data['trace'])} "
        f"candidates, {cached.data['search_seconds']:.0f} s) from {cached.data['path']}"
    )
    return cached


def _calibration_prompts(ctx: PrepareView, c: SelfSDConfig) -> list[torch.Tensor]:
    try:
        texts = ctx.calibration_prompts(c.calib_data, c.calib_categories)
    except ValueError as err:
        raise ConfigError(
            "--selector.calib_data", c.calib_data or "(built-in)", f"usable prompts: {err}"
        ) from None
    return [torch.tensor([ctx.encode(t)], device=ctx.device) for t in texts[: c.calib_limit]]


def _search_strategies(ctx: PrepareView, c: SelfSDConfig) -> dict[str, Any]:
    """The search-time decoder of the released code: the adaptive draft-exit threshold, layer
    skipping with the run's draft head and weights, greedy verification."""
    length_entry = REGISTRIES["length"].entry("adaptive_confidence")
    length = length_entry.cls(
        build_config(
            length_entry.config,
            {
                "exit_threshold": c.search_exit_threshold,
                "target_accept_rate": c.search_target_accept_rate,
                "max_length": c.search_max_length,
            },
        )
    )
    drafter = REGISTRIES["drafter"].get("layer_skip")()
    drafter.use_head(ctx.draft_head)  # search the draft that runs: the run's drafter's head
    drafter.use_weights(ctx.draft_weights)  # and weights
    verifier = REGISTRIES["verifier"].get("greedy")()
    return {"length": length, "drafter": drafter, "verifier": verifier}


def _weights(ctx: PrepareView) -> str:
    """The weights of the run's drafts (`weights_key`: ``"float32"`` for the model's own; with
    the head's format where a compressed copy scores the reduced head in one)."""
    return weights_key(ctx.draft_weights)


def evaluate_plan(
    ctx: PrepareView, c: SelfSDConfig, plan: LayerPlan, prompts: list[torch.Tensor], cost: CostPrices
) -> dict[str, float]:
    """Decode every calibration prompt with ``plan`` (`PrepareView.evaluate`); tokens/s measured
    and modelled, alpha, M."""
    ev = ctx.evaluate(
        plan,
        prompts,
        **_search_strategies(ctx, c),
        max_new_tokens=c.calib_max_new_tokens,
        max_draft=c.search_max_length,
    )
    after_prefill = ev.tokens - ev.prompts  # the first token of each prompt comes from the prefill
    return {
        # modelled: the rounds only (the prefill is the same for every candidate)
        "tokens_per_s_model": after_prefill / cost.decode_time(plan, ev.draft_lengths),
        "tokens_per_s_wall": ev.tokens / ev.wall_time,
        "alpha": ev.alpha,
        "M": ev.mean_accepted_length,
    }


def search(ctx: PrepareView, c: SelfSDConfig) -> _SearchResult:
    """Run the Bayesian search; write the result file (if there is a place for it); return it."""
    from tqdm.auto import tqdm

    n = ctx.info.num_layers
    prompts = _calibration_prompts(ctx, c)
    t0 = time.perf_counter()
    cost = ctx.cost_model()
    pinned = [0, n - 1, n, 2 * n - 1] if c.keep_first_last and n > 2 else []
    bo = BinaryBayesOpt(2 * n, pinned=pinned, kappa=c.kappa, noise=c.gp_noise, seed=c.seed)
    probes = [uniform_plan(n, r, c.keep_first_last).to_bits() for r in c.probe_ratios]
    ctx.log(
        f"[selfsd_bo] searching a skip set: {c.iterations} candidates x {len(prompts)} calibration prompts x "
        f"{c.calib_max_new_tokens} tokens, objective {c.objective}; cost model: {cost.describe()}"
    )
    trace: list[dict[str, Any]] = []
    key = "tokens_per_s_model" if c.objective == "cost_model" else "tokens_per_s_wall"
    bar = tqdm(
        range(c.iterations), desc="selfsd_bo search", unit="set", leave=False, disable=not ctx.progress
    )
    for it in bar:
        if it < len(probes):
            bits, source = probes[it], "probe"
        elif it < len(probes) + c.initial_random:
            bits, source = bo.random_point(), "random"
        else:
            bits, source = bo.suggest(), "gp"
        plan = LayerPlan.from_bits(bits)
        if plan.num_skipped == 2 * n:  # nothing left to run: not a draft model
            score = {"tokens_per_s_model": 0.0, "tokens_per_s_wall": 0.0, "alpha": 0.0, "M": 0.0}
        else:
            score = evaluate_plan(ctx, c, plan, prompts, cost)
        bo.observe(bits, score[key])
        trace.append(
            {"iteration": it, "source": source, "bits": list(bits), "skip_ratio": round(plan.skip_ratio, 4)}
            | {k: round(v, 4) for k, v in score.items()}
        )
        bar.set_postfix(best=f"{bo.best()[1]:.2f} tok/s", last=f"{score[key]:.2f}")
    bar.close()
    best_bits, best_val = bo.best()
    plan = LayerPlan.from_bits(best_bits)
    seconds = time.perf_counter() - t0
    best_row = max(trace, key=lambda r: r[key])
    data = {
        "format": FORMAT,
        "model": ctx.info.name,
        "fingerprint": ctx.fingerprint(),
        "draft_vocab": ctx.draft_head.size if ctx.draft_head is not None else 0,
        "draft_weights": _weights(ctx),
        "dtype": ctx.dtype,
        "num_layers": n,
        "bits": list(best_bits),
        "plan": plan.describe(),
        "objective": {"name": c.objective, "value": best_val, "unit": "tokens/s"},
        "best": best_row,
        "vanilla_tokens_per_s_model": 1.0 / cost.step,
        "search_seconds": round(seconds, 2),
        "gp_fits": bo.num_fits,
        "gp_seconds": round(bo.fit_seconds, 3),
        "cost_model": cost.to_dict(),
        "config": asdict(c),
        "calibration": {"data": c.calib_data or "calibration.jsonl", "prompts": len(prompts)},
        "trace": trace,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    path = (
        Path(c.save_to)
        if c.save_to
        else (Path(f"{ctx.artifact_stem}.skipset.json") if ctx.artifact_stem else None)
    )
    if c.cache:
        cached = cache_path(ctx, c)
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(".tmp")
            tmp.write_text(json.dumps(data | {"path": str(cached)}, indent=1))
            tmp.replace(cached)  # whole or not at all
            data["path"] = str(cached)
        except OSError as err:  # a read-only cache is not fatal: the next run searches again
            ctx.log(f"[selfsd_bo] could not cache the search in {cached}: {err}")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data["path"] = str(path)
        path.write_text(json.dumps(data, indent=1))
    ctx.log(
        f"[selfsd_bo] best of {len(trace)} sets in {seconds:.0f} s: {best_val:.2f} tokens/s ({c.objective}; "
        f"alpha {best_row['alpha']:.3f}, M {best_row['M']:.2f}), skip ratio {plan.skip_ratio:.3f}, "
        f"attention {plan.describe()['attn_skip']}, MLP {plan.describe()['mlp_skip']}"
        + (f"; saved to {path}: reuse with --skip-set {path}" if path else "")
    )
    return _SearchResult(plan, best_val, data)


#: Config fields that say where a search is read or written, not what it searches.
_NOT_SEARCH_SETTINGS = ("skip_set", "save_to", "cache")


def cache_path(ctx: PrepareView, c: SelfSDConfig) -> Path:
    """Where the search of ``c`` on ``ctx``'s model is cached: one file per weights fingerprint,
    dtype, device, draft head and search settings (the calibration file by path)."""
    settings = {k: v for k, v in asdict(c).items() if k not in _NOT_SEARCH_SETTINGS}
    ident = {
        "fingerprint": ctx.fingerprint(),
        "dtype": ctx.dtype,
        "device": str(ctx.device),
        "draft_head": ctx.draft_head.key if ctx.draft_head is not None else "",
        "settings": settings,
    }
    if _weights(ctx) != "float32":  # (searches of the model's own weights keep their files)
        ident["draft_weights"] = _weights(ctx)
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_dir() / "skipsets" / f"{ident['fingerprint'][:12]}-{digest}.json"


def cached_search(ctx: PrepareView, c: SelfSDConfig) -> _SearchResult | None:
    """The cached search of ``c`` on this model (`cache_path`), or ``None`` (none, or unreadable)."""
    path = cache_path(ctx, c)
    if not path.exists():
        return None
    try:
        result = load_skip_set(path, ctx.info.num_layers)
    except ConfigError:
        return None
    if result.data.get("fingerprint") != ctx.fingerprint():
        return None
    result.data["from_cache"] = True
    return result


def load_skip_set(path: str | Path, num_layers: int) -> _SearchResult:
    """Read a saved search result and check it fits a model of ``num_layers`` blocks.

    Raises:
        ConfigError: missing or unreadable file, wrong format, or a set for another depth.
    """
    flag = "--selector.skip_set"
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(flag, str(path), "an existing file written by a selfsd_bo search") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(flag, str(path), f"a readable JSON skip-set file ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or "bits" not in data:
        raise ConfigError(flag, str(path), f"a file in format {FORMAT!r} (written by a selfsd_bo search)")
    if data.get("num_layers") != num_layers or len(data["bits"]) != 2 * num_layers:
        raise ConfigError(
            flag,
            str(path),
            f"a skip set for a {num_layers}-block model (this one is for {data.get('num_layers')} blocks)",
        )
    data["path"] = str(p)  # where it was read from (it may have been copied)
    return _SearchResult(LayerPlan.from_bits(data["bits"]), float(data["objective"]["value"]), data)
