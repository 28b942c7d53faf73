"""Exact mode (``--exact``, `ModelAdapter.set_exact`): plain steps and verifications compute every
row the same way, so greedy speculative output equals the engine's own plain greedy output token
for token in bfloat16 too (issue 38, item 4).

On a CPU a bfloat16 model runs its linear layers through the batch-invariant kernel (bfloat16
weights, float32 sums rounded to bfloat16) and keeps its KV cache in float32 for the float32
attention kernel. On CUDA every forward runs under one SDPA backend (checked here through the
mechanism only: the CPU has no memory-efficient backend).
"""

from __future__ import annotations

import pytest
import torch

from framework.config_fields import ConfigError
from framework.engine.adapter import adapter_for
from framework.kernels import cpu as kernels
from framework.testing import ARCHS, random_prompt, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=f"kernels unavailable: {kernels.unavailable_reason}"
)


def _pos(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n)[None]


def _bf16_adapter(arch: str, exact: bool, seed: int = 0):
    adapter = adapter_for(tiny_model(arch, 4, seed=seed, dtype=torch.bfloat16))
    adapter.set_exact(exact)
    return adapter


def _prefilled(adapter, ids: torch.Tensor, p: int):
    cache = adapter.new_cache(ids.shape[1] + 4)
    adapter.forward(ids[:, :p], _pos(0, p), cache, logits_at=None)
    cache.commit(p)
    return cache


def _steps_and_blocks(adapter, ids: torch.Tensor, p: int) -> tuple[torch.Tensor, list[torch.Tensor], list]:
    """Logits of one-token steps over ``ids[:, p:]`` after a prefill of p, the logits of a
    verification of each length T over the same tokens, and each verification's cache."""
    n = ids.shape[1] - p
    cache = _prefilled(adapter, ids, p)
    steps = []
    for j in range(n):
        steps.append(adapter.forward(ids[:, p + j : p + j + 1], _pos(p + j, 1), cache).logits)
        cache.commit(1)
    blocks, caches = [], [cache]
    for t in range(1, n + 1):
        c = _prefilled(adapter, ids, p)
        blocks.append(adapter.forward(ids[:, p : p + t], _pos(p, t), c, base=p).logits)
        caches.append(c)
    return torch.cat(steps, dim=1), blocks, caches


@pytest.mark.parametrize("arch", ARCHS)
def test_a_bfloat16_verification_is_bit_identical_to_single_steps_in_exact_mode(arch):
    adapter = _bf16_adapter(arch, exact=True)
    assert adapter.exact and adapter.fast_kernels
    p, n = 11, 9
    ids = random_prompt(p + n, seed=3)
    steps, blocks, caches = _steps_and_blocks(adapter, ids, p)
    assert steps.dtype is torch.bfloat16
    for t, got in enumerate(blocks, start=1):
        assert torch.equal(got, steps[:, :t]), f"{arch}, T={t}: a verification differs from single steps"
        kv = caches[t]
        assert torch.equal(kv.keys[:, :, :, : p + t], caches[0].keys[:, :, :, : p + t])
        assert torch.equal(kv.values[:, :, :, : p + t], caches[0].values[:, :, :, : p + t])


def test_exact_mode_runs_bfloat16_linear_layers_through_the_batch_invariant_kernel(monkeypatch):
    """Row invariance by construction, not by the luck of a BLAS (this CPU's bfloat16 products
    happen to be row-invariant for these shapes; another's need not be): every linear layer of a
    bfloat16 model in exact mode runs the kernel (bfloat16 weights, float32 sums in a fixed order,
    rounded to bfloat16), up to `MAX_ROWS` rows; a longer block (a prefill) takes ``F.linear``."""
    adapter = _bf16_adapter("llama", exact=True)
    lin = adapter.arch.model.model.layers[0].mlp.down_proj
    assert isinstance(lin, kernels.FastLinear)
    calls = []
    lowp = kernels.linear_lowp
    monkeypatch.setattr(kernels, "linear_lowp", lambda *a: calls.append(a[4]) or lowp(*a))
    ids = random_prompt(5, seed=4)
    adapter.forward(ids, _pos(0, 5), adapter.new_cache(8))
    n_linear = sum(isinstance(m, kernels.FastLinear) for m in adapter.arch.model.modules())
    assert calls == ["bfloat16"] * n_linear  # every linear layer, the LM head included, once
    monkeypatch.setattr(kernels, "linear_lowp", lowp)
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(512, 576, generator=g) / 24).to(torch.bfloat16)
    x = torch.randn(9, 576, generator=g).to(torch.bfloat16)
    want = kernels.linear_lowp(x.float(), w, None, None, "bfloat16").to(torch.bfloat16)
    assert torch.equal(kernels.linear(x, w), want)
    for t in (1, 2, 5):
        assert torch.equal(kernels.linear(x[:t], w), want[:t])
    long = torch.randn(kernels.MAX_ROWS + 1, 576, generator=g).to(torch.bfloat16)
    assert torch.equal(kernels.linear(long, w), torch.nn.functional.linear(long, w))


def test_exact_mode_keeps_the_models_bfloat16_numbers_up_to_the_order_of_its_sums():
    """The exact route computes what a bfloat16 model computes (bfloat16 weights and activations
    between layers, float32 sums): its logits agree with the stock modules' to bfloat16 rounding,
    so it is the same model, not a float32 one."""
    exact, stock = _bf16_adapter("llama", True), _bf16_adapter("llama", False)
    ids = random_prompt(14, seed=5)
    got = exact.forward(ids, _pos(0, 14), exact.new_cache(16)).logits
    want = stock.forward(ids, _pos(0, 14), stock.new_cache(16)).logits
    assert got.dtype is want.dtype is torch.bfloat16
    assert (got.float() - want.float()).abs().max() < 0.05 * want.float().abs().max()


def test_exact_mode_needs_one_device_and_a_supported_dtype():
    adapter = adapter_for(tiny_model("llama", 4, seed=0, dtype=torch.float16))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        adapter.set_exact(True)
    assert not adapter.exact
    assert adapter.set_exact(False) is False and adapter.kv_dtype is torch.float16


def test_the_backend_of_exact_mode_holds_for_every_attention_of_a_forward(monkeypatch):
    """On CUDA exact mode pins SDPA to one backend for the whole forward. The CPU has no
    memory-efficient backend, so the mechanism is checked with another: every SDPA call of a
    forward (the kernels off) sees only the pinned backend enabled."""
    from torch.nn.attention import SDPBackend

    adapter = adapter_for(tiny_model("llama", 4, seed=0), fast_kernels=False)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids = random_prompt(6, seed=1)
    adapter.forward(ids, _pos(0, 6), adapter.new_cache(8))
    assert seen and all(s == (True, True) for s in seen)  # the dispatch's own choice
    seen.clear()
    adapter.sdpa_backend = SDPBackend.MATH
    adapter.forward(ids, _pos(0, 6), adapter.new_cache(8))
    assert len(seen) == 4 and all(s == (True, False) for s in seen)


def test_exact_flag_is_validated_and_auto_is_on_for_a_cpu_only():
    from framework.session.run_config import ModelConfig, RunConfig

    with pytest.raises(ConfigError, match="--exact must be a boolean"):
        RunConfig.from_preset("static_confidence", exact="sometimes")
    with pytest.raises(ConfigError, match="--no-kernels"):
        RunConfig.from_preset("static_confidence", exact=True, kernels=False)
    assert ModelConfig().exact_on(torch.device("cpu"))
    assert not ModelConfig().exact_on(torch.device("cuda"))
    assert ModelConfig(exact=True).exact_on(torch.device("cuda"))
    assert not ModelConfig(exact=False).exact_on(torch.device("cpu"))
    assert not ModelConfig(kernels=False).exact_on(torch.device("cpu"))
    # the spellings a boolean takes everywhere, and the ones saved configs before it used
    for text, want in (
        ("yes", True),
        ("on", True),
        ("true", True),
        ("no", False),
        ("off", False),
        ("auto", None),
    ):
        assert RunConfig.from_preset("static_confidence", exact=text).model.exact is want


def test_exact_is_a_boolean_flag_like_the_others():
    from framework.runner.cli import build_parser, config_from_args

    for argv, want in (
        (["--exact"], True),
        (["--exact", "yes"], True),
        (["--no-exact"], False),
        (["--exact", "off"], False),
        (["--exact", "auto"], None),
        ([], None),
    ):
        assert config_from_args(build_parser().parse_args(argv)).model.exact is want, argv


def _lossless_presets() -> list[str]:
    from framework import REGISTRIES
    from framework.session.presets import list_presets, load_preset

    out = []
    for name in list_presets():
        data = load_preset(name)
        verifier = data.get("verifier", {}).get("name", "greedy")
        if not data.get("baseline_only") and REGISTRIES["verifier"].get(verifier).lossless == "greedy":
            out.append(name)
    return out


#: Prompts no strategy default was tuned on (seeds used nowhere else in the tests).
HELD_OUT = ((901, 9), (902, 14), (903, 21))


#: The presets the quick check decodes (without exact mode each of the first four differed from plain
#: decoding on these prompts; static_confidence is the default); CI decodes every lossless one.
QUICK = ("clasp", "swift", "selfsd", "hybrid", "static_confidence")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in QUICK else pytest.mark.slow) for n in _lossless_presets()]
)
def test_every_lossless_preset_equals_plain_decoding_in_bfloat16_in_exact_mode(name):
    """The issue's criterion on the CPU: every lossless preset, a bfloat16 model, prompts not
    tuned on, 0 mismatches against our own plain greedy decoding."""
    from framework.session.presets import load_preset
    from framework.session.run_config import RunConfig
    from framework.session.session import Session
    from framework.testing import fast_overrides

    preset = load_preset(name)
    fast = fast_overrides(preset)
    cfg = RunConfig.from_preset(name, max_new_tokens=24, exact=True, **fast)
    model = tiny_model("llama", num_layers=6, seed=9, dtype=torch.bfloat16)
    exp = Session(cfg, model, tiny_tokenizer(), log=lambda _msg: None)
    assert exp.adapter.exact and exp.adapter.kv_dtype is torch.float32
    for seed, plen in HELD_OUT:
        ids = random_prompt(plen, 128, seed=seed)
        want = exp.vanilla.generate(ids, exp.stop()).tokens
        got = exp.spec.generate(ids, exp.stop()).tokens
        assert got == want, f"{name}, held-out prompt {seed}: differs from plain decoding in bfloat16"
