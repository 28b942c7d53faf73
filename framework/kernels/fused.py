"""Fused sub-layers: one compiled call per attention or MLP branch of a Llama-family block.

Why: on a CPU, a decoding step of a small model spends a large share of its time outside the
matrix products: a Llama block runs about 25 small PyTorch ops and a dozen Python module calls per
token (RMSNorm, three projections, RoPE, the cache write, attention, the output projection, SiLU,
the residual adds), about 0.45 ms per block for SmolLM2-135M on this project's CPU, i.e. a quarter
of the step (measured: the linear layers alone take 35 ms of a 49 ms step at 2 threads).
`FusedBlocks` runs each branch as one call into the compiled kernels (``attn_branch``,
``mlp_branch`` of ``csrc/selfspec_kernels.cpp``): the same arithmetic, the same batch-invariant
linear and attention kernels, one OpenMP team per branch.

What it covers: blocks laid out like ``LlamaDecoderLayer`` (pre-norm RMSNorm, q/k/v/o projections
with or without biases, RoPE as ``q * cos + rotate_half(q) * sin``, GQA, ``down(silu(gate(x)) *
up(x))``), float32 on a CPU, one sequence (batch 1) of at most `kernels.MAX_ROWS` new tokens. Each
block is checked once, numerically, against its own Hugging Face modules (`FusedBlocks.build`); a
block that differs (q/k norms, a NoPE layer, another activation, a changed modeling file) keeps the
module path, so the fast path can never silently change a model's computation. Everything else (a
batch of several sequences, a long prefill, another device or dtype) takes the module path too.

Numerics: a fused branch and the module path with the kernels installed agree to float32 rounding
(RMSNorm and SiLU are computed in a different order than ATen's), not bit for bit. Greedy
equality between speculative and plain decoding does not need them to agree: both decode through
the same path, and every phase of a fused branch is row-wise with a fixed operation order, so a
row's result does not depend on how many rows share the call (tested in
``tests/framework/kernels/test_fused.py``).
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from framework.kernels import cpu as kernels
from framework.kernels.lowbit import quantize_int4
from framework.kernels.protocols import BranchModel, CacheSlots
from framework.utils import release_free_memory

_F32 = torch.float32
#: Largest head dimension the kernel's RoPE buffer holds.
MAX_HEAD_DIM = 1024


@dataclass(frozen=True)
class _Attn:
    """One attention branch: its parameters in the kernel's order (the modules' own Parameter
    objects, whose data follows the model through ``.to()`` or ``load_state_dict``) and shapes."""

    norm: torch.Tensor
    eps: float
    params: tuple[torch.Tensor | None, ...]  # q weight, q bias, k weight, k bias, v ..., o ...
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    #: scales of int8 (per row) or int4 (per row and group) weights (q, k, v, o), ``None`` for float
    wscales: tuple[torch.Tensor | None, ...] = (None,) * 4


@dataclass(frozen=True)
class _Mlp:
    """One MLP branch: parameters as `_Attn`'s (gate, up, down; weight and bias each)."""

    norm: torch.Tensor
    eps: float
    params: tuple[torch.Tensor | None, ...]
    intermediate: int
    wscales: tuple[torch.Tensor | None, ...] = (None,) * 3  # gate, up, down


def _ptrs(params: tuple[torch.Tensor | None, ...]) -> list[int]:
    return [0 if p is None else p.data_ptr() for p in params]


#: How the kernels can store a draft's copy of the weights (`FusedBlocks.compressed`), and the
#: storage code each is passed to them with (``csrc``: kFloat32, kBFloat16, kInt8, kInt4).
WEIGHT_FORMATS = {"float32": 0, "bfloat16": 1, "int8": 2, "int4": 3}
#: The format a draft with compressed branches scores a reduced draft head in, per branch format
#: (`FusedBlocks.head`, `framework.engine.draft_head.DraftHead.logits`): the head follows the
#: blocks down to 8 bits (an int4 draft keeps an int8 head: its top-1 is the drafted token).
HEAD_FORMATS = {"bfloat16": "bfloat16", "int8": "int8", "int4": "int8"}


def compress_weight(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(stored weight, per-row scale or None)`` of a float32 (N, K) weight in format ``fmt``.

    ``bfloat16``: rounded to nearest (ties to even), 16 bits a weight. ``int8``: symmetric,
    one float32 scale per output row, ``w[n, k] ~ scale[n] * q[n, k]`` with ``q`` in [-127, 127]
    (weight-only: the activations stay float32), 8 bits a weight. ``int4``: 4 bits a weight with a
    scale per row and group of 64 inputs (`framework.kernels.lowbit.quantize_int4`; the kernel
    quantises the activations to int8 per group of 64 and multiplies integers).
    """
    if fmt == "bfloat16":
        return w.detach().to(torch.bfloat16).contiguous(), None
    if fmt == "int4":
        return quantize_int4(w.detach())
    if fmt == "int8":
        w = w.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        return q, scale.contiguous()
    raise ValueError(f"a weight format to compress to must be 'bfloat16', 'int8' or 'int4', got {fmt!r}")


#: Compressed copies already made, per weight tensor (by identity) and format: several adapters
#: over one model (a benchmark builds one per method) share them. An entry is reused only while the
#: weight's in-place version counter is unchanged (``load_state_dict`` and ``copy_`` bump it), and
#: is dropped with the weight.
_COMPRESSED: dict[int, tuple[weakref.ref, dict[str, tuple[int, torch.Tensor, torch.Tensor | None]]]] = {}


def _compressed(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    key = id(w)
    slot = _COMPRESSED.get(key)
    if slot is None or slot[0]() is not w:
        slot = (weakref.ref(w), {})
        _COMPRESSED[key] = slot
        weakref.finalize(w, _COMPRESSED.pop, key, None)
    hit = slot[1].get(fmt)
    if hit is not None and hit[0] == w._version:
        return hit[1], hit[2]
    q, scale = compress_weight(w, fmt)
    release_free_memory()  # the temporaries' heap (see there)
    slot[1][fmt] = (w._version, q, scale)
    return q, scale


def _compress_params(
    params: tuple[torch.Tensor | None, ...], fmt: str
) -> tuple[tuple[torch.Tensor | None, ...], tuple[torch.Tensor | None, ...]]:
    """(weight, bias) pairs -> the same pairs with compressed weights (biases shared), and scales."""
    out: list[torch.Tensor | None] = []
    scales: list[torch.Tensor | None] = []
    for w, b in zip(params[::2], params[1::2], strict=True):
        assert w is not None
        q, sc = _compressed(w, fmt)
        out += [q, b]
        scales.append(sc)
    return tuple(out), tuple(scales)


def _plain_f32(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype is _F32 and t.is_cpu and t.is_contiguous()) for t in tensors)


class FusedBlocks:
    """The fused branches of the blocks of one model that passed `build`'s check.

    Attributes:
        attn: per block, the attention branch's modules, or ``None`` (module path).
        mlp: per block, the MLP branch's modules, or ``None``.
    """

    def __init__(
        self,
        attn: list[_Attn | None],
        mlp: list[_Mlp | None],
        ext: Any,
        *,
        weights: str = "float32",
        probe: torch.Tensor | None = None,
        head: str | None = None,
    ) -> None:
        self.attn = attn
        self.mlp = mlp
        self._ext = ext
        #: how the branches' weights are stored (`WEIGHT_FORMATS`): the model's own float32
        #: parameters, or a draft's compressed copy (`compressed`)
        self.weights = weights
        #: the format a draft running these branches scores a reduced draft head in (`HEAD_FORMATS`
        #: of a compressed copy; ``None``: the head's float32 rows)
        self.head = head
        self._code = WEIGHT_FORMATS[weights]
        first = next((a.params[0] for a in attn if a is not None), None)
        self._probe = first if probe is None else probe  # a float32 weight of the model itself

    def compressed(self, fmt: str) -> FusedBlocks:
        """The same branches with their weights copied into ``fmt`` (``"bfloat16"``, ``"int8"`` or
        ``"int4"``, `compress_weight`): a cheaper draft of the same model (a memory-bound CPU step reads every
        weight once: half or a quarter of the bytes). Norms and biases stay float32 and shared; the
        activations, the KV cache and the attention stay float32. A branch that is not fused keeps
        the module path (full precision). Copies are shared by the adapters of one model. The copy
        does not follow the model (``.to()``, ``load_state_dict``): build it again after changing
        the weights (a weight changed in place is compressed again then).

        Raises:
            ValueError: an unknown format.
        """
        if fmt == "float32":
            return self
        attn = [
            None if a is None else dataclasses.replace(a, params=p, wscales=sc)
            for a in self.attn
            for p, sc in [_compress_params(a.params, fmt) if a is not None else ((), ())]
        ]
        mlp = [
            None if m is None else dataclasses.replace(m, params=p, wscales=sc)
            for m in self.mlp
            for p, sc in [_compress_params(m.params, fmt) if m is not None else ((), ())]
        ]
        return FusedBlocks(attn, mlp, self._ext, weights=fmt, probe=self._probe, head=HEAD_FORMATS[fmt])

    def with_head(self, head: str | None) -> FusedBlocks:
        """The same branches (shared, not copied) with drafts scoring a reduced head in ``head``
        (``None``: its float32 rows; an ablation of the compressed head)."""
        return FusedBlocks(self.attn, self.mlp, self._ext, weights=self.weights, probe=self._probe, head=head)

    @property
    def nbytes(self) -> int:
        """Bytes of the weights (and scales) the branches read."""
        total = 0
        for b in [*self.attn, *self.mlp]:
            if b is not None:
                total += sum(
                    t.numel() * t.element_size() for t in (*b.params[::2], *b.wscales) if t is not None
                )
        return total

    @property
    def int4_kernel(self) -> str:
        """How the kernels multiply an ``int4`` copy: ``"avx512_vnni"`` (integer dot products, 64
        weights an instruction) or ``"scalar"`` (correct, slow: no VNNI in this build)."""
        return str(getattr(self._ext, "int4_kernel", "scalar"))

    @property
    def num_fused(self) -> int:
        """Branches that run fused (out of 2L)."""
        return sum(a is not None for a in self.attn) + sum(m is not None for m in self.mlp)

    def applies(self, hidden: torch.Tensor) -> bool:
        """Whether a forward over ``hidden`` (B, T, d) may take the fused path."""
        w = self._probe
        return (
            hidden.dtype is _F32
            and hidden.is_cpu
            and hidden.dim() == 3
            and hidden.shape[0] == 1
            and 0 < hidden.shape[1] <= kernels.MAX_ROWS
            and not torch.is_grad_enabled()
            and (w is None or (w.dtype is _F32 and w.is_cpu))
        )

    def attention(
        self, i: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: CacheSlots
    ) -> torch.Tensor:
        """``hidden + attention_branch(i, hidden)``, writing the new K/V of block i to ``cache``.

        ``hidden`` (1, T, d) contiguous; ``cos``/``sin`` (1, T, D) contiguous (HF's rotary output).
        """
        a = self.attn[i]
        assert a is not None
        t, d = hidden.shape[1], hidden.shape[2]
        keys, values, base = cache.claim(i)
        # plain causal attention needs no mask (the kernel limits each row to the keys before it);
        # otherwise (1, 1, T, base + T) additive
        mask = None if cache.causal_only(i) else cache.attention_mask(i)
        if mask is None:
            mask_ptr, ms_t, ms_s = 0, 0, 0
        else:
            mask_ptr, ms_t, ms_s = mask.data_ptr(), mask.stride(2), mask.stride(3)
        out = torch.empty_like(hidden)
        self._ext.attn_branch(
            hidden.data_ptr(), out.data_ptr(), t, d, a.norm.data_ptr(), a.eps, *_ptrs(a.params),
            a.heads, a.kv_heads, a.head_dim, cos.data_ptr(), sin.data_ptr(),
            keys.data_ptr(), values.data_ptr(), keys.stride(1), keys.stride(2), base, base + t,
            mask_ptr, ms_t, ms_s, a.scale, torch.get_num_threads(), self._code, *_ptrs(a.wscales),
        )  # fmt: skip
        return out

    def mlp_branch(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden + mlp_branch(i, hidden)``; ``hidden`` (1, T, d) contiguous."""
        m = self.mlp[i]
        assert m is not None
        out = torch.empty_like(hidden)
        self._ext.mlp_branch(
            hidden.data_ptr(), out.data_ptr(), hidden.shape[1], hidden.shape[2], m.norm.data_ptr(), m.eps,
            *_ptrs(m.params), m.intermediate, torch.get_num_threads(), self._code, *_ptrs(m.wscales),
        )  # fmt: skip
        return out

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def build(cls, arch: BranchModel) -> FusedBlocks | None:
        """The fused branches of ``arch``'s blocks that reproduce the module path, or ``None``.

        Each candidate branch is run once on random float32 input (3 tokens at positions 5-7 after
        5 cached ones) both ways; it is fused only if the outputs, and for attention the cache
        writes, agree within float32 tolerance. ``None`` when the kernels are not loaded or no
        branch qualifies.
        """
        ext = kernels.load_extension()
        if ext is None or not hasattr(ext, "attn_branch"):
            return None
        attn = [_attn_modules(arch, blk) for blk in arch.blocks]
        mlp = [_mlp_modules(blk) for blk in arch.blocks]
        fused = cls(attn, mlp, ext)
        _self_check(fused, arch)
        return fused if fused.num_fused else None


def _rms_ok(norm: Any, d: int) -> bool:
    w = getattr(norm, "weight", None)
    return (
        type(norm).__name__.endswith("RMSNorm")
        and isinstance(w, torch.Tensor)
        and w.shape == (d,)
        and isinstance(getattr(norm, "variance_epsilon", None), float)
        and _plain_f32(w)
    )


def _linear_ok(mod: Any, n: int, k: int) -> bool:
    return isinstance(mod, nn.Linear) and mod.weight.shape == (n, k) and _plain_f32(mod.weight, mod.bias)


def _attn_modules(arch: BranchModel, blk: nn.Module) -> _Attn | None:
    attn = getattr(blk, "self_attn", None)
    norm = getattr(blk, "input_layernorm", None)
    d = arch.hidden_size
    heads = getattr(arch.config, "num_attention_heads", 0)
    kv_heads, head_dim = arch.num_kv_heads, arch.head_dim
    if (
        attn is None
        or not _rms_ok(norm, d)
        or any(hasattr(attn, n) for n in ("q_norm", "k_norm"))  # Qwen3-style q/k norms
        or not heads
        or heads % kv_heads
        or head_dim % 2
        or head_dim > MAX_HEAD_DIM
        or not isinstance(getattr(attn, "scaling", None), float)
    ):
        return None
    mods = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    shapes = [
        (heads * head_dim, d),
        (kv_heads * head_dim, d),
        (kv_heads * head_dim, d),
        (d, heads * head_dim),
    ]
    if not all(_linear_ok(m, *s) for m, s in zip(mods, shapes, strict=True)):
        return None
    params = tuple(p for m in mods for p in (m.weight, m.bias))
    return _Attn(norm.weight, norm.variance_epsilon, params, heads, kv_heads, head_dim, attn.scaling)


def _mlp_modules(blk: nn.Module) -> _Mlp | None:
    mlp = getattr(blk, "mlp", None)
    norm = getattr(blk, "post_attention_layernorm", None)
    if mlp is None or type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLUActivation", "SiLU"):
        return None
    gate, up, down = (getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
    if not isinstance(gate, nn.Linear):
        return None
    f, d = gate.weight.shape
    if not (_rms_ok(norm, d) and _linear_ok(gate, f, d) and _linear_ok(up, f, d) and _linear_ok(down, d, f)):
        return None
    params = tuple(p for m in (gate, up, down) for p in (m.weight, m.bias))
    return _Mlp(norm.weight, norm.variance_epsilon, params, f)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = float(b.abs().max()) + 1e-6
    return bool((a - b).abs().max() <= 1e-4 * scale)


@torch.inference_mode()
def _self_check(fused: FusedBlocks, arch: BranchModel) -> None:
    """Drop every branch whose fused result differs from the module path (see `FusedBlocks.build`)."""
    g = torch.Generator().manual_seed(0)
    d, n, ctx, t = arch.hidden_size, arch.num_layers, 5, 3
    if arch.device.type != "cpu" or arch.dtype is not _F32:
        fused.attn = [None] * n
        fused.mlp = [None] * n
        return
    h = torch.randn(1, t, d, generator=g)
    pos = torch.arange(ctx, ctx + t)[None]
    cos, sin = (c.contiguous() for c in arch.rotary(h, pos))
    kv_shape = (1, arch.num_kv_heads, ctx, arch.head_dim)
    for i in range(n):
        if fused.attn[i] is not None:
            past = (torch.randn(kv_shape, generator=g), torch.randn(kv_shape, generator=g))
            runs = []
            for use_fused in (False, True):
                cache = arch.new_cache(ctx + t)
                cache.keys[i, :, :, :ctx] = past[0]  # the same committed context both ways
                cache.values[i, :, :, :ctx] = past[1]
                cache.committed, cache.lengths = ctx, [ctx] * n
                cache.begin(t)
                if use_fused:
                    out = fused.attention(i, h, cos, sin, cache)
                else:
                    out = h + arch.attention_branch(i, h, (cos, sin), cache.attention_mask(i), cache)
                cache.end()
                runs.append((out, cache.keys[i], cache.values[i]))
            if not all(_close(f, m) for f, m in zip(runs[1], runs[0], strict=True)):
                fused.attn[i] = None
        if fused.mlp[i] is not None and not _close(fused.mlp_branch(i, h), h + arch.mlp_branch(i, h)):
            fused.mlp[i] = None
