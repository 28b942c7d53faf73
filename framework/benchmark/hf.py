"""Hugging Face ``model.generate`` as a decoder of the benchmark: ``hf_generate`` (greedy),
``hf_prompt_lookup`` (prompt lookup decoding) and ``hf_early_exit`` (HF's self-speculation: the
first E layers draft).

They get the same input ids, ``max_new_tokens`` and EOS ids as our decoders, ``do_sample=False``,
and a neutral generation config (`neutral_generation_config`: the model's own
``generation_config`` is swapped out for the call); their new tokens are cut by the same
`StopCondition` as ours.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from framework.config_fields import ConfigError
from framework.engine.decoding import PLAIN_ROUND, GenerationResult, StopCondition
from framework.kernels import cpu as fast_kernels
from framework.session.methods import HF_METHODS
from framework.types import RoundRecord

#: Messages Hugging Face logs from inside its own assisted generation (its early-exit assistant
#: calls ``generate`` with a config and keyword arguments together), not about anything we pass.
_HF_INTERNAL_NOISE = ("Passing `generation_config` together with generation-related arguments",)


class _DropHFInternalNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(_HF_INTERNAL_NOISE)


@contextlib.contextmanager
def _quiet_hf_internals() -> Any:
    """Drop `_HF_INTERNAL_NOISE` from transformers' generation logger for the duration (every other
    message still reaches the terminal)."""
    log = logging.getLogger("transformers.generation.utils")
    filt = _DropHFInternalNoise()
    log.addFilter(filt)
    try:
        yield
    finally:
        log.removeFilter(filt)


def neutral_generation_config(**overrides: Any) -> Any:
    """A `GenerationConfig` that adds nothing to greedy decoding: no repetition penalty, no n-gram
    blocking, no forced / suppressed / biased tokens. The minimum length is left unset (HF's global
    default, 0): set explicitly, HF's assistant for early exit warns on every round."""
    from transformers import GenerationConfig

    base = dict(
        do_sample=False,
        num_beams=1,
        temperature=1.0,
        top_k=None,
        top_p=1.0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        bad_words_ids=None,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
        sequence_bias=None,
        renormalize_logits=False,
        remove_invalid_values=False,
        use_cache=True,
        return_dict_in_generate=False,
    )
    base.update(overrides)
    return GenerationConfig(**base)


class HFGenerateDecoder:
    """Hugging Face ``model.generate`` behind the decoders' ``generate(prompt_ids, stop)`` API.

    Args:
        model: the shared Hugging Face causal LM.
        method: ``hf_generate``, ``hf_prompt_lookup`` or ``hf_early_exit``.
        prompt_lookup_num_tokens: prompt lookup's draft length.
        max_matching_ngram_size: prompt lookup's longest n-gram to match.
        early_exit_layer: E of ``hf_early_exit``.
        kernels: run ``generate`` with this framework's CPU kernels in place (`framework.kernels.cpu`);
            by default they are taken out for the call, so that HF runs as users run it.

    The round statistics of the assisted methods (candidates proposed, matches per round) are read
    from HF's candidate generator, wrapped for the call. HF's first round is also the prefill; as
    in our decoders, the token the prefill yields is not counted in a round, so ``sum(accept
    lengths) = new tokens - 1``.
    """

    def __init__(
        self,
        model: Any,
        method: str,
        *,
        prompt_lookup_num_tokens: int = 10,
        max_matching_ngram_size: int | None = None,
        early_exit_layer: int | None = None,
        kernels: bool = False,
    ) -> None:
        if method not in HF_METHODS:
            raise ValueError(f"unknown HF method {method!r}; choose from {', '.join(HF_METHODS)}")
        self.model, self.name = model, method
        self.num_layers = int(model.config.num_hidden_layers)
        extra: dict[str, Any] = {}
        if method == "hf_prompt_lookup":
            extra["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
            if max_matching_ngram_size is not None:
                extra["max_matching_ngram_size"] = max_matching_ngram_size
        elif method == "hf_early_exit":
            e = early_exit_layer or max(1, min(self.num_layers - 1, round(0.8 * self.num_layers)))
            if not 1 <= e < self.num_layers:
                raise ConfigError(
                    "--early-exit-layer",
                    e,
                    f"in [1, {self.num_layers - 1}] (the model has {self.num_layers} layers)",
                )
            extra["assistant_early_exit"] = e
        self.extra = extra
        self.kernels = kernels

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.extra.items()) or "greedy"

    @torch.inference_mode()
    def generate(self, prompt_ids: torch.Tensor, stop: StopCondition) -> GenerationResult:
        if stop.stop_strings:
            raise ValueError("the HF methods of the benchmark support EOS ids only, not stop strings")
        model = self.model
        eos = sorted(stop.eos)
        gen_cfg = neutral_generation_config(
            max_new_tokens=stop.max_new_tokens,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else None,
            **self.extra,
        )
        rounds: list[tuple[int, int]] = []  # (candidates proposed, matches) per round
        base_model = getattr(model, model.base_model_prefix, model)
        saved_layers = base_model.config.num_hidden_layers
        saved_gen_cfg = model.generation_config
        original = getattr(type(model), "_get_candidate_generator", None)
        if self.extra and original is not None:
            model._get_candidate_generator = _recording(original.__get__(model), rounds)
        model.generation_config = neutral_generation_config()
        sync = torch.cuda.synchronize if prompt_ids.device.type == "cuda" else (lambda: None)
        try:
            with (
                contextlib.nullcontext() if self.kernels else fast_kernels.stock(model),
                _quiet_hf_internals(),
            ):
                sync()
                t0 = time.perf_counter()
                out = model.generate(
                    prompt_ids, attention_mask=torch.ones_like(prompt_ids), generation_config=gen_cfg
                )
                sync()
                wall = time.perf_counter() - t0
        finally:
            model.generation_config = saved_gen_cfg
            base_model.config.num_hidden_layers = saved_layers  # HF's early exit sets it per round
            model.__dict__.pop("_get_candidate_generator", None)
        new = out[0, prompt_ids.shape[1] :].tolist()
        cut = stop.find_cut(new, 0) or (len(new), "max_new_tokens")
        tokens = new[: cut[0]]
        records = [RoundRecord(c, m, m + 1, 0.0) for c, m in rounds] if self.extra else []
        if records:  # the prefill's token
            first = records[0]
            records[0] = RoundRecord(first.drafted, first.accepted, first.committed - 1, 0.0)
        return GenerationResult(
            tokens=tokens,
            wall_time=wall,
            stop_reason=cut[1],
            rounds=records or [PLAIN_ROUND] * (len(tokens) - 1),
            plain=not records,
        )


def _recording(get_generator: Callable[..., Any], rounds: list[tuple[int, int]]) -> Callable[..., Any]:
    """Wrap HF's ``_get_candidate_generator`` so that each round's candidates and matches land in
    ``rounds`` (pure bookkeeping: the calls and their results are unchanged)."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        gen = get_generator(*args, **kwargs)
        get_candidates, update = gen.get_candidates, gen.update_candidate_strategy
        pending: list[int] = []

        def get_candidates_rec(input_ids: torch.Tensor, *a: Any, **k: Any) -> Any:
            out = get_candidates(input_ids, *a, **k)
            pending.append(int(out[0].shape[1] - input_ids.shape[1]))
            return out

        def update_rec(input_ids: torch.Tensor, scores: Any, num_matches: Any) -> Any:
            rounds.append((pending.pop() if pending else 0, int(num_matches)))
            return update(input_ids, scores, num_matches)

        gen.get_candidates, gen.update_candidate_strategy = get_candidates_rec, update_rec
        return gen

    return wrapped


__all__ = ["HF_METHODS", "HFGenerateDecoder", "neutral_generation_config"]
