"""A reduced-vocabulary LM head for drafts: score only the K most frequent tokens.

Why: a draft step pays the embedding, the final norm and the whole LM head (``V x d``) before any
decoder block runs. On SmolLM2-135M (V = 49,152, d = 576) the head costs as much as several of
its 30 blocks, on Qwen2.5-0.5B (V = 151,936, d = 896) a quarter of a step: skipping layers cannot
make a draft cheap while every draft token pays the full head. The verifier needs the full head
(it decides which token the target emits), the draft does not: it only has to propose likely
tokens, and most generated tokens come from a small part of the vocabulary. This is the idea of
frequency-ranked drafting (FR-Spec, Zhao et al., 2025); the code here is our own.

What:

- `DraftHead`: rows ``ids`` (K token ids) of the LM head's weight, copied once into a contiguous
  ``(K, d)`` matrix. ``logits(normed)`` costs ``K / V`` of the full head; the drafted token is
  ``ids[argmax]``. Verification keeps the full head, so greedy decoding stays token-identical to
  plain greedy decoding (a token outside the set is simply never proposed), and speculative
  sampling stays exact with the draft distribution defined over the subset:
  ``q(x) = warp(l)_x`` for ``x`` in ``ids``, ``q(x) = 0`` elsewhere, where ``l`` is the draft's
  logits with ``-inf`` outside ``ids`` (the verifier's warping restricted to the subset:
  temperature, top-k, top-p, then renormalised over the K tokens). The sampling rule is exact for
  any q that is the distribution the draft token was drawn from, and ``Draft.probs`` is that q.
  Draft confidences (``Draft.confidences``, the length controllers' stopping signal) are top-1
  probabilities of this q, renormalised over the K tokens.
- `LiveDraftHead`: one generation's head (`DraftHead.start`): the shared K rows plus, with
  ``context``, the tokens of this generation's prompt and answer so far (an extension beyond
  FR-Spec: most tokens a static ranking misses are names, numbers and words the context already
  holds). It counts how many committed tokens it covered.

Which K tokens: `framework.engine.token_ranking` (built from the model's own output, cached per
model). The drafters that run the LM head (``layer_skip``, ``early_exit``, ``hybrid``'s layer-skip
source) take the head as the option ``draft_vocab`` (`framework.drafting.draft_vocab`); the
decoder hands the drafter's head to the decode state (``DecodeState.draft_head``, the generation's
`LiveDraftHead`: every ``forward_draft`` and ``forward_scratch`` uses it) and to the other
strategies' preparation (``PrepareContext.draft_head``), so that selectors that score draft-like
passes (SWIFT's matchness, DEL's shadow tokens, Self-SD's search) optimise the draft that actually
runs, and the cost model prices drafts with it.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from framework.kernels import cpu as kernels
from framework.kernels.fused import compress_weight
from framework.utils import release_free_memory

#: Rows a reduced head copies or compresses at a time (`DraftHead._chunks`).
CHUNK_ROWS = 2048

#: The smallest reduced head `DraftHead` accepts (the drafters' ``draft_vocab`` option asks for at
#: least `framework.drafting.draft_vocab.MIN_DRAFT_VOCAB`).
MIN_SIZE = 2


class DraftHead:
    """The LM head restricted to ``ids``: draft logits over K tokens instead of V.

    Shared by every generation of a run and never changed after construction; a generation drafts
    with `start`'s `LiveDraftHead`, which adds the tokens of its own context when ``context``.

    Args:
        adapter: the model's executor (`framework.engine.adapter.ModelAdapter`): its architecture's
            LM head weights.
        ids: the K token ids the draft may propose (distinct, in ``[0, V)``), any order.
        name: a short description for logs and records (e.g. ``"top-8192 of calibration counts"``).
        context: each generation's head also scores the tokens of its context: the prompt's and
            every committed token's (`LiveDraftHead`; an extension beyond FR-Spec's static set).

    Attributes:
        ids: LongTensor (K,) on the model's device.
        mask: BoolTensor (V,), ``True`` at the ids.
        weight: FloatTensor (K, d), the LM head's rows of the ids (a contiguous copy, made on first
            use).
        bias: FloatTensor (K,) or ``None``.

    Raises:
        ValueError: ids out of range or repeated, or fewer than `MIN_SIZE`.
        HeadNotLinear: an adapter whose LM head is not a plain linear map of the final norm's
            output (soft-capping, scaling: the restricted rows would not reproduce its logits).
    """

    def __init__(
        self, adapter: Any, ids: Sequence[int] | torch.Tensor, *, name: str = "", context: bool = False
    ) -> None:
        weight, bias = adapter.arch.head_parameters()
        vocab = int(weight.shape[0])
        ids_t = torch.as_tensor(ids, dtype=torch.long).flatten().cpu()
        k = int(ids_t.numel())
        if not MIN_SIZE <= k <= vocab:
            raise ValueError(f"a draft head needs between {MIN_SIZE} and V = {vocab} token ids, got {k}")
        if int(ids_t.min()) < 0 or int(ids_t.max()) >= vocab:
            raise ValueError(
                f"draft head token ids must be in [0, {vocab}), got {int(ids_t.min())}..{int(ids_t.max())}"
            )
        if int(torch.unique(ids_t).numel()) != k:
            raise ValueError("draft head token ids must be distinct")
        device = weight.device
        self.vocab_size = vocab
        self.context = context
        #: the token ids in their order, digested on the host: two heads of one size and name over
        #: other tokens (or in another order) have other graph keys
        self.digest = hashlib.blake2b(ids_t.numpy().tobytes(), digest_size=8).hexdigest()
        self.name = name or f"{k} of {vocab} tokens"
        with torch.inference_mode(False), torch.no_grad():
            self.head_weight, self.head_bias = weight, bias  # the full head's (for context rows)
            self.ids = ids_t.to(device)
            self._weight: torch.Tensor | None = None  # the float32 rows, built on first use (`weight`)
            self.bias = None if bias is None else bias.detach().index_select(0, self.ids).contiguous()
            self.mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.mask[self.ids] = True
        #: compressed copies of ``weight`` by format (`logits`)
        self._copies: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        #: `context_buffers` by capacity: (the live head holding them, the buffers)
        self._context_sets: dict[int, list[tuple[Any, tuple]]] = {}
        self._check(adapter)

    @property
    def weight(self) -> torch.Tensor:
        """FloatTensor (K, d): the LM head's rows of the ids, a contiguous copy made on first use
        (a run whose drafts score the head compressed, `logits` with ``fmt``, never makes it)."""
        w = self._weight
        if w is None:
            with torch.inference_mode(False), torch.no_grad():
                w = self._weight = self._rows()
        return w

    def _chunks(self) -> Iterator[torch.Tensor]:
        """The rows of the ids, `CHUNK_ROWS` at a time (from `weight` if made): whatever is built
        from them never holds a float32 copy of all K rows at once (peak memory)."""
        for i in range(0, self.size, CHUNK_ROWS):
            if self._weight is not None:
                yield self._weight[i : i + CHUNK_ROWS]
            else:
                yield self.head_weight.detach().index_select(0, self.ids[i : i + CHUNK_ROWS])

    def _rows(self) -> torch.Tensor:
        """The rows of the ids as one contiguous copy (what `weight` keeps)."""
        return torch.cat(list(self._chunks())).contiguous()

    def _compress(self, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The K rows in ``fmt`` (`compress_weight`), compressed a chunk at a time."""
        parts = [compress_weight(rows, fmt) for rows in self._chunks()]
        scales = [sc for _, sc in parts if sc is not None]
        out = torch.cat([q for q, _ in parts]).contiguous(), torch.cat(scales) if scales else None
        del parts
        release_free_memory()
        return out

    @property
    def size(self) -> int:
        """K, the number of tokens the draft scores (now)."""
        return int(self.ids.numel())

    @functools.cached_property
    def host_ids(self) -> frozenset[int]:
        """The K token ids as a set on the host (made once: membership without a device read)."""
        return frozenset(self.ids.tolist())

    @property
    def key(self) -> str:
        """Identifies the head among others of the same model (cache keys)."""
        return f"{self.size}:{int(self.context)}:{self.name}"

    def logits(self, normed: torch.Tensor, fmt: str | None = None) -> torch.Tensor:
        """(..., d) final-norm outputs -> (..., K) logits over `ids` (column j scores ``ids[j]``).

        ``fmt``: score the K rows from a copy in this format (``"bfloat16"`` or ``"int8"``, built
        once per format) through the CPU kernels: what a draft whose blocks run a compressed copy
        of the fused branches does (`framework.kernels.fused.FusedBlocks.head`), so that it does
        not stream the float32 head (on SmolLM2-135M with int8 blocks, a quarter of a draft's
        bytes). ``None``, or inputs the kernels do not take (another device or dtype, more than
        ``MAX_ROWS`` rows): the float32 rows.
        """
        if fmt is not None:
            copy = self._copies.get(fmt)
            if copy is None:
                copy = self._copies[fmt] = self._compress(fmt)
            out = kernels.linear_lowp(normed, *copy, self.bias, fmt)
            if out is not None:
                return out
        return kernels.linear(normed, self.weight, self.bias)

    def tokens(self, index: torch.Tensor) -> torch.Tensor:
        """Column indices into the K logits -> vocabulary token ids (same shape, on ``index``'s
        device: the head may sit on another device than the logits when the model is split)."""
        return self.ids[index.to(self.ids.device)].to(index.device)

    def expand(self, values: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
        """(..., K) values over `ids` -> (..., V), ``fill`` elsewhere (``-inf`` for logits, 0 for
        probabilities): what a sampler that works on the whole vocabulary needs."""
        out = torch.full(
            (*values.shape[:-1], self.vocab_size), fill, dtype=values.dtype, device=values.device
        )
        out[..., self.ids.to(values.device)] = values
        return out

    def fixed(self) -> DraftHead | FixedView:
        """The head as a CUDA graph may hold it: tensors that keep their address and shape while
        the head serves a generation (this head itself; a growing one's `FixedView`)."""
        return self

    def context_buffers(
        self, capacity: int, holder: Any
    ) -> tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]]:
        """Context rows' buffers of ``capacity`` rows for a generation's `LiveDraftHead`
        (``holder``): ids, weights, bias and the room's mask, the same tensors from one generation
        to the next (a graph recorded on them serves the next generation too), a set of their own
        for a head whose set is held by another live head. Returns ``(which set, buffers)``."""
        sets = self._context_sets.setdefault(capacity, [])
        for i, (held, bufs) in enumerate(sets):
            if held() is None or held() is holder:
                sets[i] = (weakref.ref(holder), bufs)
                return i, bufs
        d, dev = self.head_weight.shape[1], self.ids.device
        with torch.inference_mode(False):
            bufs = (
                torch.zeros(capacity, dtype=torch.long, device=dev),
                self.head_weight.detach().new_zeros(capacity, d),
                None if self.head_bias is None else self.head_bias.detach().new_zeros(capacity),
                torch.zeros(capacity, dtype=torch.float32, device=dev),
            )
        sets.append((weakref.ref(holder), bufs))
        return len(sets) - 1, bufs

    @property
    def graph_key(self) -> Hashable:
        """What a graph holding `fixed` is keyed by: which tokens its columns score (`digest`), not
        only how many (a graph holds the rows it was recorded with)."""
        return (self.key, self.size, self.digest)

    def coverage(self, tokens: torch.Tensor | Iterable[int]) -> float:
        """Share of ``tokens`` that the head can propose (0.0 for no tokens)."""
        t = torch.as_tensor(
            list(tokens) if not isinstance(tokens, torch.Tensor) else tokens, dtype=torch.long
        )
        if t.numel() == 0:
            return 0.0
        return float(self.mask[t.to(self.mask.device)].float().mean())

    def start(self, prompt: torch.Tensor) -> LiveDraftHead:
        """The head of one generation over ``prompt`` (LongTensor (B, P)): see `LiveDraftHead`."""
        return LiveDraftHead(self, prompt)

    def _check(self, adapter: Any) -> None:
        """The restricted rows must reproduce the adapter's own head on those columns.

        The reference is the same product in float64 (the rows as stored, the same input), and the
        tolerance follows the weights' dtype: the head's logits are rounded to that dtype (2^-8
        relative in bfloat16, 2^-11 in float16) and summed in some order, so ``HEAD_CHECK_ULPS``
        units of its rounding, relative to the largest logit, and never below 1e-3. The input is
        scaled so that the largest logit is `HEAD_CHECK_SCALE`: a soft-capped head (Gemma 2 caps
        at 30) or a scaled one (Cohere's 0.0625, Granite's 1/16) then misses the reference by far
        more than any rounding.

        Raises:
            HeadNotLinear: the LM head is not a plain linear map of its input.
        """
        w = self.head_weight
        gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            x = torch.randn(1, 1, w.shape[1], generator=gen, dtype=torch.float64)
            rows = torch.cat([r.double() for r in self._chunks()])
            bias = None if self.bias is None else self.bias.double()
            scale = HEAD_CHECK_SCALE / float(F.linear(x, rows).abs().max().clamp_min(1e-30))
            x = (x * scale).to(device=w.device, dtype=w.dtype)  # what the model is given
            want = F.linear(x.double(), rows, bias)
            got = adapter.arch.lm_head(x)[..., self.ids].double()
        tol = head_check_tolerance(w.dtype) * float(want.abs().max())
        err = float((got - want).abs().max())
        if not err <= tol:
            raise HeadNotLinear(
                f"{type(adapter.arch).__name__}'s LM head is not a plain linear map of the final "
                f"norm's output (its logits miss the rows' product by {err:.3g}, more than {w.dtype}'s "
                f"rounding allows, {tol:.3g}: soft-capping or scaling?), so a reduced draft head "
                "cannot reproduce it; use the full vocabulary (draft_vocab 0)"
            )


#: The largest logit of `DraftHead._check`'s probe input.
HEAD_CHECK_SCALE = 100.0

#: `DraftHead._check` allows this many units of the weights' rounding (relative to the largest
#: logit): the product's own rounding to the dtype is half a unit, the rest is the order of the sums.
HEAD_CHECK_ULPS = 4


def head_check_tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of `DraftHead._check` for LM head weights of ``dtype``: `HEAD_CHECK_ULPS`
    units of its rounding (``torch.finfo(dtype).eps``), at least 1e-3 (0.031 in bfloat16, 0.0039
    in float16, 1e-3 in float32)."""
    return max(1e-3, HEAD_CHECK_ULPS * torch.finfo(dtype).eps)


class HeadNotLinear(ValueError):
    """The model's LM head is not a plain linear map of the final norm's output (soft-capping or
    scaling), so no reduced draft head can reproduce its logits: the architecture's fault, not a
    setting's."""


class LiveDraftHead(DraftHead):
    """One generation's draft head: the shared head's K tokens, plus (when ``base.context``) every
    token of this generation's context that is not among them.

    The context rows start with the prompt's tokens and grow with each committed token
    (`observe`, called by ``DecodeState.commit``): a name, a number or an identifier that the
    prompt or the answer so far contains is likely to recur, and most tokens the static ranking
    misses are such words. Logits are the shared head's K columns followed by the context rows'
    (two matrix products; the context rows are copied from the LM head once each). The set changes
    only between rounds, so a draft's distribution q is well defined at every draft step.

    Which tokens the head holds is known on the host too (the shared ids once per model, the
    context's as they come), so a round's `observe` of the committed tokens, which the host has
    already, reads nothing from the device: it uploads only the ids of new context rows.

    Also counts how many committed tokens the head could have proposed when they were committed
    (`committed`, `covered`).
    """

    @torch.inference_mode()
    def __init__(self, base: DraftHead, prompt: torch.Tensor) -> None:
        self.base = base
        self.vocab_size = base.vocab_size
        self.context = base.context
        self.name = base.name
        self.committed = 0
        self.covered = 0
        self._n = 0
        device = base.ids.device
        self._extra_ids = torch.zeros(0, dtype=torch.long, device=device)
        self._extra_w = base.head_weight.detach().new_zeros(0, base.head_weight.shape[1])
        self._extra_b = None if base.bias is None else base.bias.new_zeros(0)
        #: 0 for the context rows held, -inf for the room after them (`FixedView`)
        self._room = torch.zeros(0, dtype=torch.float32, device=device)
        self._slot = 0  # which of the base's buffer sets of this capacity (`context_buffers`)
        self.ids = base.ids
        self.mask = base.mask
        self.bias = base.bias
        self._extra: set[int] = set()  # the context rows' ids, on the host
        if self.context:
            self.mask = base.mask.clone()
            self._add(prompt.reshape(-1).tolist())

    @property
    def weight(self) -> torch.Tensor:
        """The shared head's K rows (`DraftHead.weight`; the context rows are apart)."""
        return self.base.weight

    def logits(self, normed: torch.Tensor, fmt: str | None = None) -> torch.Tensor:
        head = self.base.logits(normed, fmt)
        if not self._n:
            return head
        n = self._n
        bias = None if self._extra_b is None else self._extra_b[:n]
        return torch.cat([head, kernels.linear(normed, self._extra_w[:n], bias)], dim=-1)

    def start(self, prompt: torch.Tensor) -> LiveDraftHead:
        return self.base.start(prompt)

    @property
    def capacity(self) -> int:
        """Context rows the buffers have room for (they double when full)."""
        return int(self._extra_ids.numel())

    def fixed(self) -> DraftHead | FixedView:
        return FixedView(self) if self.context else self.base

    @property
    def graph_key(self) -> Hashable:
        if not self.context:
            return self.base.graph_key
        return (*self.base.graph_key, "room", self.capacity, self._slot)

    def holds(self, token: int) -> bool:
        """Whether the head can propose ``token`` now."""
        return token in self.base.host_ids or token in self._extra

    @torch.inference_mode()
    def observe(self, tokens: torch.Tensor, host: Sequence[int] | None = None) -> None:
        """Committed tokens (any shape; ``host``: the same as Python ints, when the caller has
        them: then nothing is read): count how many the head covered, then add the new ones to
        the context rows (with ``context``)."""
        flat = tokens.reshape(-1).tolist() if host is None else list(host)
        missing = [t for t in flat if not self.holds(t)]
        self.committed += len(flat)
        self.covered += len(flat) - len(missing)
        if self.context and missing:
            self._add(missing)

    @torch.inference_mode()
    def _add(self, tokens: Sequence[int]) -> None:
        new = sorted({t for t in tokens if not self.holds(t)})
        if not new:
            return
        n, m = self._n, len(new)
        if n + m > self._extra_ids.numel():  # grow the buffers (doubling), the room masked
            cap = max(2 * self._extra_ids.numel(), n + m, 64)
            self._slot, (ids, w, b, room) = self.base.context_buffers(cap, self)
            ids[:n], w[:n], room[:n] = self._extra_ids[:n], self._extra_w[:n], 0.0
            room[n:] = float("-inf")
            if b is not None and self._extra_b is not None:
                b[:n] = self._extra_b[:n]
            self._extra_ids, self._extra_w, self._extra_b, self._room = ids, w, b, room
        rows = torch.tensor(new, dtype=torch.long).to(self._extra_ids.device, non_blocking=True)
        self._extra_ids[n : n + m] = rows
        self._extra_w[n : n + m] = self.base.head_weight.detach().index_select(0, rows)
        if self._extra_b is not None:
            self._extra_b[n : n + m] = self.base.head_bias.detach().index_select(0, rows)
        self._room[n : n + m] = 0.0
        self._n = n + m
        self._extra.update(new)
        self.mask[rows] = True
        self.ids = torch.cat([self.base.ids, self._extra_ids[: self._n]])


class FixedView:
    """A growing head (`LiveDraftHead`) as a CUDA graph holds it: every context row it has room
    for, the rows it does not hold yet masked to ``-inf``. Its buffers change in place as the head
    grows, so a graph recorded on it replays with the rows held then; when they double (a new
    `LiveDraftHead.capacity`, in `graph_key`) a new graph is recorded. Its logits have K +
    capacity columns; the first K + n are the live head's (a graph's caller keeps those)."""

    def __init__(self, live: LiveDraftHead) -> None:
        self.live = live
        self.vocab_size = live.vocab_size

    def logits(self, normed: torch.Tensor, fmt: str | None = None) -> torch.Tensor:
        live = self.live
        head = live.base.logits(normed, fmt)
        if not live.capacity:
            return head
        room = kernels.linear(normed, live._extra_w, live._extra_b) + live._room.to(head.dtype)
        return torch.cat([head, room], dim=-1)

    def tokens(self, index: torch.Tensor) -> torch.Tensor:
        ids = torch.cat([self.live.base.ids, self.live._extra_ids])
        return ids[index.to(ids.device)].to(index.device)

    def expand(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Probabilities over the columns -> over the vocabulary (the room's are 0: added, so that
        the room's ids, zeros, change nothing)."""
        if fill != 0.0:
            raise ValueError("a graph's draft head expands probabilities only (fill 0)")
        ids = torch.cat([self.live.base.ids, self.live._extra_ids]).to(values.device)
        out = values.new_zeros(*values.shape[:-1], self.vocab_size)
        return out.index_add_(-1, ids, values)
