"""A strategy's own device work, keyed, randomised and run by the engine (issue 46, items 2-3).

A strategy hands the engine a function and its tensors; the engine calls it with a `DeviceOps`
first (what the function may ask of the model and of the generation's random stream):

    def round_sums(ops, hidden, rows, *, stride):
        tokens, probs = ops.top1(hidden.index_select(0, rows))
        ...
        return {"sums": sums}

    out = state.compute(round_sums, hidden, rows, stride=2)

How it runs is the engine's business. Where forwards run as one CUDA graph (the ``forward``
route), the function runs as one graph too. Its key is derived here, never written by the
strategy (`work_key`): the function's identity (module and qualified name, and its defaults),
every bound argument (``functools.partial``'s and the keywords given to ``compute``) by value,
each input's shape, dtype and device, and what the engine's ops depend on. A function whose
behaviour could change without its key changing is never replayed from a graph: a closure over
anything, a lambda, a bound method (its object may change), an argument that is not a plain
value (a tensor bound as an argument, a mutable object). It runs eagerly, with one warning naming
the strategy's file and line and why (`Unkeyable`).

Random numbers come from the engine: ``ops.uniform(shape)`` and ``ops.exponential(shape)`` draw
from the generation's stream (`RandomStream`). Eagerly they are drawn where the function asks;
on the graph route the first call of a key runs eagerly and notes the draws it made, and every
later call draws the same kinds and shapes from the stream, in the same order, before the graph
replays them: draw for draw what the eager function draws. A generation's reduced draft head
(``ops.top1(..., draft_head=True)``) is part of the key; a graph holds its fixed form
(`framework.engine.draft_head.DraftHead.fixed`: a head that grows with the context, with room for
the rows to come).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import inspect
import sys
import warnings
import weakref
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from framework.engine.execution.blocks import run_blocks
from framework.engine.execution.store import span
from framework.types import RandomStream

#: Bound values a key may hold: compared by value, never by identity.
_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)


# ---------------------------------------------------------------------------------------- keys
@dataclass(frozen=True)
class WorkKey:
    """What a strategy's device function computes, as the engine keys its graph.

    Attributes:
        function: ``module:qualname`` of the function.
        params: the bound arguments, by value: ``functools.partial``'s positional ones as
            ``("#0", v)``..., keywords as ``(name, v)`` sorted, and the function's defaults.
        inputs: each input's ``(shape, dtype, device)`` (``None`` for a ``None`` input).
        engine: what the engine's ops depend on (a reduced draft head's identity, a block
            position's attention span), set by the engine.
    """

    function: str
    params: tuple
    inputs: tuple
    engine: Hashable = None


@dataclass(frozen=True)
class Unkeyable:
    """Why a function cannot be keyed, and where it was defined (for the warning)."""

    reason: str
    where: str


class _NotValue(Exception):
    """A bound argument that is not a plain value (the message says what it is)."""


def canonical(x: Any) -> Hashable:
    """``x`` as a plain value the key can hold: equal values mean the same behaviour, never an
    object's identity or mutable state. Numbers, strings, dtypes, devices, enums; tuples and
    frozensets of values; frozen dataclasses of values; and functions the engine could key
    themselves (module-level, no closure), with the values a ``functools.partial`` binds.

    Raises:
        _NotValue: anything else (a tensor, a list, a mutable object, a lambda, a bound method).
    """
    if isinstance(x, _VALUE_TYPES):
        return x
    if isinstance(x, tuple):
        return tuple(canonical(v) for v in x)
    if isinstance(x, frozenset):
        return frozenset(canonical(v) for v in x)
    if isinstance(x, torch.Tensor):
        raise _NotValue("a tensor bound as a value (pass it as an input)")
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        params = getattr(type(x), "__dataclass_params__", None)
        if not (params and params.frozen):
            raise _NotValue(f"a {type(x).__name__}, a dataclass that is not frozen")
        fields = tuple((f.name, canonical(getattr(x, f.name))) for f in dataclasses.fields(x))
        return ("dataclass", f"{type(x).__module__}:{type(x).__qualname__}", fields)
    if callable(x):
        key = work_key(x, (), {})
        if isinstance(key, Unkeyable):
            raise _NotValue(f"a function that cannot be keyed ({key.reason})")
        return ("function", key.function, key.params)
    raise _NotValue(
        f"a {type(x).__name__}, not a plain value (a number, a string, a dtype, a tuple or frozen "
        "dataclass of them, a module-level function)"
    )


def _plain(v: Any) -> bool:
    try:
        canonical(v)
    except _NotValue:
        return False
    return True


def _where(fn: Any) -> str:
    code = getattr(fn, "__code__", None)
    if code is None:
        return getattr(fn, "__module__", "?") or "?"
    return f"{_short(code.co_filename)}:{code.co_firstlineno}"


@functools.lru_cache(maxsize=256)
def _short(path: str) -> str:
    """``path`` relative to the repository that holds it (made once per file: key derivation runs
    every round)."""
    p = Path(path)
    for parent in p.parents:
        if (parent / "framework").is_dir() and (parent / "strategies").is_dir():
            return str(p.relative_to(parent))
    return str(p)


def work_key(fn: Callable[..., Any], inputs: tuple, params: Mapping[str, Any]) -> WorkKey | Unkeyable:
    """The key of ``fn(ops, *inputs, **params)``, or why it has none (see the module docstring).

    ``fn`` may be a ``functools.partial`` (nested too): its bound arguments join ``params``.
    """
    bound: list[tuple[str, Any]] = [(k, v) for k, v in params.items()]
    positional: list[Any] = []
    base = fn
    while isinstance(base, functools.partial):
        positional = [*base.args, *positional]
        bound += [(k, v) for k, v in base.keywords.items() if k not in params]
        base = base.func
    where = _where(base)
    name = getattr(base, "__qualname__", None) or getattr(base, "__name__", None)
    if inspect.ismethod(base):
        owner = type(base.__self__).__name__
        return Unkeyable(f"it is a bound method of a {owner} object, whose state may change", where)
    if name is None or not callable(base):
        return Unkeyable(f"{base!r} is not a function", where)
    if name == "<lambda>" or name.endswith(".<lambda>"):
        return Unkeyable("it is a lambda (write a module-level function)", where)
    cells = getattr(base, "__closure__", None)
    if cells:
        free = ", ".join(base.__code__.co_freevars)
        return Unkeyable(f"it is a closure over {free} (pass them as inputs or keyword values)", where)
    defaults = (
        *(getattr(base, "__defaults__", None) or ()),
        *(getattr(base, "__kwdefaults__", None) or {}).items(),
    )
    values = [*(("#" + str(i), v) for i, v in enumerate(positional)), *sorted(bound, key=lambda kv: kv[0])]
    try:
        params_key = tuple((label, canonical(v)) for label, v in values)
        defaults_key = tuple(canonical(v) for v in defaults)
    except _NotValue as err:
        label = next((lab for lab, v in values if not _plain(v)), "a default")
        return Unkeyable(f"argument {label} is {err}", where)
    shapes = []
    for i, t in enumerate(inputs):
        if t is None:
            shapes.append(None)
        elif isinstance(t, torch.Tensor):
            shapes.append((tuple(t.shape), t.dtype, t.device))
        else:
            return Unkeyable(
                f"input {i} is a {type(t).__name__}, not a tensor (bind it as a keyword value)", where
            )
    module = getattr(base, "__module__", "") or ""
    return WorkKey(f"{module}:{name}", (*params_key, ("defaults", defaults_key)), tuple(shapes))


_warned: set[tuple[str, str]] = set()

#: Every eager run of device work that could not be keyed, by message (the warning is given once
#: per site and reason; `framework.testing.measure_host_work` counts them all).
EAGER_RUNS: collections.Counter[str] = collections.Counter()


def warn_eager(fn: Callable[..., Any], why: Unkeyable) -> None:
    """Warn once per function site and reason that its work runs eagerly (counted every time in
    `EAGER_RUNS`)."""
    base = fn
    while isinstance(base, functools.partial):
        base = base.func
    name = getattr(base, "__qualname__", repr(base))
    message = f"{why.where}: device work {name} runs eagerly, never from a graph: {why.reason}"
    EAGER_RUNS[message] += 1
    site = (why.where, why.reason)
    if site in _warned:
        return
    _warned.add(site)
    warnings.warn(message, EagerWorkWarning, stacklevel=_outside_framework())


class EagerWorkWarning(UserWarning):
    """A strategy's device function could not be keyed and runs eagerly (slow on a GPU)."""


def _outside_framework() -> int:
    """The stack level of the first caller outside the engine (the strategy's line)."""
    frame, level = sys._getframe(1), 1
    here = str(Path(__file__).parent)
    while frame is not None and (
        frame.f_code.co_filename.startswith(here) or "framework/view" in frame.f_code.co_filename
    ):
        frame, level = frame.f_back, level + 1
    return level


# ----------------------------------------------------------------------------------------- ops
class _Ops:
    """The engine's side of `framework.view.DeviceOps` (what a device function may ask of it).

    Eager ops (`EagerOps`) run the model's pieces and draw from the stream directly; the graph
    route's ops (`StaticOps`) read the draws made before the replay and run the static forms.
    """

    def __init__(
        self,
        top1: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        block: Callable[[int, torch.Tensor], torch.Tensor] | None,
    ) -> None:
        self._top1, self._block = top1, block

    def top1(self, hidden: torch.Tensor, *, draft_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy token and its top-1 probability (float32) of pre-norm residuals (..., d)
        through the final norm and the LM head, or with ``draft_head`` the generation's reduced
        draft head (the full head when there is none)."""
        return self._top1(hidden, draft_head=draft_head)

    def block(self, b: int, states: torch.Tensor) -> torch.Tensor:
        """Decoder block ``b`` on candidate states (n, d) of the committed position given to
        ``RoundView.compute_at`` (each attends to the context before it and to itself)."""
        if self._block is None:
            raise RuntimeError("ops.block runs inside RoundView.compute_at (a committed position)")
        return self._block(b, states)

    def uniform(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Uniform numbers in [0, 1) from the generation's stream."""
        return self._draw("uniform", shape, dtype)

    def exponential(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exp(1) numbers from the generation's stream."""
        return self._draw("exponential", shape, dtype)

    def _draw(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class Draw:
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class EagerOps(_Ops):
    """Ops of an eager run: the model's pieces as the round runs them, draws straight from the
    stream (noted in `draws`)."""

    def __init__(
        self,
        top1: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        block: Callable[[int, torch.Tensor], torch.Tensor] | None,
        random: RandomStream | None,
        device: torch.device,
    ) -> None:
        super().__init__(top1, block)
        self._random, self._device = random, device
        self.draws: list[Draw] = []

    def _draw(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self._random is None:
            raise RuntimeError(
                "this generation has no random stream (the verifier declares none: Verifier.random)"
            )
        self.draws.append(Draw(kind, tuple(int(s) for s in shape), dtype))
        return self._random.draw(kind, tuple(shape), dtype, self._device)


class StaticOps(_Ops):
    """Ops inside a graph: draws are read, in order, from buffers filled before each replay."""

    def __init__(
        self,
        top1: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        block: Callable[[int, torch.Tensor], torch.Tensor] | None,
        draws: tuple[torch.Tensor, ...],
    ) -> None:
        super().__init__(top1, block)
        self._draws, self._next = draws, 0

    def _draw(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = self._draws[self._next]
        self._next += 1
        return buf


#: What the first calls of each keyed function showed, per model adapter (`DeviceWork.run`).
_LEARNED: weakref.WeakKeyDictionary[Any, dict[WorkKey, Learned]] = weakref.WeakKeyDictionary()


def learned_of(adapter: Any) -> dict[WorkKey, Learned]:
    got = _LEARNED.get(adapter)
    if got is None:
        got = _LEARNED[adapter] = {}
    return got


@dataclass
class Learned:
    """What the first (eager) call of a key showed: its draws."""

    draws: tuple[Draw, ...]


def outputs_of(out: Any) -> Any:
    """Copies of a function's tensor outputs (a dict, tuple, list or tensor of them)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, Mapping):
        return {k: outputs_of(v) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(outputs_of(v) for v in out)
    return out


# --------------------------------------------------------------------------------------- runner
class WorkState(Protocol):
    """What `DeviceWork` uses of a generation (`framework.engine.state.DecodeState`)."""

    adapter: Any
    random: RandomStream | None
    draft_head: Any
    device: torch.device
    cache: Any

    def top1_from_hidden(
        self, hidden: torch.Tensor, *, draft_head: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward_block(self, block: int, states: torch.Tensor, *, position: int) -> torch.Tensor: ...


class DeviceWork:
    """Runs the device functions strategies hand one generation (`RoundView.compute`).

    Args:
        state: the generation's `framework.engine.state.DecodeState` (its adapter, random stream,
            draft head and blocks).
    """

    def __init__(self, state: WorkState) -> None:
        self.state = state

    def run(
        self, fn: Callable[..., Any], inputs: tuple, params: Mapping[str, Any], position: int | None = None
    ) -> Any:
        """``fn(ops, *inputs, **params)``: from a graph where forwards run as one and ``fn`` can be
        keyed (`execute`), else eagerly, with one warning when it cannot be keyed."""
        key = work_key(fn, inputs, params)
        if isinstance(key, Unkeyable):
            warn_eager(fn, key)
            return self.eager(fn, inputs, params, position).out
        head = self.state.draft_head
        if head is not None:  # its rows are the graph's too
            key = dataclasses.replace(key, engine=head.graph_key)
        learned = learned_of(self.state.adapter).get(key)
        return self.execute(key, learned, fn, inputs, params, position)

    def execute(
        self,
        key: WorkKey,
        learned: Learned | None,
        fn: Callable[..., Any],
        inputs: tuple,
        params: Mapping[str, Any],
        position: int | None,
    ) -> Any:
        """Run a keyed function: its first call eagerly, noting its draws (`Learned`), then one
        graph on the ``forward`` route (recorded on the second call), eagerly elsewhere."""
        state = self.state
        if learned is None:
            run = self.eager(fn, inputs, params, position)
            learned_of(state.adapter)[key] = Learned(tuple(run.ops.draws))
            return run.out
        graphs = state.adapter.executor.graphs
        if graphs is None or graphs.forwards is None:
            return self.eager(fn, inputs, params, position).out
        with torch.inference_mode(), state.adapter.backend():  # attention as the forwards' (exact mode)
            out = graphs.work.run(
                key,
                fn,
                inputs,
                params,
                draws=learned.draws,
                random=state.random,
                top1=self._fixed_top1,
                position=position,
                cache=state.cache,
            )
        return self.eager(fn, inputs, params, position).out if out is None else out

    def eager(
        self, fn: Callable[..., Any], inputs: tuple, params: Mapping[str, Any], position: int | None
    ) -> _Run:
        state = self.state
        block = None if position is None else functools.partial(state.forward_block, position=position)
        ops = EagerOps(state.top1_from_hidden, block, state.random, state.device)
        with torch.inference_mode():
            return _Run(ops, fn(ops, *inputs, **params))

    def _fixed_top1(
        self, hidden: torch.Tensor, *, draft_head: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``ops.top1`` inside a graph: the draft head in its fixed form (`DraftHead.fixed`)."""
        head = self.state.draft_head
        fixed = head.fixed() if draft_head and head is not None else None
        return self.state.adapter.top1_from_hidden(hidden, head=fixed)


@dataclass
class _Run:
    ops: EagerOps
    out: Any


# ---------------------------------------------------------------------------------- as a graph
class WorkGraphs:
    """Strategies' device functions as graphs on the branch graphs' store and pool (the
    ``forward`` route: where forwards run as one graph, so does a strategy's device work).

    Attributes:
        runs: functions run as graphs.
    """

    def __init__(self, branches: Any) -> None:
        self.arch, self.store, self.pool = branches.arch, branches.store, branches.pool
        self.max_tokens = branches.max_tokens
        with torch.inference_mode(False):
            self._at = torch.zeros(2, dtype=torch.long, device=self.pool.device)  # block position, slot
            self._offsets = torch.arange(self.max_tokens, device=self.pool.device)
        self.runs = 0

    def run(
        self,
        key: Hashable,
        fn: Callable[..., Any],
        inputs: tuple[torch.Tensor | None, ...],
        params: Mapping[str, Any],
        *,
        draws: tuple[Draw, ...],
        random: RandomStream | None,
        top1: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        position: int | None = None,
        cache: Any = None,
    ) -> Any:
        """``fn(ops, *inputs, **params)`` as one graph (`DeviceWork.execute`, which derived ``key``).

        The graph is keyed by ``key`` (which holds the inputs' shapes), recorded on first use and
        bounded with the forwards' (`framework.engine.execution.store`). Each call copies the
        inputs into the graph's static buffers, draws ``draws`` from ``random`` into its draw
        buffers (in order: what the eager function draws), and returns copies of its outputs.

        With a committed ``position``, ``ops.block(b, states)`` runs block b on n candidate states
        of that position against the pool: each attends to the slots before ``position`` and to
        its own key and value, written in scratch slots after every layer's end (left unclaimed:
        the cache's books do not change). The position and the scratch slot are device inputs;
        the attention span, which covers the most candidates a forward may have, is part of the key.

        Returns:
            the copies, or ``None`` when the pool cannot serve ``cache`` for ``position`` (run it
            eagerly then).
        """
        pool, block = self.pool, None
        gkey: tuple = ("work", key)
        if position is not None:
            base, rows = max(cache.lengths), self.max_tokens
            if not (pool.holds(cache) and 0 <= position < cache.committed) or base + rows > pool.capacity:
                return None
            s = span(base + rows, pool.capacity)
            gkey = ("work", ("blocks", key, s))
            self._at.copy_(torch.tensor([position, base], dtype=torch.long), non_blocking=True)
            block = functools.partial(self._block, s=s)

        def make() -> tuple[tuple, tuple[torch.Tensor, ...]]:
            ins = tuple(None if t is None else torch.zeros_like(t) for t in inputs)
            return ins, tuple(torch.zeros(d.shape, dtype=d.dtype, device=pool.device) for d in draws)

        ins, drawn = self.store.buffers(gkey, make)
        for buf, t in zip(ins, inputs, strict=True):
            if buf is not None:
                buf.copy_(t, non_blocking=True)
        if draws:
            if random is None:
                raise RuntimeError("this generation has no random stream (the verifier declares none)")
            for buf, d in zip(drawn, draws, strict=True):
                random.fill(d.kind, buf)
        out = self.store.run(gkey, lambda: fn(StaticOps(top1, block, drawn), *ins, **params))
        self.runs += 1
        return outputs_of(out)

    def _block(self, b: int, states: torch.Tensor, *, s: int) -> torch.Tensor:
        """Block ``b`` on candidate states (n, d) at the position in ``_at[0]``, their keys and
        values written from slot ``_at[1]`` on: the static form of `DecodeState.forward_block`."""
        a, pool = self.arch, self.pool
        assert pool.arange is not None
        n = states.shape[0]
        h = states[None]  # (1, n, d): one sequence of n candidates
        pos_emb = a.rotary(h, self._at[:1].expand(1, n))
        slots = self._at[1] + self._offsets[:n]  # (n,)
        ar = pool.arange[:s]
        hidden_slots = (ar[None, :] >= self._at[0]) & (ar[None, :] != slots[:, None])  # (n, span)
        mask = pool.mask(hidden_slots)[None, None]

        def attention(i: int, x: torch.Tensor) -> torch.Tensor:
            return x + a.attention_branch(i, x, pos_emb, mask, pool.slots(slots, s))

        return run_blocks(h, b, b + 1, None, attention, lambda i, x: x + a.mlp_branch(i, x))[0]
