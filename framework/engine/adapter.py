"""The model adapter of one Hugging Face causal LM: its architecture's facts
(`framework.engine.architecture.Architecture`, ``adapter.arch``: where the pieces are, the shape,
the device) and the resources its forwards run with: the batch-invariant CPU kernels and fused
branches (`framework.kernels`), a draft's compressed weights, exact mode's attention backend, the
placement across devices and the KV caches. How a forward runs is the executor's
(`framework.engine.execution`, ``adapter.executor``: the route, the block loop, the CUDA graphs
and the counters of the work done); `ModelAdapter.forward` hands it one forward.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from framework.engine.architecture import Architecture, architecture_for
from framework.engine.execution.executor import Executor
from framework.engine.kv_cache import KVCache
from framework.engine.placement import BlockPlacement
from framework.kernels import cpu as kernels
from framework.kernels.fused import WEIGHT_FORMATS, FusedBlocks
from framework.kernels.lowbit import LOWBIT_FORMATS, LowBitLinears
from framework.kernels.protocols import DraftWeights
from framework.types import ForwardOutput, LayerPlan

if TYPE_CHECKING:
    from framework.engine.draft_head import DraftHead

#: What ``--drafter.draft_weights`` may name: the model's own ("float32"), the CPU kernels' formats
#: and the modules' low-bit formats (`ModelAdapter.draft_branches`).
DRAFT_WEIGHT_FORMATS = ("float32", *LOWBIT_FORMATS)


def adapter_for(model: nn.Module, *, fast_kernels: bool | None = None) -> ModelAdapter:
    """The adapter of ``model`` (its registered `Architecture` for ``config.model_type``).

    Args:
        model: an HF causal LM.
        fast_kernels: route the model's linear layers and attention through the batch-invariant
            CPU kernels of `framework.kernels.cpu` (see `ModelAdapter.set_fast_kernels`). ``None``
            (default): yes for a float32 model on a CPU unless ``SELFSPEC_KERNEL=0``.

    Raises:
        ValueError: no architecture is registered for that model type.
    """
    adapter = ModelAdapter(architecture_for(model))
    adapter.set_fast_kernels(fast_kernels)
    return adapter


class ModelAdapter:
    """One model's facts and resources, and the executor of its forwards.

    Args:
        arch: the model's `Architecture`.

    Attributes:
        arch: the architecture mapping (blocks, branches, norms, head, shape, device, dtype).
        executor: runs the forwards (`framework.engine.execution.executor.Executor`): its CUDA
            graphs and its counters (``forward_calls``, ``block_evals``, ``layer_loads``,
            ``lm_head_seconds``).
        fast_kernels: whether the model runs through `framework.kernels.cpu` (`set_fast_kernels`).
        fused: the fused branches of `framework.kernels.fused` (``None``: the modules).
        exact: exact mode (`set_exact`).
        sdpa_backend: the one SDPA backend every forward uses (exact mode on CUDA), or ``None``.
        kv_dtype: the KV cache's dtype (float32 for a bfloat16 model in exact mode on a CPU).
        placement: where the blocks live (`place`).
    """

    def __init__(self, arch: Architecture) -> None:
        self.arch = arch
        self.fast_kernels = kernels.is_installed(arch.model)
        self.fused: FusedBlocks | None = None
        self.exact = False
        self.sdpa_backend: Any = None
        self.kv_dtype: torch.dtype = arch.dtype
        self._draft_branches: dict[str, DraftWeights | None] = {}  # `draft_branches`, per format
        self.placement = BlockPlacement.of_blocks(arch.blocks)
        self.executor = Executor(self)

    # ---- forwards: the executor's --------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        plan: LayerPlan | None = None,
        **options: Any,
    ) -> ForwardOutput:
        """One forward from token ids (`Executor.forward`; ``options``: `ForwardSpec`'s fields)."""
        return self.executor.forward(input_ids, position_ids, cache, plan, **options)

    def forward_from(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        plan: LayerPlan | None = None,
        **options: Any,
    ) -> ForwardOutput:
        """One forward from residuals that went through blocks ``< start`` (`Executor.forward_from`)."""
        return self.executor.forward_from(hidden, position_ids, cache, plan, **options)

    def top1_from_hidden(
        self, hidden: torch.Tensor, chunk: int = 256, head: DraftHead | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The LM head's (or ``head``'s) greedy token and probability per residual (`Executor.top1_from_hidden`)."""
        return self.executor.top1_from_hidden(hidden, chunk, head)

    def logits_from_hidden(
        self, hidden: torch.Tensor, head: DraftHead | None = None, weights: DraftWeights | None = None
    ) -> torch.Tensor:
        """Final norm + LM head (or ``head``) on residuals (`Executor.logits_from_hidden`)."""
        return self.executor.logits_from_hidden(hidden, head, weights)

    # ---- resources -------------------------------------------------------------------------------
    def place(self, placement: BlockPlacement) -> None:
        """Run the model split as ``placement`` says (``--device-map``): its weights are moved
        there (`Architecture.place`), and its caches get one KV buffer per shard. The CPU kernels'
        fused branches and CUDA graphs serve one device only: a split model runs without them.

        Raises:
            ValueError: CUDA graphs are on, or the placement is for another depth.
        """
        if placement.split and self.executor.graphs is not None:
            raise ValueError(
                "CUDA graphs need the model on one device: turn --cuda-graphs off with --device-map"
            )
        self.arch.place(placement)
        self.placement = placement
        self.executor.placed()
        self._draft_branches.clear()

    def set_fast_kernels(self, enabled: bool | None = None) -> bool:
        """Route the model's linear layers and attention through `framework.kernels.cpu`, or back.

        The kernels make a forward over a few tokens cost about as much as over one on a CPU, and
        make each position's logits bit-identical whatever the number of tokens in the forward
        (so greedy verification reproduces plain greedy decoding exactly in float32). They apply to
        float32 tensors on a CPU; anything else takes the stock path. The model itself is changed
        (the classes of its ``nn.Linear`` and RMSNorm modules and its attention implementation;
        parameters untouched): every adapter and ``model.generate`` see it. With the kernels
        installed, the blocks `build_fused` can fuse run one compiled call per branch (`fused`).

        Args:
            enabled: ``True`` installs, ``False`` restores the stock modules, ``None`` installs for
                a float32 model on a CPU unless ``SELFSPEC_KERNEL=0`` (and otherwise changes nothing).

        Returns:
            Whether the kernels are installed now (``False`` if they could not be built: a
            one-line notice on stderr says why).
        """
        a = self.arch
        if enabled is None:
            if kernels.enabled_by_env() and a.device.type == "cpu" and a.dtype == torch.float32:
                kernels.install(a.model)
        elif enabled:
            kernels.install(a.model)
        else:
            kernels.uninstall(a.model)
        self.fast_kernels = kernels.is_installed(a.model)
        self.fused = a.build_fused() if self.fast_kernels else None
        self._draft_branches.clear()
        return self.fast_kernels

    def set_exact(self, enabled: bool) -> bool:
        """Exact mode: plain steps and verifications compute every row the same way, so greedy
        speculative output equals this engine's own plain greedy output token for token, in any
        supported dtype (docs/performance.md, "Numerics").

        - On a CPU: the batch-invariant kernels (`set_fast_kernels`) for float32 and bfloat16
          models; a bfloat16 model's KV cache is kept in float32 (the same values, which the
          float32 attention kernel reads as they are).
        - On CUDA: every forward's attention through SDPA's memory-efficient backend, which made
          a 9-token verification's logits bit-identical to 9 one-token steps on an H200
          (`docs/measurements/h200-2026-11-28-probe/`).

        Call it before any cache is made (the cache's dtype follows it). ``False`` turns it off.

        Raises:
            ValueError: a model split across devices, a CPU model in a dtype other than float32 or
                bfloat16, kernels that could not be built, or another device type.
        """
        self.exact, self.sdpa_backend, self.kv_dtype = False, None, self.arch.dtype
        if not enabled:
            return False
        if self.placement.split:
            raise ValueError("exact mode serves a model on one device (it is split: --device-map)")
        dev, dtype = self.arch.device, self.arch.dtype
        if dev.type == "cpu":
            if dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(
                    f"exact mode on a CPU needs float32 or bfloat16 weights, the model is {dtype}"
                )
            if not self.fast_kernels and not self.set_fast_kernels(True):
                raise ValueError(
                    f"exact mode on a CPU needs the batch-invariant kernels, which are unavailable: "
                    f"{kernels.unavailable_reason}"
                )
            self.kv_dtype = torch.float32
        elif dev.type == "cuda":
            from torch.nn.attention import SDPBackend

            self.sdpa_backend = SDPBackend.EFFICIENT_ATTENTION
        else:
            raise ValueError(f"exact mode runs on a CPU or CUDA, the model is on {dev}")
        self.exact = True
        return True

    def backend(self) -> Any:
        """The context every forward runs in: the exact mode's SDPA backend, or nothing."""
        if self.sdpa_backend is None:
            return nullcontext()
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(self.sdpa_backend)

    def draft_branches(self, fmt: str) -> DraftWeights | None:
        """The model's weights in ``fmt`` for drafts, built once per format: with the CPU kernels'
        fused branches, ``"bfloat16"``, ``"int8"`` and ``"int4"`` are their compressed copies
        (`FusedBlocks.compressed`); every other case (``"fp8"``, another device or dtype,
        ``SELFSPEC_KERNEL=0``) compresses the blocks' linear layers and runs them through the
        modules (`framework.kernels.lowbit.LowBitLinears`). ``"float32"``: ``fused`` (the model's
        own). ``None``: nothing to compress (``"bfloat16"`` on a bfloat16 model).

        Raises:
            ValueError: an unknown format.
        """
        if fmt not in DRAFT_WEIGHT_FORMATS:
            raise ValueError(f"draft weight format must be one of {list(DRAFT_WEIGHT_FORMATS)}, got {fmt!r}")
        if fmt == "float32":
            return self.fused
        if fmt not in self._draft_branches:
            if self.fused is not None and fmt in WEIGHT_FORMATS:
                self._draft_branches[fmt] = self.fused.compressed(fmt)
            else:
                self._draft_branches[fmt] = LowBitLinears.build(self.arch, fmt)
        return self._draft_branches[fmt]

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        """A KV cache of ``capacity`` slots: the CUDA graphs' KV pool when they are on and it is
        free, else buffers of its own (one per shard of a split model)."""
        a, placement = self.arch, self.placement
        if placement.split:
            return a.new_cache(capacity, batch, shards=[(s.blocks, s.device) for s in placement.shards])
        graphs = self.executor.graphs
        buffers = graphs.pool.lease(capacity, batch) if graphs is not None else None
        if buffers is None or graphs is None:
            return a.new_cache(capacity, batch, dtype=self.kv_dtype)
        cache = KVCache(
            a.num_layers,
            batch,
            a.num_kv_heads,
            a.head_dim,
            capacity,
            a.dtype,
            a.device,
            buffers=buffers,
            on_release=graphs.pool.give_back,
        )
        graphs.pool.lent_to(cache)
        return cache
