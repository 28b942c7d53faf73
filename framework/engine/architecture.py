"""The per-architecture mapping of a Hugging Face causal LM: where its embedding, decoder blocks,
rotary embedding, final norm and LM head live, and how to call one attention and one MLP branch.

For each block ``i`` of a pre-norm decoder the engine computes::

    h = h + attn_i(norm1_i(h))     unless the plan skips attention i   (a skipped attention writes no KV)
    h = h + mlp_i(norm2_i(h))      unless the plan skips MLP i
    ... after block E-1 when plan.exit_layer == E: final_norm -> lm_head

An `Architecture` says where those pieces are; it runs nothing itself. The engine's executor,
`framework.engine.adapter.ModelAdapter`, owns the loop and how it runs (CPU kernels, CUDA
graphs, compressed draft weights, timing). A new architecture is a small registered subclass
(`register_architecture`); `LlamaFamily` covers Llama, Mistral, Qwen2, Qwen3 and SmolLM. No
modeling file is forked: the branches call the model's own modules.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from framework.engine.kv_cache import KVCache
from framework.engine.placement import BlockPlacement
from framework.kernels.fused import FusedBlocks
from framework.types import ModelInfo

_ARCHITECTURES: dict[str, type[Architecture]] = {}


def register_architecture(*model_types: str) -> Callable[[type[Architecture]], type[Architecture]]:
    """Class decorator: use this architecture for HF configs whose ``model_type`` is in
    ``model_types``."""

    def decorator(cls: type[Architecture]) -> type[Architecture]:
        for mt in model_types:
            if mt in _ARCHITECTURES:
                raise ValueError(
                    f"an architecture for model_type {mt!r} is already registered ({_ARCHITECTURES[mt].__name__})"
                )
            _ARCHITECTURES[mt] = cls
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
    return sorted(_ARCHITECTURES)


def architecture_for(model: nn.Module) -> Architecture:
    """The registered `Architecture` of ``model``'s ``config.model_type``, around ``model``.

    Raises:
        ValueError: no architecture is registered for that model type.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _ARCHITECTURES:
        raise ValueError(
            f"no model adapter for model_type {model_type!r}; supported: {', '.join(supported_model_types())}. "
            "An architecture is added with a small @register_architecture subclass of Architecture "
            "(see docs/howto/new_architecture.md)."
        )
    return _ARCHITECTURES[model_type](model)


class Architecture(ABC):
    """Where one HF causal LM architecture keeps its pieces, and how one branch is called.

    Subclasses implement the architecture-specific members; the facts (depth, widths, context,
    device, dtype) and the weight fingerprint are shared.

    Args:
        model: the HF causal LM.
    """

    model_types: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config

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
        every branch runs through the modules). Called by ``ModelAdapter.set_fast_kernels`` once
        the kernels are installed."""
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
        on, whatever path they were loaded from. The slice is hashed rounded to bfloat16, so one
        checkpoint loaded in float32 or bfloat16 has one fingerprint (a skip set searched on a
        CPU in float32 serves a GPU run in bfloat16)."""
        info = self.info()
        emb = self.model.get_input_embeddings().weight[:4, :64].detach().to(torch.bfloat16).float().cpu()
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
    def _first_param(self) -> torch.nn.Parameter:
        """The model's first parameter, looked up once: ``.to()`` moves its data in place, so its
        device and dtype stay the model's (a lookup through ``parameters()`` every forward was a
        measurable share of a declined round on a CPU)."""
        p = self.__dict__.get("_probe_param")
        if p is None:
            p = self.__dict__["_probe_param"] = next(self.model.parameters())
        return p

    @property
    def device(self) -> torch.device:
        return self._first_param.device

    @property
    def dtype(self) -> torch.dtype:
        return self._first_param.dtype

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

    def new_cache(
        self,
        capacity: int,
        batch: int = 1,
        *,
        shards: list[tuple[range, torch.device]] | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """A fresh KV cache of ``capacity`` slots for this model's shapes (its own buffers; one per
        shard of a model split across devices, on the shard's device), in ``dtype`` (default: the
        model's)."""
        return KVCache(
            self.num_layers,
            batch,
            self.num_kv_heads,
            self.head_dim,
            capacity,
            self.dtype if dtype is None else dtype,
            self.device,
            shards=shards,
        )

    def edge_modules(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """``(input side, output side)``: the modules outside the blocks, placed with the first
        and the last blocks of a model split across devices. Default: the HF model's input and
        output embeddings; an architecture with a final norm or a rotary module outside the blocks
        adds them."""
        return [self.model.get_input_embeddings()], [self.model.get_output_embeddings()]

    def place(self, placement: BlockPlacement) -> None:
        """Move the weights where ``placement`` says: each shard's blocks to its device, the input
        side (`edge_modules`) to the first shard's, the output side to the last shard's. A head
        tied to the input embeddings is untied onto the last device when the two differ (its
        weight is then held twice)."""
        if placement.num_layers != self.num_layers:
            raise ValueError(f"the placement has {placement.num_layers} blocks, the model {self.num_layers}")
        inputs, outputs = self.edge_modules()
        emb, head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        tied = emb is not None and head is not None and head.weight is emb.weight
        if tied and placement.input_device != placement.output_device:
            head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=emb.weight.requires_grad)
        for m in inputs:
            m.to(placement.input_device)
        for shard in placement.shards:
            for i in shard.blocks:
                self.blocks[i].to(shard.device)
        for m in outputs:
            m.to(placement.output_device)


@register_architecture("llama", "mistral", "qwen2", "qwen3", "smollm3")
class LlamaFamily(Architecture):
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

    def edge_modules(self) -> tuple[list[nn.Module], list[nn.Module]]:
        return [self._embed, self._rotary], [self._norm, self._head]

    def lm_head(self, hidden):
        return self._head(hidden)
