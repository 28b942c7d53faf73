"""Fast CPU kernels for decoding: a batch-invariant "skinny" linear layer and attention (float32).

Why: on a CPU, stock PyTorch runs a forward over a few new tokens through BLAS kernels tuned for
large matrices, so verifying K + 1 tokens costs about twice a one-token step, and the result of a
row depends on how many rows share the call (``x[:1] @ W.T`` and ``(x @ W.T)[:1]`` differ in the
last bits). Both hurt self-speculative decoding: the first its speed, the second the token-for-token
equality of greedy speculative and greedy plain decoding (a near-tie can flip an argmax).

What: two small C++ kernels (``csrc/selfspec_kernels.cpp``), compiled on first use with
``torch.utils.cpp_extension.load`` by `framework.kernels.extension`:

- ``linear``: ``y = x @ W.T (+ b)`` for ``x`` with few rows (1 .. `MAX_ROWS`). Each weight row is
  streamed from memory once for all rows, so a forward over 5 tokens costs little more than over
  one. Every output element has its own vector accumulator fed in a fixed order, so row ``r`` of the
  result is bit-identical whatever the number of rows and threads.
- ``attention``: softmax attention of each query row over the keys it may see (additive float or
  boolean masks, tree masks included; GQA), visiting keys in order and skipping masked ones; a
  row's result depends only on that row's query and visible keys.

With both in place (`install`), and with the elementwise and row-wise PyTorch ops of the model
(RMSNorm, RoPE, SiLU, residual adds) being row-invariant already, a verification forward over T
tokens gives bit-identical logits to T successive one-token steps, so greedy speculative decoding
reproduces greedy decoding exactly, in float32, by construction (for T <= `MAX_ROWS`; a longer
forward, in practice only a long prompt's prefill, takes oneDNN's matrix product (BLAS where
oneDNN is missing) and SDPA, the same in every decoder).

How it plugs in: `install(model)` changes the class of the model's ``nn.Linear`` modules to
`FastLinear` (same parameters, no copies; tied embeddings stay tied) and switches the model's
attention implementation to ``"selfspec"``, registered with transformers' ``AttentionInterface``.
It also points RMSNorm modules at ``F.rms_norm`` where that reproduces their forward bit for bit
(one ATen call instead of about eight small ops). Everything falls back to the stock path for what
it does not cover: another device (CUDA) or dtype, more than `MAX_ROWS` rows, autograd, dropout,
soft-capping, attention sinks. `uninstall` restores the stock modules.
`framework.engine.adapter.adapter_for` installs them by default (float32 models on a CPU).

bfloat16 (exact mode, `framework.engine.adapter.ModelAdapter.set_exact`): installed on a bfloat16
model, `linear` streams its bfloat16 weights through the kernel (float32 sums in a fixed order,
rounded to bfloat16) and `attention` takes the float32 KV cache exact mode keeps, the bfloat16
queries joining it in float32; so a bfloat16 model's verification rows are bit-identical to its
one-token steps too.

Control: ``SELFSPEC_KERNEL=0`` disables the kernels. The build goes to
``$SELFSPEC_CACHE/kernels`` (default ``~/.cache/selfspec/kernels``), one directory per source,
compiler flags, CPU and torch version, and is reused silently. Without a compiler, a CPU with
neither AVX2+FMA nor AVX-512, or on a failed build, one line on stderr says so and plain PyTorch
is used. Building and loading live in `framework.kernels.extension`; its public names (`ENV_VAR`,
`enabled_by_env`, `load_extension`, `available`, `isa`, `build_dir`, ``unavailable_reason``) are
re-exported here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.kernels import extension
from framework.kernels.extension import ENV_VAR, available, build_dir, enabled_by_env, isa, load_extension

__all__ = [
    "ATTN_IMPLEMENTATION",
    "ENV_VAR",
    "MAX_ROWS",
    "FastLinear",
    "attention",
    "available",
    "build_dir",
    "enabled_by_env",
    "install",
    "is_installed",
    "isa",
    "linear",
    "linear_lowp",
    "load_extension",
    "register_attention",
    "stock",
    "uninstall",
]

#: Name of the attention implementation registered with transformers.
ATTN_IMPLEMENTATION = "selfspec"
#: Largest number of rows (tokens) `linear` sends to the kernel; more go to oneDNN (`_long_linear`:
#: blocked products are faster there). Verification blocks are far smaller; a larger block loses
#: batch invariance.
MAX_ROWS = 64


def __getattr__(name: str) -> Any:
    # ``unavailable_reason`` changes when the kernels load: read it where it lives, not a copy.
    if name == "unavailable_reason":
        return extension.unavailable_reason
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------
# The ops
# ------------------------------------------------------------------------------------------


_F32 = torch.float32
_BF16 = torch.bfloat16
_grad_enabled = torch.is_grad_enabled
_num_threads = torch.get_num_threads


#: The storage codes of ``linear_lowp`` (``csrc``: kBFloat16, kInt8, kInt4).
_LOWP_CODES = {"bfloat16": 1, "int8": 2, "int4": 3}


def linear_lowp(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, fmt: str
) -> torch.Tensor | None:
    """``x @ W.T (+ bias)`` with ``W`` stored compressed (`framework.kernels.fused.compress_weight`'s
    ``(q, scale)`` in ``fmt``: ``bfloat16``, ``int8`` or ``int4``), through the kernel; ``None``
    when the kernel cannot take it (not loaded, ``x`` not float32 on the CPU, more than `MAX_ROWS`
    rows, a bias that is not float32), for the caller to fall back on its float32 weights.

    Raises:
        ValueError: an unknown format.
    """
    code = _LOWP_CODES.get(fmt)
    if code is None:
        raise ValueError(f"a compressed weight format must be one of {list(_LOWP_CODES)}, got {fmt!r}")
    ext = extension.compiled
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (
        ext is None
        or x.dtype is not _F32
        or not x.is_cpu
        or not 0 < rows <= MAX_ROWS
        or (bias is not None and (bias.dtype is not _F32 or not bias.is_cpu))
    ):
        return None
    n = q.shape[0]
    x2 = x.reshape(rows, k).contiguous()
    b = None if bias is None else bias.contiguous()
    out = torch.empty(rows, n, dtype=_F32)
    ext.linear_lowp(
        x2.data_ptr(), k, q.data_ptr(), k, code, 0 if scale is None else scale.data_ptr(),
        0 if b is None else b.data_ptr(), out.data_ptr(), n, rows, n, k, _num_threads(),
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)


#: The oneDNN matrix product for blocks of more than `MAX_ROWS` rows (a long prompt's prefill), or
#: ``None`` where this torch lacks it or it failed its check (`_long_linear`); ``False``: unchecked.
_ONEDNN: Any = False


def _onednn_linear() -> Any:
    """``torch.ops.mkldnn._linear_pointwise`` once it has reproduced ``F.linear`` on a small case
    (float32 rounding; checked on first use), else ``None``."""
    global _ONEDNN
    if _ONEDNN is False:
        _ONEDNN = None
        op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
        if op is not None and torch.backends.mkldnn.is_available():
            g = torch.Generator().manual_seed(0)
            x, w, b = (torch.randn(*s, generator=g) for s in ((MAX_ROWS + 3, 40), (24, 40), (24,)))
            try:
                ok = torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
            except RuntimeError:
                ok = False
            _ONEDNN = op if ok else None
    return _ONEDNN


def _long_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for a float32 block of more than `MAX_ROWS` rows, through oneDNN where it
    applies (a contiguous weight): on this project's CPU (AMD EPYC, 2 threads) it multiplied
    65-2,000 rows by Qwen2.5-0.5B's weights 1.8-2.6x faster than ``F.linear``'s BLAS (MKL, whose
    code path on AMD CPUs does not use AVX-512), which made a 2,000-token prefill 1.56x faster.
    Only long prompts' prefills take it, the same in every decoder, so it moves no token."""
    op = _onednn_linear() if weight.is_contiguous() else None
    if op is None:
        return F.linear(x, weight, bias)
    k = x.shape[-1]
    out = op(x.reshape(-1, k), weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the kernel for float32 CPU inputs of at most
    `MAX_ROWS` rows (``x.numel() // in_features``), through oneDNN for longer float32 blocks
    (`_long_linear`), through ``F.linear`` otherwise.

    Row ``r`` of the kernel's result is bit-identical whatever the number of rows or threads.
    """
    ext = extension.compiled
    if x.dtype is _BF16 and ext is not None:
        return _linear_bf16(x, weight, bias)
    # The checks are ordered and written for speed: this runs ~200 times per decoded token.
    if (
        ext is None
        or x.dtype is not _F32
        or weight.dtype is not _F32
        or not x.is_cpu
        or not weight.is_cpu
        or weight.dim() != 2
        or (_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight, bias)
    n, k = weight.shape
    rows = x.numel() // k if k else 0
    if rows <= 0 or x.shape[-1] != k:
        return F.linear(x, weight, bias)
    if bias is not None:
        if (
            bias.dtype is not _F32
            or not bias.is_cpu
            or bias.dim() != 1
            or (_grad_enabled() and bias.requires_grad)
        ):
            return F.linear(x, weight, bias)
        if not bias.is_contiguous():
            bias = bias.contiguous()
    if rows > MAX_ROWS:
        return _long_linear(x, weight, bias)
    if weight.is_contiguous():
        ldw = k
    elif weight.stride(1) == 1:
        ldw = weight.stride(0)
    else:
        return F.linear(x, weight, bias)
    out = torch.empty(*x.shape[:-1], n, dtype=_F32)
    if x.is_contiguous():
        ldx = k
    else:
        x = x.reshape(rows, k)
        if x.stride(1) != 1:
            x = x.contiguous()
        ldx = x.stride(0)
    ext.linear(
        x.data_ptr(),
        ldx,
        weight.data_ptr(),
        ldw,
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        rows,
        n,
        k,
        _num_threads(),
    )
    return out


def _linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of a bfloat16 model (exact mode, `install`ed on a bfloat16 CPU model): blocks
    of at most `MAX_ROWS` rows through the kernel, which streams the bfloat16 weights and
    accumulates each output element in float32 in a fixed order (`linear_lowp`), so that a row's
    result is bit-identical whatever the number of rows; the result is rounded to bfloat16, as a
    bfloat16 matrix product rounds its float32 sums. Longer blocks (a long prompt's prefill, the
    same in every decoder) and anything else go through ``F.linear``."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if (
        weight.dtype is not _BF16
        or not x.is_cpu
        or not weight.is_cpu
        or weight.dim() != 2
        or not weight.is_contiguous()
        or weight.shape[1] != k
        or not 0 < rows <= MAX_ROWS
        or (_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight, bias)
    b = None if bias is None else bias.detach().float()
    out = linear_lowp(x.float(), weight, None, b, "bfloat16")
    return F.linear(x, weight, bias) if out is None else out.to(_BF16)


class FastLinear(nn.Linear):
    """``nn.Linear`` whose forward goes through `linear` (the kernel where it applies).

    `install` switches existing ``nn.Linear`` modules to this class in place; the parameters are
    the module's own.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)


# Keyword arguments of an attention call that change its result and the kernel does not implement.
_UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias", "cache")


def _sdpa(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An attention function for transformers' ``AttentionInterface`` (registered as
    ``"selfspec"``): the kernel for float32 CPU inputs of at most `MAX_ROWS` query rows, SDPA for
    everything else (longer blocks, in practice a long prompt's prefill, included).

    Args:
        module: the HF attention module (for ``is_causal``, ``training``).
        query: (B, H, T, D).
        key: (B, H_kv, S, D), H a multiple of H_kv (GQA).
        value: (B, H_kv, S, D).
        attention_mask: ``None``, an additive float mask or a boolean mask (True = attend),
            broadcastable from (B or 1, H or 1, T, S). Positions at ``finfo.min`` (or ``-inf``) are
            masked out.
        dropout: as for ``sdpa_attention_forward``.
        scaling: as for ``sdpa_attention_forward``.
        is_causal: as for ``sdpa_attention_forward``.

    Returns:
        (output (B, T, H, D), None).
    """
    ext = extension.compiled
    out_dtype = query.dtype
    if out_dtype is not key.dtype and key.dtype is _F32:
        # a bfloat16 model in exact mode keeps its KV cache in float32 (`ModelAdapter.set_exact`):
        # the queries join it there, and the output goes back to the model's dtype
        query = query.float()
    plan = (
        None
        if ext is None
        else _attention_plan(module, query, key, value, attention_mask, dropout, is_causal, kwargs)
    )
    if plan is None:
        out, weights = _sdpa(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
        return out.to(out_dtype), weights
    b, h, t, d, hkv, s, causal = plan
    if query.stride(3) != 1:
        query = query.contiguous()
    if key.stride(3) != 1:
        key = key.contiguous()
    if value.stride(3) != 1:
        value = value.contiguous()
    qs, ks, vs = query.stride(), key.stride(), value.stride()
    if attention_mask is None:
        mask_kind, mask_ptr, ms = 0, 0, (0, 0, 0, 0)
    else:
        m = attention_mask.expand(b, h, t, s)
        mask_kind = 2 if m.dtype is torch.bool else 1
        mask_ptr, ms = m.data_ptr(), m.stride()
    out = torch.empty(b, t, h, d, dtype=_F32)
    ext.attention(
        query.data_ptr(), qs[0], qs[1], qs[2],
        key.data_ptr(), ks[0], ks[1], ks[2],
        value.data_ptr(), vs[0], vs[1], vs[2],
        mask_ptr, mask_kind, ms[0], ms[1], ms[2], ms[3],
        out.data_ptr(), b, h, hkv, t, s, d,
        d**-0.5 if scaling is None else float(scaling), causal, _num_threads(),
    )  # fmt: skip
    return out.to(out_dtype), None


def _attention_plan(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    is_causal: bool | None,
    kwargs: dict[str, Any],
) -> tuple[int, int, int, int, int, int, bool] | None:
    """``(B, H, T, D, H_kv, S, causal)`` if the kernel applies to this call, else ``None``."""
    if (
        query.dtype is not _F32
        or key.dtype is not _F32
        or value.dtype is not _F32
        or not query.is_cpu
        or not key.is_cpu
        or not value.is_cpu
        or query.dim() != 4
        or key.dim() != 4
        or value.shape != key.shape
        or (dropout and module.training)
        or (
            kwargs
            and (kwargs.get("output_attentions") or any(kwargs.get(n) is not None for n in _UNSUPPORTED))
        )
        or (_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
    ):
        return None
    b, h, t, d = query.shape
    kb, hkv, s, kd = key.shape
    if kb != b or kd != d or hkv == 0 or h % hkv or t == 0 or t > MAX_ROWS:
        # More rows than a verification block (a long prompt's prefill): SDPA's blocked matrix
        # products are faster there, and like the linear layers' oneDNN path for such blocks, every
        # decoder takes the same path for them.
        return None
    causal = False
    if mask is None:
        if t > 1:
            causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
            if causal and s != t:  # SDPA's is_causal aligns the mask top-left: leave that case to it
                return None
    elif (
        not mask.is_cpu
        or (mask.dtype is not torch.bool and mask.dtype is not _F32)
        or mask.dim() != 4
        or mask.shape[2] != t
        or mask.shape[3] != s
        or mask.shape[0] not in (1, b)
        or mask.shape[1] not in (1, h)
    ):
        return None
    return b, h, t, d, hkv, s, causal


def register_attention() -> None:
    """Register ``"selfspec"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


# ------------------------------------------------------------------------------------------
# Installing into a model
# ------------------------------------------------------------------------------------------

_INSTALLED = "_selfspec_kernels"  # model attribute: the attention implementation it had before


class _FusedRMSNorm:
    """Mixin of the RMSNorm subclasses `install` creates: ``F.rms_norm`` (one ATen call instead of
    about eight small ops) for float32 CPU inputs, the HF module's own forward otherwise."""

    _selfspec_base: type[nn.Module]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.weight  # type: ignore[attr-defined]
        if hidden_states.dtype is _F32 and w.dtype is _F32 and hidden_states.is_cpu:
            return F.rms_norm(hidden_states, (hidden_states.shape[-1],), w, self.variance_epsilon)  # type: ignore[attr-defined]
        return self._selfspec_base.forward(self, hidden_states)  # type: ignore[arg-type]


_FUSED_NORM_CLASSES: dict[type, type] = {}


def _fused_norm_class(mod: nn.Module) -> type | None:
    """The fused subclass for an RMSNorm module, or ``None`` if ``F.rms_norm`` does not reproduce
    its forward bit for bit (checked on random float32 inputs: a norm with other semantics, such as
    Gemma's ``1 + weight``, is left alone)."""
    cls = type(mod)
    if cls in _FUSED_NORM_CLASSES:
        return _FUSED_NORM_CLASSES[cls]
    weight = getattr(mod, "weight", None)
    eps = getattr(mod, "variance_epsilon", None)
    if (
        not cls.__name__.endswith("RMSNorm")
        or not isinstance(weight, torch.Tensor)
        or weight.dim() != 1
        or not isinstance(eps, float)
        or weight.dtype is not _F32
        or not weight.is_cpu
    ):
        return None
    fused = type(f"Fused{cls.__name__}", (_FusedRMSNorm, cls), {"_selfspec_base": cls})
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, weight.shape[0], generator=g, dtype=_F32) * 3.0
    with torch.inference_mode():
        ok = torch.equal(cls.forward(mod, x), fused.forward(mod, x))  # type: ignore[arg-type]
    _FUSED_NORM_CLASSES[cls] = fused if ok else None  # type: ignore[assignment]
    return _FUSED_NORM_CLASSES[cls]


def is_installed(model: nn.Module) -> bool:
    return hasattr(model, _INSTALLED)


def install(model: nn.Module) -> bool:
    """Route ``model``'s linear layers, attention and RMSNorms through fast paths (idempotent).

    Every module whose class is exactly ``nn.Linear`` becomes a `FastLinear` (the same object and
    parameters, so nothing is copied and tied weights stay tied); the model's attention
    implementation becomes ``"selfspec"`` if it was ``"sdpa"`` or ``"eager"``; and every RMSNorm
    module for which ``F.rms_norm`` gives bit-identical results (checked here) gets a subclass that
    calls it (saving per-op overhead; the numbers do not change). All of them fall back to the
    stock code wherever they do not apply, so the model keeps working on any device and dtype.

    Returns:
        ``False`` (and changes nothing) when the kernels are disabled or could not be built.
    """
    if is_installed(model):
        return True
    if load_extension() is None:
        return False
    register_attention()
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = FastLinear
        elif type(mod).__name__.endswith("RMSNorm") and not isinstance(mod, _FusedRMSNorm):
            fused = _fused_norm_class(mod)
            if fused is not None:
                mod.__class__ = fused
    config = getattr(model, "config", None)
    before = getattr(config, "_attn_implementation", None)
    if before in ("sdpa", "eager") and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    setattr(model, _INSTALLED, before)
    return True


def uninstall(model: nn.Module) -> None:
    """Undo `install`: the stock module classes and the previous attention implementation."""
    if not is_installed(model):
        return
    before = getattr(model, _INSTALLED)
    for mod in model.modules():
        if type(mod) is FastLinear:
            mod.__class__ = nn.Linear
        elif isinstance(mod, _FusedRMSNorm):
            mod.__class__ = mod._selfspec_base
    config = getattr(model, "config", None)
    if before is not None and getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
        model.set_attn_implementation(before)
    delattr(model, _INSTALLED)


@contextlib.contextmanager
def stock(model: nn.Module) -> Iterator[None]:
    """The stock PyTorch modules inside the block, the kernels again after it (if they were
    installed): e.g. to time Hugging Face's own ``generate`` as users run it."""
    was = is_installed(model)
    uninstall(model)
    try:
        yield
    finally:
        if was:
            install(model)
