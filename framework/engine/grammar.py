"""Grammars under speculation: a JSON schema, a regex or a Lark (EBNF) grammar, through llguidance.

The grammar engine is `llguidance <https://github.com/guidance-ai/llguidance>`_ (a base
dependency), chosen because its matcher rolls back tokens it has
accepted, which is what speculation needs, and because it is a 3 MB wheel with no dependencies
(``xgrammar`` would serve too, but it pulls in ``triton``, which a CPU install should not pay for).

How a grammar is applied. A grammar is one more logits processor (`GrammarProcessor`) whose mask
is a function of the prefix it is handed, exactly as transformers' processors are: the scores of
the token after ``prompt + generated`` keep the tokens the grammar allows after ``generated`` and
are ``-inf`` elsewhere. Under speculation every row is processed with its own prefix
(`framework.engine.processing.LogitsProcessing.rows`): a verification row with the committed
tokens plus the draft tokens before it, a draft row with the tokens drafted before it. The
matcher follows those prefixes (`GrammarState.sync`): it rolls back to the longest prefix it
shares with the row's and consumes the rest, so after a round it holds the accepted prefix again.
Masks are cached per position of the prefix the matcher holds, so verification, which asks for
the prefixes the draft just asked for, computes no mask twice.

Why this is lossless: row ``j``'s processed scores are those plain decoding with the grammar
computes after ``committed + d_1..d_j``, and the greedy verifier accepts ``d_{j+1}`` only when it
is their argmax (so always a token the grammar allows). A row whose prefix holds a token the
grammar refuses (a copied draft can propose one) is never used: the row before it already refused
that token. It is left unmasked (a fully masked row would be NaN under sampling).

The same `GrammarProcessor` passed to ``transformers``' ``generate`` gives constrained plain
decoding with the same engine's masks: the equality tests compare against it.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

KINDS = ("json_schema", "regex", "lark")
#: The flag that gives each kind (named in error messages).
FLAGS = {"json_schema": "--json-schema", "regex": "--regex", "lark": "--grammar"}
#: llguidance's JSON options this framework compiles schemas with (a schema's own ``x-guidance``
#: key overrides them): one layout, ``{"key": value, "key": value}``, so that keys, separators and
#: brackets are forced tokens (`GrammarState.forced`); flexible whitespace would leave them open.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that does not compile, or that no token of the tokenizer can start."""


#: How to install the grammar engine when it is missing (a base dependency: an environment
#: installed before it was one lacks it).
INSTALL = "pip install llguidance (a base dependency since issue 55: pip install -e . installs it)"


def require_llguidance() -> Any:
    """The ``llguidance`` module, or one line saying how to install it."""
    try:
        import llguidance
    except ImportError:
        raise ImportError(f"grammars need the grammar engine llguidance: {INSTALL}") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a generation's output must match.

    Attributes:
        kind: ``"json_schema"`` (``source`` is the schema as JSON text), ``"regex"`` (the
            pattern, matched by the whole output) or ``"lark"`` (a grammar in llguidance's Lark
            syntax, an EBNF; a llama.cpp GBNF file is converted on reading).
        source: the text of the schema, pattern or grammar.
    """

    kind: Literal["json_schema", "regex", "lark"]
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str) or not self.source.strip():
            raise GrammarError(f"{FLAGS[self.kind]}: empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except json.JSONDecodeError as err:
                raise GrammarError(
                    f"--json-schema: not JSON ({err.msg} at line {err.lineno}, column {err.colno})"
                ) from None
            if not isinstance(schema, dict):
                raise GrammarError(f"--json-schema: a schema is a JSON object, got {type(schema).__name__}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Grammar:
        """A JSON schema (a dict, or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """A regular expression the whole output matches."""
        return cls("regex", pattern)

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """A grammar in llguidance's Lark syntax (start symbol ``start``)."""
        return cls("lark", text)

    @classmethod
    def from_file(cls, path: str | Path, kind: str) -> Grammar:
        """Read a schema (``kind="json_schema"``) or a grammar (``"lark"``; a ``.gbnf`` file is
        llama.cpp's GBNF, converted with llguidance's own converter)."""
        p = Path(path)
        flag = FLAGS.get(kind, kind)
        if not p.is_file():
            raise GrammarError(f"{flag} {str(p)!r}: no such file")
        text = p.read_text(encoding="utf-8")
        if kind == "lark" and p.suffix == ".gbnf":
            text = require_llguidance().gbnf_to_lark(text)
        return cls(kind, text)  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        """``kind:hash`` (what records and reports name)."""
        return f"{self.kind}:{hashlib.sha256(self.source.encode()).hexdigest()[:12]}"

    def engine_grammar(self) -> str:
        """The grammar in llguidance's own form."""
        m = require_llguidance().LLMatcher
        if self.kind == "json_schema":
            return m.grammar_from_json_schema(self.source, defaults=JSON_LAYOUT)
        if self.kind == "regex":
            return m.grammar_from_regex(self.source)
        return m.grammar_from_lark(self.source)


@functools.lru_cache(maxsize=8)
def _engine_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of a fast transformers tokenizer (about a second to build: cached)."""
    require_llguidance()
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    except ValueError as err:
        raise GrammarError(
            f"the grammar engine cannot read this model's tokenizer ({err}); grammars need a fast tokenizer whose tokens decode to bytes"
        ) from None


class CompiledGrammar:
    """A `Grammar` checked against a tokenizer: starts one `GrammarState` per generation.

    Args:
        grammar: the grammar.
        tokenizer: a fast transformers tokenizer (the model's).
        vocab_size: the model's vocabulary (the logits' width, which may exceed the tokenizer's).

    Raises:
        GrammarError: the grammar does not compile (the message names the flag and the engine's
            reason), or no token of the tokenizer can start it.
        ImportError: llguidance is not installed (one line saying how to install it).
    """

    def __init__(self, grammar: Grammar, tokenizer: Any, vocab_size: int) -> None:
        llg = require_llguidance()
        self.grammar = grammar
        self.vocab_size = int(vocab_size)
        self.engine_tokenizer = _engine_tokenizer(tokenizer, self.vocab_size)
        self.text = grammar.engine_grammar()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(self.text, self.engine_tokenizer)
        flag = FLAGS[grammar.kind]
        if is_error:
            raise GrammarError(f"{flag}: does not compile: {_one_line(messages[0])}")
        first = self.start(0)
        if first.matcher.is_error():
            raise GrammarError(f"{flag}: does not compile: {_one_line(first.matcher.get_error())}")
        allowed = first.allowed([]).nonzero().flatten()[:64].tolist()
        if not any(first.matcher.validate_tokens([t]) for t in allowed) and not first.matcher.is_accepting():
            raise GrammarError(f"{flag}: no token of this tokenizer can start the grammar")

    def start(self, prompt_len: int) -> GrammarState:
        """A fresh matcher for one generation whose prompt has ``prompt_len`` tokens."""
        llg = require_llguidance()
        return GrammarState(
            llg.LLMatcher(self.engine_tokenizer, self.text, log_level=0), prompt_len, self.vocab_size
        )


def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:300]


class GrammarState:
    """One generation's matcher, following whatever prefix it is asked about.

    Attributes:
        matcher: the ``llguidance.LLMatcher``.
        prompt_len: where the generated tokens start in the prefixes handed to `GrammarProcessor`.
        tokens: the generated tokens the matcher has consumed (its state).
        counts: ``masks`` computed, ``rollbacks`` made, ``rolled_back`` tokens, ``forced`` tokens
            handed out (`forced`).
    """

    def __init__(self, matcher: Any, prompt_len: int, vocab_size: int) -> None:
        self.matcher = matcher
        self.prompt_len = int(prompt_len)
        self.vocab_size = int(vocab_size)
        self.tokens: list[int] = []
        self._masks: dict[int, torch.Tensor] = {}  # position -> allowed after tokens[:position]
        self._bits = torch.arange(32, dtype=torch.int32)
        self.counts = {"masks": 0, "rollbacks": 0, "rolled_back": 0, "forced": 0}

    def _rollback_to(self, n: int) -> None:
        k = len(self.tokens) - n
        if k <= 0:
            return
        self.matcher.rollback(k)
        del self.tokens[n:]
        for pos in [p for p in self._masks if p > n]:
            del self._masks[pos]
        self.counts["rollbacks"] += 1
        self.counts["rolled_back"] += k

    def sync(self, generated: list[int], *, exact: bool = False) -> bool:
        """Bring the matcher to ``generated`` (rolling back what differs, consuming the rest).

        With ``exact`` the matcher ends in the state after ``generated`` itself; otherwise it may
        stay further along a path that extends ``generated`` (whose masks are cached).

        Returns:
            whether the grammar allows every token of ``generated`` (else the matcher holds the
            longest allowed prefix).
        """
        held = self.tokens
        c = 0
        n = min(len(held), len(generated))
        while c < n and held[c] == generated[c]:
            c += 1
        if c < len(held) and (exact or c < len(generated) or c not in self._masks):
            self._rollback_to(c)
        rest = generated[c:] if c >= len(self.tokens) else []
        if rest:
            took = int(self.matcher.try_consume_tokens(rest))
            self.tokens.extend(rest[:took])
            return took == len(rest)
        return True

    def allowed(self, generated: list[int]) -> torch.Tensor | None:
        """BoolTensor (vocab_size,): the tokens the grammar allows after ``generated``; ``None``
        when ``generated`` itself breaks the grammar (a row no verifier reaches)."""
        if not self.sync(generated):
            return None
        pos = len(generated)
        mask = self._masks.get(pos)
        if mask is None:
            words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
            bits = ((words[:, None] >> self._bits) & 1).bool().reshape(-1)
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            m = min(self.vocab_size, bits.numel())
            mask[:m] = bits[:m]
            self._masks[pos] = mask
            self.counts["masks"] += 1
        return mask

    def forced(self, generated: list[int], limit: int) -> list[int]:
        """The tokens the grammar forces after ``generated`` (the only continuation it admits, as
        llguidance's fast-forward tokens), at most ``limit``; none when ``generated`` breaks it."""
        if limit <= 0 or not self.sync(generated, exact=True):
            return []
        if self.matcher.is_stopped():
            return []
        out = [int(t) for t in self.matcher.compute_ff_tokens()][:limit]
        self.counts["forced"] += len(out)
        return out

    def summary(self) -> dict[str, int]:
        return dict(self.counts)


class GrammarProcessor:
    """A transformers logits processor applying a grammar's mask for whatever prefix it is handed.

    The same object works in ``transformers``' ``generate`` (its ``logits_processor``) and under
    speculation (`framework.engine.processing.LogitsProcessing`): the mask depends on the prefix
    only, the matcher follows it (`GrammarState`).

    Args:
        state: the generation's `GrammarState` (``CompiledGrammar.start(prompt_len)``).
    """

    def __init__(self, state: GrammarState) -> None:
        self.state = state

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        p = self.state.prompt_len
        for b in range(input_ids.shape[0]):
            allowed = self.state.allowed(input_ids[b, p:].tolist())
            if allowed is None:
                continue
            v = scores.shape[-1]
            scores[b, :v].masked_fill_(~allowed[:v].to(scores.device), float("-inf"))
        return scores
