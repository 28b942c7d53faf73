"""Run an unmodified Hugging Face causal LM block by block, with sub-layer skipping and early exit.

The adapter owns the loop over decoder blocks; inside a block it calls the model's own modules
(norms, attention, MLP), so no modeling file is forked and new transformers releases keep working.
For each block ``i`` of a pre-norm decoder::

    h = h + attn_i(norm1_i(h))     unless plan skips attention i   (a skipped attention writes no KV)
    h = h + mlp_i(norm2_i(h))      unless plan skips MLP i
    ... after block E-1 when plan.exit_layer == E: final_norm -> lm_head

An architecture is supported by a small registered `ModelAdapter` subclass that says where
its embedding, blocks, rotary embedding, final norm and LM head live and how to call one attention
and one MLP branch. `LlamaFamilyAdapter` covers Llama, Mistral, Qwen2, Qwen3 and SmolLM.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from framework.engine.kv_cache import KVCache
from framework.kernels import cpu as kernels
from framework.kernels.fused import WEIGHT_FORMATS, FusedBlocks
from framework.kernels.graphs import BranchGraphs
from framework.types import LayerPlan, ModelInfo
from framework.utils import no_clock, synced_clock

if TYPE_CHECKING:
    from framework.engine.draft_head import DraftHead

_ADAPTERS: dict[str, type[ModelAdapter]] = {}


def register_adapter(*model_types: str) -> Callable[[type[ModelAdapter]], type[ModelAdapter]]:
    """Class decorator: use this adapter for HF configs whose ``model_type`` is in ``model_types``."""

    def decorator(cls: type[ModelAdapter]) -> type[ModelAdapter]:
        for mt in model_types:
            if mt in _ADAPTERS:
                raise ValueError(
                    f"an adapter for model_type {mt!r} is already registered ({_ADAPTERS[mt].__name__})"
                )
            _ADAPTERS[mt] = cls
        cls.model_types = tuple(model_types)
        return cls

    return decorator


def cache_kwarg(attention: nn.Module) -> str:
    """The name under which this transformers release's attention module takes its KV cache:
    ``cache`` from transformers 5.24 (``past_key_values`` is deprecated there, removed in 5.40),
    ``past_key_values`` before."""
    params = inspect.signature(attention.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def supported_model_types() -> list[str]:
    return sorted(_ADAPTERS)


def adapter_for(model: nn.Module, *, fast_kernels: bool | None = None) -> ModelAdapter:
    """Wrap ``model`` with the adapter registered for its ``config.model_type``.

    Args:
        model: an HF causal LM.
        fast_kernels: route the model's linear layers and attention through the batch-invariant
            CPU kernels of `framework.kernels.cpu` (see `ModelAdapter.set_fast_kernels`). ``None``
            (default): yes for a float32 model on a CPU unless ``SELFSPEC_KERNEL=0``.

    Raises:
        ValueError: no adapter is registered for that architecture.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _ADAPTERS:
        raise ValueError(
            f"no model adapter for model_type {model_type!r}; supported: {', '.join(supported_model_types())}. "
            "An architecture is added with a small @register_adapter subclass of ModelAdapter "
            "(see docs/howto/new_architecture.md)."
        )
    adapter = _ADAPTERS[model_type](model)
    adapter.set_fast_kernels(fast_kernels)
    return adapter


@dataclass
class ForwardOutput:
    """What one adapter forward returns.

    Attributes:
        logits: FloatTensor (B, T', V) at the requested positions, or ``None``; (B, T', K) over
            ``head.ids`` when the pass ran a reduced draft head.
        hidden_states: FloatTensor (L'+1, B, T, d) pre-norm residuals after each block run (index 0
            is the embedding; only when ``capture_hidden``; L' = blocks run).
        last_hidden: FloatTensor (B, T, d), the residual stream where the pass stopped (pre-norm).
        head: the reduced draft head the logits come from (`framework.engine.draft_head.DraftHead`;
            column j scores token ``head.ids[j]``), or ``None``: the full LM head.
    """

    logits: torch.Tensor | None
    hidden_states: torch.Tensor | None
    last_hidden: torch.Tensor
    head: DraftHead | None = None

    def top1(self) -> torch.Tensor:
        """LongTensor (B, T'): the argmax token ids of `logits` (mapped through `head`)."""
        if self.logits is None:
            raise ValueError("this forward computed no logits")
        idx = self.logits.argmax(dim=-1)
        return idx if self.head is None else self.head.tokens(idx)


class ModelAdapter(ABC):
    """Block-level access to one HF causal LM architecture.

    Subclasses implement the architecture-specific pieces; `forward` is shared.

    Attributes:
        lm_head_seconds: wall time spent in final norm + LM head (for time breakdowns), counted
            while `times_lm_head`.
        time_lm_head: ``True`` / ``False`` turn that timer on or off; ``None`` (the default): on
            for a synchronous device (CPU) only, because on CUDA the timer waits for the device
            twice in every forward that computes logits.
        fast_kernels: whether the model runs through `framework.kernels.cpu` (`set_fast_kernels`).
    """

    model_types: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.lm_head_seconds = 0.0
        self.time_lm_head: bool | None = None
        self.forward_calls = 0
        self.block_evals = 0  # blocks entered x tokens, for the layer-cost accounting
        #: blocks entered per call, whatever the number of tokens (DEL's "layers loaded" cost
        #: model, in which a memory-bound forward of n blocks costs n)
        self.layer_loads = 0
        self.fast_kernels = kernels.is_installed(model)
        #: the fused branches of `framework.kernels.fused` (set by `set_fast_kernels`; ``None``: modules)
        self.fused: FusedBlocks | None = None
        #: CUDA graphs of the attention and MLP branches (`set_cuda_graphs`; ``None``: eager)
        self.graphs: BranchGraphs | None = None
        self._draft_branches: dict[str, FusedBlocks] = {}  # `draft_branches`, per format

    # ---- architecture-specific pieces ---------------------------------------------------
    @property
    @abstractmethod
    def blocks(self) -> list[nn.Module]:
        """The decoder blocks in order."""

    @abstractmethod
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, d)."""

    @abstractmethod
    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> Any:
        """Position embeddings for the attention modules (e.g. RoPE cos/sin)."""

    @abstractmethod
    def attention_branch(
        self, i: int, hidden: torch.Tensor, pos_emb: Any, mask: torch.Tensor | None, cache: KVCache
    ) -> torch.Tensor:
        """The residual update of block i's attention sub-layer (norm included); writes KV."""

    @abstractmethod
    def mlp_branch(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """The residual update of block i's MLP sub-layer (norm included)."""

    @abstractmethod
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def build_fused(self) -> FusedBlocks | None:
        """The fused branches for this architecture (`framework.kernels.fused`), or ``None`` (default:
        every branch runs through the modules). Called by `set_fast_kernels` once the kernels are
        installed."""
        return None

    @abstractmethod
    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def head_parameters(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight (V, d), bias (V,) or None)`` of the LM head, for a reduced draft head
        (`framework.engine.draft_head.DraftHead`). Default: the HF model's output embeddings."""
        head = self.model.get_output_embeddings()
        if head is None or not hasattr(head, "weight"):
            raise ValueError(f"{type(self.model).__name__} exposes no output embeddings (LM head weight)")
        return head.weight, getattr(head, "bias", None)

    def fingerprint(self) -> str:
        """A short hash of the model's shape and a slice of its embedding: what is saved for one
        model (a searched skip set, a token ranking) is only valid for the weights it was computed
        on, whatever path they were loaded from."""
        info = self.info()
        emb = self.model.get_input_embeddings().weight[:4, :64].detach().float().cpu()
        h = hashlib.sha256()
        h.update(
            json.dumps(
                [getattr(self.config, "model_type", ""), info.num_layers, info.hidden_size, info.vocab_size]
            ).encode()
        )
        h.update(emb.numpy().tobytes())
        return h.hexdigest()[:16]

    # ---- facts -----------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def hidden_size(self) -> int:
        """The residual width d."""
        return int(self.config.hidden_size)

    @property
    def num_kv_heads(self) -> int:
        c = self.config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def max_context(self) -> int:
        """Longest supported sequence: the position limit, or the sliding window if smaller
        (sliding-window masks are not implemented; the window bounds the context instead)."""
        c = self.config
        limit = getattr(c, "max_position_embeddings", None) or 2048
        window = getattr(c, "sliding_window", None)
        if window and getattr(c, "use_sliding_window", True):
            limit = min(limit, window)
        return int(limit)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def times_lm_head(self) -> bool:
        """Whether forwards add their final norm + LM head time to ``lm_head_seconds``."""
        return self.time_lm_head if self.time_lm_head is not None else self.device.type == "cpu"

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def info(self, name: str = "") -> ModelInfo:
        c = self.config
        return ModelInfo(
            num_layers=self.num_layers,
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            max_context=self.max_context,
            name=name or getattr(c, "_name_or_path", ""),
            dtype=self.dtype,
            device=self.device,
        )

    def set_fast_kernels(self, enabled: bool | None = None) -> bool:
        """Route the model's linear layers and attention through `framework.kernels.cpu`, or back.

        The kernels make a forward over a few tokens cost about as much as over one on a CPU, and
        make each position's logits bit-identical whatever the number of tokens in the forward
        (so greedy verification reproduces plain greedy decoding exactly in float32). They apply to
        float32 tensors on a CPU; anything else takes the stock path, so the model keeps working
        everywhere. The model itself is changed (the classes of its ``nn.Linear`` and RMSNorm
        modules and its attention implementation; parameters untouched): every adapter and
        ``model.generate`` see it.

        Args:
            enabled: ``True`` installs, ``False`` restores the stock modules, ``None`` installs for
                a float32 model on a CPU unless ``SELFSPEC_KERNEL=0`` (and otherwise changes nothing).

        With the kernels installed, the blocks `build_fused` can fuse run one compiled call per
        attention or MLP branch (`fused`; ``adapter.fused = None`` turns that off alone).

        Returns:
            Whether the kernels are installed now (``False`` if they could not be built: a
            one-line notice on stderr says why).
        """
        if enabled is None:
            if kernels.enabled_by_env() and self.device.type == "cpu" and self.dtype == torch.float32:
                kernels.install(self.model)
        elif enabled:
            kernels.install(self.model)
        else:
            kernels.uninstall(self.model)
        self.fast_kernels = kernels.is_installed(self.model)
        self.fused = self.build_fused() if self.fast_kernels else None
        self._draft_branches.clear()
        return self.fast_kernels

    def draft_branches(self, fmt: str) -> FusedBlocks | None:
        """The fused branches with their weights in ``fmt`` for drafts (`FusedBlocks.compressed`:
        ``"bfloat16"`` or ``"int8"``), built once per format; ``fused`` itself for ``"float32"``.
        ``None`` where the branches are not fused (no CPU kernels: another device or dtype,
        ``SELFSPEC_KERNEL=0``): drafts then run the model's own weights.

        Raises:
            ValueError: an unknown format.
        """
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"draft weight format must be one of {sorted(WEIGHT_FORMATS)}, got {fmt!r}")
        if self.fused is None or fmt == "float32":
            return self.fused
        if fmt not in self._draft_branches:
            self._draft_branches[fmt] = self.fused.compressed(fmt)
        return self._draft_branches[fmt]

    def set_cuda_graphs(
        self, enabled: bool, *, capture: bool | None = None, max_tokens: int = 64
    ) -> BranchGraphs | None:
        """Run short forwards (draft steps, plain steps, verifications of chains and token trees of
        up to ``max_tokens`` tokens) through CUDA graphs of each attention and MLP branch
        (`framework.kernels.graphs`), or eagerly again. Prefills run eagerly.

        Args:
            enabled: turn the graphs on or off.
            capture: ``None`` captures graphs on CUDA; ``False`` runs the same static branches
                without capturing them (any device: how the CPU tests check them).
            max_tokens: the longest forward that takes the graphs.

        Raises:
            ValueError: ``capture=True`` on a device that is not CUDA.
        """
        self.graphs = BranchGraphs(self, capture=capture, max_tokens=max_tokens) if enabled else None
        return self.graphs

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        graphs = self.graphs
        buffers = graphs.lease(capacity, batch) if graphs is not None else None
        cache = KVCache(
            self.num_layers,
            batch,
            self.num_kv_heads,
            self.head_dim,
            capacity,
            self.dtype,
            self.device,
            buffers=buffers,
            on_release=graphs.give_back if buffers is not None and graphs is not None else None,
        )
        if buffers is not None and graphs is not None:
            graphs.lent_to(cache)
        return cache

    # ---- the shared forward ------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        plan: LayerPlan | None = None,
        *,
        logits_at: str | torch.Tensor | None = "all",
        capture_hidden: bool = False,
        base: int | None = None,
        visible: int | None = None,
        tree_mask: torch.Tensor | None = None,
        persist: bool = True,
        head: DraftHead | None = None,
        weights: FusedBlocks | None = None,
    ) -> ForwardOutput:
        """Run the (partial) model over new tokens, reading and writing ``cache``.

        Args:
            input_ids: LongTensor (B, T).
            position_ids: LongTensor (B, T), absolute positions (RoPE).
            cache: the KV cache; see `KVCache.begin` for ``base``/``visible``/``tree_mask``/
                ``persist``.
            plan: sub-layers to skip / exit layer; ``None`` runs the full model.
            logits_at: ``"all"``, ``"last"``, a LongTensor of positions in ``[0, T)``, or ``None``
                (no LM head at all).
            capture_hidden: also return every block's output (pre-norm).
            head: a reduced draft head for the logits (``None``: the full LM head).
            weights: a draft's compressed copy of the fused branches (`draft_branches`) to run
                instead of the model's own (``None``: the model's weights).

        Returns:
            ForwardOutput.
        """
        return self.forward_from(
            self.embed(input_ids),
            position_ids,
            cache,
            plan,
            start=0,
            logits_at=logits_at,
            capture_hidden=capture_hidden,
            base=base,
            visible=visible,
            tree_mask=tree_mask,
            persist=persist,
            head=head,
            weights=weights,
        )

    @torch.inference_mode()
    def forward_from(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        plan: LayerPlan | None = None,
        *,
        start: int,
        stop: int | None = None,
        logits_at: str | torch.Tensor | None = None,
        capture_hidden: bool = False,
        base: int | None = None,
        visible: int | None = None,
        tree_mask: torch.Tensor | None = None,
        persist: bool = True,
        head: DraftHead | None = None,
        weights: FusedBlocks | None = None,
    ) -> ForwardOutput:
        """Run blocks ``start .. stop-1`` on residuals that already went through blocks ``< start``.

        `forward` is ``forward_from(embed(input_ids), start=0)``. Starting later resumes a pass
        (verification completing the blocks an early-exit draft did not run); a single block
        (``stop = start + 1``) with ``persist=False`` and a ``tree_mask`` evaluates candidate
        states without touching the committed cache (CLaSp's dynamic programme).

        Args:
            hidden: FloatTensor (B, T, d), the residual stream after ``start`` blocks.
            position_ids: LongTensor (B, T), absolute positions (RoPE).
            cache: as in `forward`; only blocks ``start .. stop-1`` read or write it.
            plan: sub-layers to skip; ``None`` runs every sub-layer of the range.
            start: first block to run (``0 <= start <= stop``).
            stop: one past the last block; default ``plan.blocks_run`` (L without a plan).
            logits_at: as in `forward` (default ``None``: no LM head).
            capture_hidden: also return the residual after each block run; index 0 is ``hidden``.
            head: a reduced draft head for the logits (``None``: the full LM head).
            weights: as in `forward`: the fused branches to run (a draft's compressed weights);
                ``None``: `fused`. A forward they do not apply to runs the model's own path.

        Returns:
            ForwardOutput whose ``hidden_states`` are (stop - start + 1, B, T, d).

        Raises:
            ValueError: a plan of the wrong length, or a block range outside ``[0, L]``.
        """
        if plan is not None and plan.num_layers != self.num_layers:
            raise ValueError(f"the plan has {plan.num_layers} blocks but the model has {self.num_layers}")
        if stop is None:
            stop = self.num_layers if plan is None else plan.blocks_run
        if not 0 <= start <= stop <= self.num_layers:
            raise ValueError(
                f"block range must satisfy 0 <= start <= stop <= {self.num_layers}, got [{start}, {stop})"
            )
        self.forward_calls += 1
        h = hidden
        pos_emb = self.rotary(h, position_ids)
        captured = [h] if capture_hidden else None
        fused = self.fused if weights is None else weights
        fused = fused if fused is not None and fused.applies(h) else None
        if fused is not None:
            h = h.contiguous()
            cos, sin = (p.contiguous() for p in pos_emb)
        graphs = self.graphs
        if graphs is not None and (cache.empty or not graphs.serves(cache, h)):
            graphs = None  # a prefill (each prompt length would be captured once, for one use)
        cache.begin(h.shape[1], base=base, visible=visible, tree_mask=tree_mask, persist=persist)
        try:
            if graphs is not None:
                graphs.set_rotary(pos_emb)
            for i in range(start, stop):
                if plan is None or plan.runs_attn(i):
                    whole, tree = cache.block_mask(i) if graphs is not None else (False, None)
                    if whole and graphs is not None:
                        h = h + graphs.attention(i, h, cache.claim(i)[2], tree)
                    elif fused is not None and fused.attn[i] is not None:
                        h = fused.attention(i, h, cos, sin, cache)
                    else:
                        h = h + self.attention_branch(i, h, pos_emb, cache.attention_mask(i), cache)
                if plan is None or plan.runs_mlp(i):
                    if graphs is not None:
                        h = h + graphs.mlp(i, h)
                    elif fused is not None and fused.mlp[i] is not None:
                        h = fused.mlp_branch(i, h)
                    else:
                        h = h + self.mlp_branch(i, h)
                if captured is not None:
                    captured.append(h)
        finally:
            cache.end()
        self.block_evals += (stop - start) * h.shape[1]
        self.layer_loads += stop - start
        logits = None
        if logits_at is not None:
            timed = self.times_lm_head
            clock = synced_clock(self.device) if timed else no_clock
            t0 = clock()
            sel = h
            if isinstance(logits_at, str):
                if logits_at == "last":
                    sel = h[:, -1:]
                elif logits_at != "all":
                    raise ValueError(f"logits_at must be 'all', 'last', a tensor or None, got {logits_at!r}")
            else:
                sel = h.index_select(1, logits_at.to(h.device))
            normed = self.final_norm(sel)
            logits = self.lm_head(normed) if head is None else head.logits(normed)
            if timed:
                self.lm_head_seconds += clock() - t0
        hidden_states = torch.stack(captured) if captured is not None else None
        return ForwardOutput(logits, hidden_states, h, head if logits is not None else None)

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on pre-norm residuals of any shape (..., d) (shadow predictions)."""
        with torch.inference_mode():
            return self.lm_head(self.final_norm(hidden))

    @torch.inference_mode()
    def top1_from_hidden(
        self, hidden: torch.Tensor, chunk: int = 256, head: DraftHead | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The LM head's greedy token and its probability for each pre-norm residual.

        DEL's "shadow tokens": what an exit after each layer would predict. Rows go through the
        final norm and LM head ``chunk`` at a time, so that N x V logits never exist at once. The
        time is not added to ``lm_head_seconds`` (which counts the heads of forwards); callers
        time it as their own work (a selector's update).

        Args:
            hidden: FloatTensor (..., d).
            chunk: rows per head call.
            head: a reduced draft head (the token and probability among its K tokens, as a draft
                with that head would see them); ``None``: the full LM head.

        Returns:
            (tokens LongTensor (...), probs FloatTensor (...) in float32): argmax and top-1
            softmax probability.
        """
        flat = hidden.reshape(-1, hidden.shape[-1])
        toks, probs = [], []
        for lo in range(0, flat.shape[0], chunk):
            normed = self.final_norm(flat[lo : lo + chunk])
            logits = (self.lm_head(normed) if head is None else head.logits(normed)).float()  # (n, V or K)
            top, idx = logits.max(dim=-1)
            toks.append(idx if head is None else head.tokens(idx))
            probs.append(torch.exp(top - torch.logsumexp(logits, dim=-1)))
        shape = hidden.shape[:-1]
        if not toks:
            return (
                torch.zeros(shape, dtype=torch.long, device=hidden.device),
                torch.zeros(shape, dtype=torch.float32, device=hidden.device),
            )
        return torch.cat(toks).reshape(shape), torch.cat(probs).reshape(shape)


@register_adapter("llama", "mistral", "qwen2", "qwen3", "smollm3")
class LlamaFamilyAdapter(ModelAdapter):
    """Pre-norm decoders laid out like ``LlamaForCausalLM``.

    ``model.model.{embed_tokens, layers, norm, rotary_emb}`` and ``model.lm_head``; every block has
    ``input_layernorm``, ``self_attn``, ``post_attention_layernorm`` and ``mlp``. The attention
    module is called as HF calls it (hidden states, RoPE cos/sin, an additive mask, a cache with
    ``update``), so q/k norms (Qwen3), biases (Qwen2) and GQA come from HF's own code.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        inner = model.model
        self._blocks = list(inner.layers)
        self._embed = inner.embed_tokens
        self._norm = inner.norm
        self._rotary = inner.rotary_emb
        self._head = model.lm_head
        for i, blk in enumerate(self._blocks):
            for attr in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
                if not hasattr(blk, attr):
                    raise ValueError(
                        f"block {i} of {type(model).__name__} has no {attr}: not a Llama-family layout"
                    )
        self._cache_kwarg = cache_kwarg(self._blocks[0].self_attn) if self._blocks else "past_key_values"

    @property
    def blocks(self) -> list[nn.Module]:
        return self._blocks

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._embed(input_ids)

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> Any:
        return self._rotary(hidden, position_ids)

    def build_fused(self) -> FusedBlocks | None:
        return FusedBlocks.build(self)

    def attention_branch(self, i, hidden, pos_emb, mask, cache):
        blk = self._blocks[i]
        out = blk.self_attn(
            hidden_states=blk.input_layernorm(hidden),
            position_embeddings=pos_emb,
            attention_mask=mask,
            **{self._cache_kwarg: cache},
        )
        return out[0]

    def mlp_branch(self, i, hidden):
        blk = self._blocks[i]
        return blk.mlp(blk.post_attention_layernorm(hidden))

    def final_norm(self, hidden):
        return self._norm(hidden)

    def lm_head(self, hidden):
        return self._head(hidden)
