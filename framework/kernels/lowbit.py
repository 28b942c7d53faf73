"""Compressed draft weights through the model's own modules: fp8, int8, int4 or bfloat16 copies of
the blocks' linear layers that draft passes use and verification does not (any device; on CUDA the
fast path of issue 27).

Why: a decoding step at batch 1 streams every weight once, so a draft that reads fp8 or int8
weights reads half (of bfloat16) or a quarter (of float32) of the bytes of a full-precision step, in
every sub-layer it runs, not only in those it skips (QSpec, QuantSpec: low-precision self-drafts,
full-precision verification). The CPU kernels do this inside their fused branches
(`framework.kernels.fused`); this module does it wherever the branches run through the model's
modules (CUDA eagerly or in CUDA graphs, a model in bfloat16, ``SELFSPEC_KERNEL=0``).

How it plugs in: `LowBitLinears.build` quantises each ``nn.Linear`` of the decoder blocks once and
gives the module an instance-level ``forward`` that, while a draft pass holds `LowBitLinears.active`,
runs the compressed copy, and otherwise calls the module's class ``forward`` (the model's own
weights; a class the CPU kernels swap in is honoured). No modeling file changes; the attention,
norms, RoPE, the KV cache and every activation keep the model's dtype. CUDA graphs record a branch
once per format (`framework.engine.execution.branches` keys on `active_format`).

Formats (one scale per output row, symmetric):

- ``fp8``: weights in float8 e4m3 (max 448), the activations quantised to e4m3 per token at run
  time, one scaled matrix product (``torch._scaled_mm``, Hopper/Ada tensor cores) with float32
  scales and a bfloat16 output; a weight whose dimensions are not multiples of 16 keeps the module.
- ``int8``: weight-only, ``w ~ scale[n] * q[n, k]`` with q in [-127, 127], activations in the
  model's dtype (``torch._weight_int8pack_mm`` where the device has it; else de-quantised per call).
- ``int4``: ``w ~ scale[n, g] * q[n, k]`` with q in [-8, 7] and a scale per row and group of 64
  inputs (the least-squares one of a few), two weights a byte (`quantize_int4`); the activations quantised to int8 per token and
  group of 64 at run time, so each group's product is an exact integer (W4A8, llama.cpp's
  Q4_0 x Q8_0 idea). Only the CPU kernels' fused branches have a fast kernel (AVX-512 VNNI); through
  the modules it runs the reference.
- ``bfloat16``: a bfloat16 copy (for a float32 model; a bfloat16 model already is one).

Each format has a reference implementation in plain float32 arithmetic (`reference_linear`): the
same quantisation, the product accumulated in float32. The fast kernel is used only if it agrees
with the reference on the device (`LowBitLinears.build` checks one layer), else the reference runs
and `kernel` says so: drafts are then correct but slower than the model's own weights, which is
what the drafters' speed check (`framework.drafting.draft_vocab`) measures before using them.
Greedy output never depends on any of this: verification runs the model's own weights.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from framework.kernels.protocols import BranchModel

#: The formats this module compresses to.
LOWBIT_FORMATS = ("fp8", "int8", "int4", "bfloat16")
#: ``int4``: weights (and activations) share one scale per group of this many inputs.
INT4_GROUP = 64
#: ``int4``: the divisors of a group's signed extreme that `quantize_int4` tries for its scale.
INT4_STEPS = (7.0, 7.5, 8.0, 8.5, 9.0, 10.0)
#: ``int4``: rows `quantize_int4` quantises at a time.
INT4_ROWS = 256
#: Largest magnitude of float8 e4m3 (``torch.float8_e4m3fn``).
FP8_MAX = 448.0
_TINY = torch.finfo(torch.float32).tiny

#: The format draft passes run now (`LowBitLinears.active`); ``None``: the model's own weights.
_ACTIVE: list[str | None] = [None]


def active_format() -> str | None:
    """The compressed format the model's linear layers run now (``None``: their own weights)."""
    return _ACTIVE[0]


# ---------------------------------------------------------------------------------- quantisation
def quantize_rows(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(stored weight, float32 scale per output row or None)`` of an (N, K) weight.

    ``fp8``: ``w[n] ~ scale[n] * q[n]``, ``scale = amax|w[n]| / 448``, q in float8 e4m3 (rounded
    to nearest). ``int8``: ``scale = amax|w[n]| / 127``, q rounded and clamped to [-127, 127].
    ``bfloat16``: rounded to nearest, no scale.

    Raises:
        ValueError: an unknown format or a weight that is not 2-D.
    """
    if w.dim() != 2:
        raise ValueError(f"a weight to quantise must be 2-D (N, K), got shape {tuple(w.shape)}")
    w = w.detach().float()
    if fmt == "bfloat16":
        return w.to(torch.bfloat16).contiguous(), None
    if fmt == "int4":
        return quantize_int4(w)
    if fmt not in ("fp8", "int8"):
        raise ValueError(f"a low-bit format must be one of {LOWBIT_FORMATS}, got {fmt!r}")
    top = FP8_MAX if fmt == "fp8" else 127.0
    scale = (w.abs().amax(dim=1) / top).clamp_min(_TINY)
    q = w / scale[:, None]
    if fmt == "fp8":
        return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous(), scale.contiguous()
    return torch.round(q).clamp_(-127, 127).to(torch.int8).contiguous(), scale.contiguous()


def _int4_padded(k: int) -> int:
    return -(-k // (2 * INT4_GROUP)) * 2 * INT4_GROUP


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 (N, Kp / 2), float32 scale (N, Kp / 64))`` of an (N, K) float weight, Kp =
    K rounded up to a multiple of 128 (the padding is zero).

    Per row and group of `INT4_GROUP` inputs, ``w ~ scale * q`` with q in [-8, 7]: the scale is
    the one of `INT4_STEPS` (the group's signed extreme over -d, or over +d) whose rounding has
    the least squared error, so a group uses all 16 levels and may clip its extreme where that
    pays (llama.cpp's signed-extreme scale with a small search; never worse than ``amax / 7``,
    which is among the candidates). Stored as ``u = q + 8`` in nibbles: byte i of each 64-byte
    block j holds input ``128 j + i`` in its low nibble and ``128 j + 64 + i`` in its high nibble
    (the layout the CPU kernel's ``q4_t`` reads: one 64-byte load feeds two groups). Rows are
    quantised `INT4_ROWS` at a time, so the search's float32 temporaries stay small.
    """
    n, k = w.shape
    kp = _int4_padded(k)
    packed = torch.empty(n, kp // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(n, kp // INT4_GROUP, dtype=torch.float32, device=w.device)
    for r in range(0, n, INT4_ROWS):
        packed[r : r + INT4_ROWS], scale[r : r + INT4_ROWS] = _int4_rows(w[r : r + INT4_ROWS], kp)
    return packed, scale


def _int4_rows(w: torch.Tensor, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_int4` of a few rows."""
    n, k = w.shape
    wp = torch.zeros(n, kp, dtype=torch.float32, device=w.device)
    wp[:, :k] = w.float()
    groups = wp.view(n, kp // INT4_GROUP, INT4_GROUP)
    extreme = torch.gather(groups, 2, groups.abs().argmax(dim=2, keepdim=True))
    extreme = torch.where(extreme.abs() < _TINY, torch.full_like(extreme, _TINY), extreme)
    best_q = best_s = best_err = None
    for d in INT4_STEPS:
        for s in (-extreme / d, extreme / d):
            q = torch.round(groups / s).clamp_(-8, 7)
            err = ((q * s - groups) ** 2).sum(dim=2, keepdim=True)
            if best_err is None:
                best_q, best_s, best_err = q, s, err
            else:
                better = err < best_err
                best_q = torch.where(better, q, best_q)
                best_s = torch.where(better, s, best_s)
                best_err = torch.where(better, err, best_err)
    assert best_q is not None and best_s is not None
    u = (best_q + 8).to(torch.uint8).view(n, kp // 128, 2, 64)
    packed = u[:, :, 0, :] | (u[:, :, 1, :] << 4)
    return packed.reshape(n, kp // 2), best_s.squeeze(2)


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The integer weights ``q`` (N, K) in [-8, 7], as float32, of `quantize_int4`'s packing."""
    n = packed.shape[0]
    lo, hi = (packed & 0x0F), (packed >> 4)
    u = torch.stack([lo.view(n, -1, 64), hi.view(n, -1, 64)], dim=2).reshape(n, -1)
    return u[:, :k].float() - 8.0


def quantize_groups_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of activations (M, K) for the int4 format: per row and group of
    `INT4_GROUP`, ``q = round(x * (127 / amax))`` in [-127, 127] (ties to even) as float32 (M,
    Kp), ``scale = amax / 127`` (M, Kp / 64); an all-zero group has q = 0 and scale 0."""
    m, k = x.shape
    kp = _int4_padded(k)
    xp = torch.zeros(m, kp, dtype=torch.float32, device=x.device)
    xp[:, :k] = x.float()
    groups = xp.view(m, kp // INT4_GROUP, INT4_GROUP)
    amax = groups.abs().amax(dim=2)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(groups * inv[:, :, None]).clamp_(-127, 127)
    return q.view(m, kp), amax / 127.0


def int4_reference(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x2`` (M, K) times the int4 copy, in float32: each group's dot product is an exact integer
    (|sum| < 2^24), then scaled by the weight's and the activations' group scales and summed."""
    m = x2.shape[0]
    xq, xs = quantize_groups_int8(x2)
    g = scale.shape[1]
    wq = unpack_int4(packed, xq.shape[1])  # the padding's q is 0
    dots = torch.einsum("mgk,ngk->mng", xq.view(m, g, INT4_GROUP), wq.view(-1, g, INT4_GROUP))
    return (dots * xs[:, None, :] * scale[None, :, :]).sum(dim=2)


def quantize_tokens_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of activations (M, K): float8 e4m3 with one float32 scale per row (M, 1)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_TINY)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


#: The float32 value of each of the 256 float8 e4m3 codes, per device (`_fp8_values`).
_FP8_TABLES: dict[torch.device, torch.Tensor] = {}


def _fp8_values(q: torch.Tensor) -> torch.Tensor:
    """``q`` (float8 e4m3) as float32, bit for bit what ``q.float()`` gives, through a table of the
    256 codes: on a CPU, where the cast has no vectorised loop, three times faster (the reference
    path de-quantises every weight at each call)."""
    table = _FP8_TABLES.get(q.device)
    if table is None:
        with torch.inference_mode(False):
            codes = torch.arange(256, dtype=torch.uint8, device=q.device)
            table = _FP8_TABLES[q.device] = codes.view(torch.float8_e4m3fn).float()
    return torch.take(table, q.view(torch.uint8).long())


def reference_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, fmt: str
) -> torch.Tensor:
    """The format's arithmetic in plain float32 (any device): ``x`` (..., K) -> (..., N) in
    ``x``'s dtype. ``fp8`` quantises the activations per token as the fast kernel does."""
    shape, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if fmt == "fp8":
        xq, xs = quantize_tokens_fp8(x2)
        out = (xq.float() @ _fp8_values(q).t()) * xs * scale[None, :]  # type: ignore[index]
    elif fmt == "int8":
        out = (x2.float() @ q.float().t()) * scale[None, :]  # type: ignore[index]
    elif fmt == "int4":
        out = int4_reference(x2, q, scale)  # type: ignore[arg-type]
    else:
        out = x2.to(torch.bfloat16).float() @ q.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*shape, q.shape[0])


def fast_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, fmt: str
) -> torch.Tensor:
    """The format's device kernel: ``torch._scaled_mm`` (fp8, row-wise scales, bfloat16 out),
    ``torch._weight_int8pack_mm`` (int8 weight-only), a bfloat16 matrix product; ``int4`` has
    none through the modules (only the CPU kernels' fused branches run it fast).

    Raises:
        NotImplementedError: ``int4``.
    """
    if fmt == "int4":
        raise NotImplementedError("int4 runs fast only in the CPU kernels' fused branches")
    shape, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if fmt == "fp8":
        xq, xs = quantize_tokens_fp8(x2)
        out = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale[None, :], out_dtype=torch.bfloat16)  # type: ignore[index]
    elif fmt == "int8":
        out = torch._weight_int8pack_mm(x2, q, scale.to(x2.dtype))  # type: ignore[union-attr]
    else:
        out = x2.to(torch.bfloat16) @ q.t()
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out.reshape(*shape, q.shape[0])


def dequant_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, fmt: str
) -> torch.Tensor:
    """int8 without a fused kernel: the weight de-quantised to ``x``'s dtype in each call (reads
    int8 but writes a full-precision copy: slower than the model's own weights on a GPU)."""
    w = q.to(x.dtype) * scale.to(x.dtype)[:, None]  # type: ignore[union-attr]
    return nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


#: Each way to run a format: name -> function (`LowBitLinears.kernel` says which one runs).
KERNELS = {"fast": fast_linear, "reference": reference_linear, "dequant": dequant_linear}


def _supported(fmt: str, w: torch.Tensor) -> bool:
    """Whether weight ``w`` is compressed in ``fmt`` (fp8's scaled product needs dimensions that
    are multiples of 16)."""
    return w.dim() == 2 and (fmt != "fp8" or (w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0))


# ---------------------------------------------------------------------------------- the copies
@dataclass(frozen=True)
class _Packed:
    """One linear layer's compressed copy."""

    q: torch.Tensor
    scale: torch.Tensor | None


class LowBitLinears:
    """Compressed copies of a model's block linear layers, used while `active` (see the module
    docstring). Built by `build`; `framework.engine.adapter.ModelAdapter.draft_branches` keeps one
    per format.

    Attributes:
        weights: the format (``"fp8"``, ``"int8"``, ``"bfloat16"``): what ``--drafter.draft_weights``
            names and the cost model records.
        kernel: ``"fast"`` (the device's kernel), ``"dequant"`` (int8 without one) or
            ``"reference"`` (float32 emulation: correct, slow).
        covered: ``(compressed layers, linear layers in the blocks)``.
    """

    def __init__(self, fmt: str, packed: dict[nn.Linear, _Packed], total: int, kernel: str) -> None:
        self.weights = fmt
        self.kernel = kernel
        self.covered = (len(packed), total)
        self._packed = packed
        self._run = KERNELS[kernel]

    @property
    def nbytes(self) -> int:
        """Bytes of the compressed weights and scales."""
        return sum(self.nbytes_of(m) or 0 for m in self._packed)

    def nbytes_of(self, mod: nn.Module) -> int | None:
        """Bytes of ``mod``'s compressed weight and scales (``None``: not compressed)."""
        p = self._packed.get(mod)  # type: ignore[call-overload]
        if p is None:
            return None
        return p.q.numel() * p.q.element_size() + (0 if p.scale is None else p.scale.numel() * 4)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Inside: the blocks' linear layers run this copy (nests; restores the previous)."""
        before = _ACTIVE[0]
        _ACTIVE[0] = self.weights
        try:
            yield
        finally:
            _ACTIVE[0] = before

    def linear(self, mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``mod``'s output on ``x`` from the compressed copy."""
        p = self._packed[mod]
        return self._run(x, p.q, p.scale, mod.bias, self.weights)

    @classmethod
    @torch.no_grad()
    def build(cls, arch: BranchModel, fmt: str) -> LowBitLinears | None:
        """Compress every ``nn.Linear`` of ``arch``'s blocks to ``fmt`` and route them through
        `active`; ``None`` when no layer qualifies or the format is the model's own dtype
        (``bfloat16`` on a bfloat16 model).

        Raises:
            ValueError: an unknown format.
        """
        if fmt not in LOWBIT_FORMATS:
            raise ValueError(f"a low-bit format must be one of {LOWBIT_FORMATS}, got {fmt!r}")
        if fmt == "bfloat16" and arch.dtype == torch.bfloat16:
            return None
        linears = [m for blk in arch.blocks for m in blk.modules() if isinstance(m, nn.Linear)]
        packed = {m: _Packed(*quantize_rows(m.weight, fmt)) for m in linears if _supported(fmt, m.weight)}
        if not packed:
            return None
        kernel = _choose_kernel(fmt, next(iter(packed.items())), arch.device)
        lowbit = cls(fmt, packed, len(linears), kernel)
        for mod in packed:
            _route(mod, fmt, lowbit)
        return lowbit


def _choose_kernel(fmt: str, probe: tuple[nn.Linear, _Packed], device: torch.device) -> str:
    """``"fast"`` where the device's kernel `_agrees` with the reference (a CPU has no need of it:
    ``"reference"``), else ``"dequant"`` for int8 and ``"reference"`` otherwise."""
    if device.type != "cpu" and _agrees(fmt, probe, device):
        return "fast"
    return "dequant" if fmt == "int8" and device.type != "cpu" else "reference"


@torch.no_grad()
def _agrees(fmt: str, probe: tuple[nn.Linear, _Packed], device: torch.device) -> bool:
    """Whether `fast_linear` runs on ``device`` and matches `reference_linear` on one layer (to 2%
    of the largest output: the kernels round to bfloat16)."""
    mod, p = probe
    x = torch.randn(3, mod.in_features, device=device, dtype=mod.weight.dtype)
    want = reference_linear(x, p.q, p.scale, mod.bias, fmt).float()
    try:
        got = fast_linear(x, p.q, p.scale, mod.bias, fmt).float()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    tol = 2e-2 * float(want.abs().max()) + 1e-3
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= tol


def _route(mod: nn.Linear, fmt: str, lowbit: LowBitLinears) -> None:
    """Give ``mod`` an instance ``forward`` (`_switch_forward`, bound to it: a deep copy of the
    model rebinds it) that runs ``lowbit`` while its format is active (one copy per format; a later
    build of the same format replaces the earlier)."""
    mod.__dict__.setdefault("_selfspec_lowbit", {})[fmt] = lowbit
    if "forward" not in mod.__dict__:
        mod.forward = types.MethodType(_switch_forward, mod)  # type: ignore[method-assign]


def _switch_forward(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    fmt = _ACTIVE[0]
    if fmt is not None:
        copy = mod.__dict__["_selfspec_lowbit"].get(fmt)
        if copy is not None:
            return copy.linear(mod, x)
    return type(mod).forward(mod, x)
