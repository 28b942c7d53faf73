"""Named registries of strategies: one generic `Registry` and four instances.

Every pluggable part of the decoding loop (drafter, verifier, layer selector, length controller)
is a class registered under a snake_case name together with its frozen config dataclass. The
name doubles as the CLI value (``--selector clasp_dp``).

Example:
    >>> from framework import register_selector, get_selector
    >>> @register_selector("my_selector", config=MyConfig)      # doctest: +SKIP
    ... class MySelector(LayerSelector):
    ...     '''Skip the layers whose residual update is smallest.'''
    >>> get_selector("my_selector")                              # doctest: +SKIP
    <class 'MySelector'>
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


class RegistryError(ValueError):
    """A strategy was registered incorrectly (duplicate name, wrong base class, bad config)."""


class UnknownNameError(KeyError):
    """An unregistered name was looked up. The message lists the registered names."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it readable.
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered strategy.

    Attributes:
        name: the snake_case name it is registered (and selected on the CLI) under.
        cls: the implementing class.
        config: its frozen config dataclass.
        description: the first line of the class docstring.
    """

    name: str
    cls: type[T]
    config: type
    description: str


class BuiltinPackage:
    """A package whose import registers built-in strategies, imported once, on the first lookup in
    any registry that names it (the registries' one composition root: nobody calls a loader).

    Args:
        name: the package's import name (``"strategies"``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.loaded = False

    def load(self) -> None:
        """Import the package (idempotent; re-entrant: lookups made while it imports see what is
        registered so far)."""
        if not self.loaded:
            self.loaded = True
            try:
                importlib.import_module(self.name)
            except BaseException:
                self.loaded = False
                raise


class Registry(Generic[T]):
    """A name -> class mapping for one interface.

    Args:
        kind: human-readable kind, used in messages and CLI flags (``"selector"``).
        base_cls: every registered class must subclass it.
        builtins: the package that registers the built-in strategies, imported on the first
            lookup (`get`, `entry`, `names`, ``in``, ``len``); ``None``: nothing is imported.
    """

    def __init__(
        self, kind: str, base_cls: type[T] | None = None, *, builtins: BuiltinPackage | None = None
    ) -> None:
        self.kind = kind
        self.base_cls = base_cls
        self.builtins = builtins
        self._entries: dict[str, Entry[T]] = {}

    def _table(self) -> dict[str, Entry[T]]:
        """The entries, the built-ins registered first."""
        if self.builtins is not None and not self.builtins.loaded:
            self.builtins.load()
        return self._entries

    def register(self, name: str, *, config: type | None = None) -> Callable[[type[T]], type[T]]:
        """Class decorator registering ``cls`` under ``name`` with its config dataclass.

        Args:
            name: snake_case name, unique within this registry. Registering a new definition of
                the same class (same module and qualified name: a notebook cell run again) replaces
                the entry.
            config: a frozen dataclass whose fields are the strategy's hyper-parameters. Defaults
                to the class attribute ``Config`` if it has one (its own or a base class's),
                else an empty config (a strategy without hyper-parameters).

        Raises:
            RegistryError: bad name, duplicate name, class not a subclass of the base, or a config
                that is not a frozen dataclass.
        """
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise RegistryError(f"{self.kind} name must be snake_case ([a-z][a-z0-9_]*), got {name!r}")

        def decorator(cls: type[T]) -> type[T]:
            held = self._table().get(name)  # a built-in of that name is registered first
            if held is not None and not _same_definition(held.cls, cls):
                raise RegistryError(
                    f"{self.kind} {name!r} is already registered "
                    f"(by {held.cls.__module__}.{held.cls.__qualname__})"
                )
            if self.base_cls is not None and not (isinstance(cls, type) and issubclass(cls, self.base_cls)):
                raise RegistryError(
                    f"cannot register {cls!r} as {self.kind} {name!r}: it must subclass {self.base_cls.__name__}"
                )
            cfg = config if config is not None else getattr(cls, "Config", None)
            if cfg is None:  # no hyper-parameters: an empty config of its own
                cfg = dataclasses.make_dataclass(f"{cls.__name__}Config", [], frozen=True)
                cfg.__module__ = cls.__module__
            if not dataclasses.is_dataclass(cfg) or not cfg.__dataclass_params__.frozen:
                raise RegistryError(
                    f"{self.kind} {name!r} needs a frozen config dataclass (pass config=... to the decorator)"
                )
            cls.Config = cfg  # type: ignore[attr-defined]
            cls.name = name  # type: ignore[attr-defined]
            doc = (cls.__doc__ or "").strip().splitlines()
            self._entries[name] = Entry(name, cls, cfg, doc[0].strip() if doc else "")
            return cls

        return decorator

    def get(self, name_or_obj: str | type[T] | T) -> type[T] | T:
        """Look up a class by name; a class or an instance is passed through unchanged.

        Raises:
            UnknownNameError: the name is not registered; the message lists the registered names
                and suggests the closest.
        """
        if not isinstance(name_or_obj, str):
            return name_or_obj
        try:
            return self._table()[name_or_obj].cls
        except KeyError:
            raise UnknownNameError(self.unknown_message(name_or_obj)) from None

    def entry(self, name: str) -> Entry[T]:
        """The full `Entry` for ``name`` (raises `UnknownNameError`)."""
        if name not in self._table():
            raise UnknownNameError(self.unknown_message(name))
        return self._entries[name]

    def unknown_message(self, name: str) -> str:
        names = sorted(self._table())
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return (
            f"unknown {self.kind} {name!r}.{hint} Registered {self.kind}s: {', '.join(names) or '(none)'} "
            f"(a {self.kind} of your own registers when its module is imported: --import MODULE)"
        )

    def names(self, pattern: str = "*") -> list[str]:
        """Registered names matching a glob ``pattern``, sorted."""
        return sorted(n for n in self._table() if fnmatch.fnmatch(n, pattern))

    def entries(self) -> list[Entry[T]]:
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._table()

    def __len__(self) -> int:
        return len(self._table())

    def unregister(self, name: str) -> None:
        """Remove ``name`` (for tests and notebooks that re-register a class)."""
        self._entries.pop(name, None)


def _same_definition(held: type, new: type) -> bool:
    """Whether ``new`` is ``held`` or a re-definition of it (same module and qualified name)."""
    return held is new or (held.__module__, held.__qualname__) == (new.__module__, new.__qualname__)
