"""The comparison protocol, and its one driver (`compare_methods`), shared by the runner, the
benchmark, ``selfspec.Decoder.compare`` and the reproduction's claims: warm up every method, then
decode each prompt with every method in an order that rotates by one method per prompt (so slow
drift on a shared machine hits every method alike), check each method's tokens against the
baseline's (the first method), explain a mismatch by the target's logit margin there, and record
each prompt of each method in the one record format (`framework.results.records.prompt_record`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from framework.data.prompts import Prompt
from framework.engine.decoding import GenerationResult
from framework.results.records import prompt_record

T = TypeVar("T")
R = TypeVar("R")
P = TypeVar("P")

#: One prompt as one method decoded it: ``(result, text)`` per turn.
Turns = list[tuple[GenerationResult, str]]


@dataclass(frozen=True)
class Method:
    """One decoder under comparison.

    Attributes:
        label: its name in records and tables.
        decoder: anything with ``generate(prompt_ids, stop) -> GenerationResult``.
        kind: ``"baseline"``, ``"preset"``, ``"hf"``, ``"custom"`` or ``"method"`` (records
            carry it when the caller asks for it).
        greedy: its tokens must equal the baseline's (greedy decoding); ``False`` for a sampling
            method, whose check is statistical (no first mismatch is looked for).
    """

    label: str
    decoder: Any
    kind: str = "method"
    greedy: bool = True


@dataclass
class PromptComparison(Generic[P]):
    """One prompt decoded by every method (`compare_methods` yields one per prompt).

    Attributes:
        prompt: the prompt (a `Prompt`, or whatever the caller's ``decode`` takes).
        turn: its position in the rotation (the order's offset).
        order: the labels in the order they were decoded.
        results: per label, the turns (methods whose ``decode`` returned ``None`` are missing).
        mismatches: per label, where it first differs from the baseline (`first_mismatch`, with
            the target's margin there when the driver had an ``explain``), or ``None``: identical,
            or not checked (not greedy).
        methods: the methods by label.
    """

    prompt: P
    turn: int
    order: list[str]
    results: dict[str, Turns]
    mismatches: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    methods: dict[str, Method] = field(default_factory=dict)

    def lossless(self, label: str) -> bool | None:
        """Whether ``label``'s tokens equal the baseline's (``None``: not a greedy method)."""
        if not self.methods[label].greedy or _synthetic(self.results.get(label, [])):
            return None  # not a greedy method, or a synthetic acceptance: no equality to check
        return self.mismatches.get(label) is None

    def record(self, label: str, **extra: Any) -> dict[str, Any]:
        """The results record of ``label`` (`framework.results.records.prompt_record`) with its
        decoding position; ``extra`` are the caller's optional fields (``repeat``, ``kind``,
        ``strategies``, ``rank``)."""
        return prompt_record(
            self.prompt,
            label,
            self.results[label],
            self.lossless(label),
            self.mismatches.get(label),
            position=self.order.index(label),
            **extra,
        )

    def records(self, **extra: Any) -> list[dict[str, Any]]:
        """`record` of every method that produced a result, in the methods' order."""
        return [self.record(label, **extra) for label in self.methods if label in self.results]


def compare_methods(
    methods: Sequence[Method],
    prompts: Iterable[P],
    decode: Callable[[Method, P], Turns | None],
    *,
    explain: Callable[[P, Turns, list[list[int]], dict[str, int]], dict[str, Any]] | None = None,
    start_turn: int = 0,
    baseline: str | None = None,
) -> Iterator[PromptComparison[P]]:
    """Decode each prompt with every method, in `rotated` order, and check each against the
    baseline.

    Args:
        methods: the methods, in the order the rotation starts from.
        prompts: what ``decode`` takes.
        decode: ``(method, prompt) -> turns``; ``None`` leaves the method out of that prompt (a
            method that failed and is reported by the caller). The baseline must decode.
        explain: ``(prompt, baseline turns, the method's tokens per turn, first mismatch) ->
            details`` (`mismatch_details`): the target's view of a mismatch; ``None``: the
            mismatch position only.
        start_turn: the rotation offset of the first prompt (prompt i is decoded in the order
            ``rotated(methods, start_turn + i)``).
        baseline: the label of the method the others are checked against (default: the first).

    Yields:
        One `PromptComparison` per prompt, as soon as it is decoded.

    Raises:
        RuntimeError: the baseline produced no result.
    """
    by_label = {m.label: m for m in methods}
    base = methods[0].label if baseline is None else baseline
    if base not in by_label:
        raise ValueError(f"baseline {base!r} is not one of the methods {list(by_label)}")
    for i, prompt in enumerate(prompts):
        turn = start_turn + i
        order = rotated(list(methods), turn)
        results: dict[str, Turns] = {}
        for m in order:
            got = decode(m, prompt)
            if got is not None:
                results[m.label] = got
        if base not in results:
            raise RuntimeError(f"the baseline {base!r} produced no result")
        cmp = PromptComparison(prompt, turn, [m.label for m in order], results, methods=by_label)
        want = [r.tokens for r, _ in results[base]]
        for label, turns in results.items():
            if label == base or not by_label[label].greedy or _synthetic(turns):
                continue  # a synthetic acceptance's tokens are not the model's: never compared
            got_tokens = [r.tokens for r, _ in turns]
            where = first_mismatch(got_tokens, want)
            if where is not None and explain is not None:  # near-tie flip, or a bug?
                where = explain(prompt, results[base], got_tokens, where)
            cmp.mismatches[label] = where
        yield cmp


def _synthetic(turns: Turns) -> bool:
    """Whether a method's turns ran with a synthetic acceptance (`framework.engine.synthetic`)."""
    return any(getattr(r, "synthetic", None) is not None for r, _ in turns)


def explain_with(session: Any) -> Callable[[Prompt, Turns, list[list[int]], dict[str, int]], dict[str, Any]]:
    """The ``explain`` of `compare_methods` for chat prompts decoded by ``session`` (an
    `framework.session.session.Session`): `mismatch_details` through its adapter and chat
    template."""

    def explain(prompt: Prompt, base: Turns, got: list[list[int]], where: dict[str, int]) -> dict[str, Any]:
        return mismatch_details(
            session.adapter,
            session.encode_messages,
            prompt.turns,
            [(r.tokens, text) for r, text in base],
            got,
            where,
        )

    return explain


def rotated(items: Sequence[T], turn: int) -> list[T]:
    """``items`` rotated left by ``turn`` (mod its length): the order of the ``turn``-th prompt.
    With two methods this alternates which goes first."""
    if not items:
        return []
    k = turn % len(items)
    return list(items[k:]) + list(items[:k])


def warm_up(methods: Iterable[T], decode: Callable[[T], Any], repeats: int = 1) -> None:
    """Decode once per method, ``repeats`` times (kernels compiled, caches sized, allocator warm)
    before anything is timed."""
    methods = list(methods)
    for _ in range(repeats):
        for m in methods:
            decode(m)


def first_mismatch(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> dict[str, int] | None:
    """Where the turns ``got`` first differ from ``want`` (``{"turn", "position"}``), or ``None``
    when they are token-identical (the lossless check of greedy decoding)."""
    for turn, (g, w) in enumerate(zip(got, want, strict=False)):
        if list(g) != list(w):
            pos = next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w)))
            return {"turn": turn, "position": pos}
    if len(got) != len(want):
        return {"turn": min(len(got), len(want)), "position": 0}
    return None


#: A mismatch whose top-1/top-2 margin is at most this many units in the last place (ulp) of the
#: top-1 logit, in the model's dtype, is reported as a near-tie (see `near_tie`): two bfloat16
#: steps of the logit in a bfloat16 run.
NEAR_TIE_ULPS = 2


def ulp(value: float, dtype: Any) -> float:
    """One unit in the last place of ``value`` in the torch floating dtype ``dtype``."""
    import math

    import torch

    info = torch.finfo(dtype)
    mag = max(abs(float(value)), info.tiny)
    return info.eps * 2.0 ** math.floor(math.log2(mag))


def near_tie(margin: float, top1: float, dtype: Any) -> bool:
    """A top-1/top-2 logit margin within the rounding noise of ``dtype``: at most `NEAR_TIE_ULPS`
    ulps of the top-1 logit. Two decoders that compute the same logits in a different order (a
    verification over k + 1 tokens against one token at a time; another GPU kernel) can round a
    margin that small either way, so a greedy token flips without any bug. A margin far above it
    points at a bug (the decoders disagree on more than rounding)."""
    return margin <= NEAR_TIE_ULPS * ulp(top1, dtype)


def mismatch_details(
    adapter: Any,
    encode: Callable[[list[dict[str, str]]], list[int]],
    user_turns: Sequence[str],
    want: Sequence[tuple[Sequence[int], str]],
    got: Sequence[Sequence[int]],
    mismatch: dict[str, int],
) -> dict[str, Any]:
    """The `first_mismatch` of ``got`` against the baseline ``want`` with the target's view of
    that position: one forward of the full model (through ``adapter``) over the baseline's
    context up to the mismatch, after the fact (lossless runs never pay for it).

    Args:
        adapter: the target's `ModelAdapter`.
        encode: chat messages -> prompt token ids (the experiment's chat template).
        user_turns: the prompt's user turns.
        want: the baseline's turns as ``(tokens, text)``; a turn's context holds the earlier
            answers, which are the same for both decoders up to the mismatching turn.
        got: the method's tokens per turn.
        mismatch: `first_mismatch`'s ``{"turn", "position"}``.

    Returns:
        ``mismatch`` plus ``vanilla_token`` and ``method_token`` (``None`` past the end of that
        turn: one stopped earlier), ``margin`` (top-1 minus top-2 logit of the target there),
        ``top1`` (its top-1 logit), ``dtype`` and ``near_tie`` (`near_tie`); the margin fields
        are ``None`` when the position has no context (a missing turn).
    """
    import torch

    turn, pos = mismatch["turn"], mismatch["position"]
    out: dict[str, Any] = dict(mismatch)
    w = list(want[turn][0]) if turn < len(want) else []
    g = list(got[turn]) if turn < len(got) else []
    out["vanilla_token"] = w[pos] if pos < len(w) else None
    out["method_token"] = g[pos] if pos < len(g) else None
    out.update(margin=None, top1=None, dtype=str(adapter.arch.dtype).removeprefix("torch."), near_tie=None)
    if turn >= len(want) or turn >= len(user_turns):
        return out
    messages: list[dict[str, str]] = []
    for t in range(turn):
        messages += [{"role": "user", "content": user_turns[t]}, {"role": "assistant", "content": want[t][1]}]
    messages.append({"role": "user", "content": user_turns[turn]})
    ids = list(encode(messages)) + w[:pos]
    x = torch.tensor([ids], device=adapter.arch.device)
    with torch.inference_mode():
        cache = adapter.new_cache(len(ids))
        positions = torch.arange(len(ids), device=adapter.arch.device)[None]
        logits = adapter.forward(x, positions, cache, logits_at="last").logits[0, -1]
    top = torch.topk(logits, 2).values.tolist()  # in the model's dtype: the margin it rounds
    out["margin"] = top[0] - top[1]
    out["top1"] = top[0]
    out["near_tie"] = near_tie(out["margin"], top[0], adapter.arch.dtype)
    return out


def mismatch_note(qid: str, where: dict[str, Any] | None) -> str:
    """``q3 (turn 0, pos 17, top-1/top-2 margin 0.0012 in bfloat16: a near-tie)``: where a prompt
    first differs from vanilla and the target's logit margin there. A near-tie (the margin within
    `NEAR_TIE_ULPS` ulps of the top-1 logit in the run's dtype) is a
    rounding flip, expected in reduced precision or on a GPU; a wide margin points at a bug."""
    if not where:
        return f"q{qid}"
    text = f"q{qid} (turn {where.get('turn')}, pos {where.get('position')}"
    margin = where.get("margin")
    if margin is not None:
        verdict = "a near-tie" if where.get("near_tie") else "not a near-tie: a bug?"
        text += f", top-1/top-2 margin {margin:.3g} in {where.get('dtype')}: {verdict}"
    return text + ")"
