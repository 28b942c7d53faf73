"""Tiny random Hugging Face models and a word-level tokenizer, built in-process (never downloaded).

They serve unit tests (`framework.testing` re-exports them), the smoke mode of sweeps and
tutorials, and anyone who wants to try a strategy in seconds without a real model.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from framework.engine.grammar import CompiledGrammar, Grammar

#: Architectures `tiny_model` can build (all served by the Llama-family adapter).
ARCHS: tuple[str, ...] = ("llama", "qwen2", "mistral", "qwen3")


def _arch_classes(arch: str) -> tuple[type, type]:
    import transformers as tf

    table = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }
    if arch not in table:
        raise ValueError(f"unknown tiny-model arch {arch!r}; choose from {', '.join(ARCHS)}")
    return table[arch]


def tiny_model(
    arch: str = "llama",
    num_layers: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    vocab_size: int = 128,
    **config_overrides: Any,
) -> torch.nn.Module:
    """A small random Hugging Face causal LM built in-process (never downloads), in eval mode.

    The config is hidden 64, 4 attention heads, 2 KV heads (so GQA is exercised), intermediate 128,
    ``max_position_embeddings`` 512. Qwen3 gets ``head_dim=32`` (not hidden / heads = 16), as real
    Qwen3 checkpoints decouple the two; this exercises the adapter's ``head_dim`` lookup.

    ``initializer_range`` is 0.1 rather than HF's 0.02: with 0.02 a random model's greedy output
    collapses onto one token repeated forever, which would make token-equality tests vacuous.

    Why float64 by default: the framework's central invariant (greedy speculative decoding emits
    exactly the tokens of plain greedy decoding) holds in exact arithmetic. In float32 the verify
    pass computes a position inside a block of K+1 tokens whereas plain decoding computes it
    alone, and matmul rounding depends on the block size; on a near-tie between the two top logits
    that rounding can flip the argmax. float64 makes such flips vanishingly unlikely, so a failing
    equality test means a real bug.

    Args:
        arch: one of :data:`ARCHS`.
        num_layers: decoder blocks L.
        seed: torch seed for the random weights (the global RNG state is restored afterwards).
        dtype: parameter dtype.
        vocab_size: V.
        **config_overrides: extra config fields (e.g. ``max_position_embeddings=64``).
    """
    cfg_cls, model_cls = _arch_classes(arch)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = 32
    kwargs.update(config_overrides)
    config = cfg_cls(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.to(dtype).eval()


@functools.lru_cache(maxsize=16)
def cached_tiny_model(arch: str = "llama", num_layers: int = 4, seed: int = 0) -> torch.nn.Module:
    """`tiny_model` built once per argument set (shared by the contract mixins; do not mutate)."""
    return tiny_model(arch, num_layers=num_layers, seed=seed)


def tiny_tokenizer(vocab_size: int = 128) -> Any:
    """A word-level tokenizer (5 specials, then words ``w0``, ``w1``, ...) with a ChatML-like template.

    Pairs with `tiny_model` (same ``vocab_size``) for runner-level tests: prompts are words ``wN``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(vocab_size - len(specials))])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>")
    tok.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    return tok


#: Merges of `tiny_json_tokenizer`: multi-character tokens of JSON text (``'Ġ'`` is a space).
JSON_MERGES = (
    ("{", '"'),
    ('"', ":"),
    ("Ġ", '"'),
    ('"', ","),
    ('"', "}"),
    ("t", "r"),
    ("tr", "u"),
    ("tru", "e"),
)


def tiny_json_tokenizer() -> Any:
    """A byte-level BPE tokenizer that spells any printable ASCII text (3 specials, the 95
    printable characters, a few JSON merges: 106 tokens), with `tiny_tokenizer`'s chat template.

    Pairs with `tiny_model` (vocabulary 128; ids from 106 on are never spelled) for grammar tests:
    a word-level tokenizer cannot spell JSON.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = ["Ġ" if b == 32 else chr(b) for b in range(32, 127)]  # GPT-2's byte map on ASCII
    vocab = {t: i for i, t in enumerate(specials + chars)}
    for a, b in JSON_MERGES:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab, list(JSON_MERGES), unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>")
    tok.chat_template = tiny_tokenizer().chat_template
    return tok


def char_regex_grammar(regex: str, chars: str, vocab_size: int) -> Any:
    """``regex`` compiled (`framework.engine.grammar.CompiledGrammar`) for a tokenizer of one token
    per character of ``chars`` after three specials (``<unk>``, ``<|im_start|>``, ``<|im_end|>``,
    the end of sequence), over a model of ``vocab_size`` tokens (ids past the tokenizer's are never
    allowed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<|im_start|>", "<|im_end|>", *chars])}
    tk = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>")
    return CompiledGrammar(Grammar.regex(regex), tok, vocab_size)
