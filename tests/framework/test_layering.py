"""The import graph: the API and the engine never import tooling or strategies; no cycles.

Layers, bottom up (a module may import its own layer and the layers below it):

1. API: ``framework`` (the package), ``framework.types``, ``framework.registry``,
   ``framework.config_fields``, ``framework.interfaces``, ``framework.utils``;
2. kernels: ``framework.kernels`` (CPU kernels, CUDA graphs; what they need of the engine is
   declared in ``framework.kernels.protocols``, so they import nothing of it, not even for type
   checking);
3. engine: ``framework.engine``;
4. building blocks strategies compose: ``framework.drafting`` (draft builder, reduced head and
   compressed weights, draft gate) and ``framework.search`` (Bayesian optimisation, work budget);
5. tooling, itself ordered bottom up (`TOOLING`): ``framework.data``, ``framework.testing``,
   ``framework.models``, ``framework.session``, ``framework.results``, ``framework.benchmark``
   (the benchmark's baselines, load check and report), ``framework.runner`` (the one pipeline and
   both command lines), ``framework.sweep``, and the ``selfspec`` Python API.

``strategies`` sit beside the tooling: they import the API and the policies, never the engine,
the kernels or the tooling; the framework reaches them only through the registries (the composition root,
``framework.session.plugins``, imports the package by name).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("framework", "strategies", "selfspec")

API = {
    "framework",
    "framework.types",
    "framework.registry",
    "framework.config_fields",
    "framework.interfaces",
}
API.add("framework.utils")
API.add("framework.view")
#: The tooling's packages bottom up: each may import those before it, never one after it.
TOOLING = (
    "framework.data",
    "framework.testing",
    "framework.models",
    "framework.session",
    "framework.results",
    "framework.benchmark",
    "framework.runner",
    "framework.sweep",
    "selfspec",
)


def layer(module: str) -> int:
    """1 API, 2 kernels, 3 engine, 4 policies, 5 tooling, 6 strategies."""
    if module in API:
        return 1
    if module.startswith("framework.kernels"):
        return 2
    if module.startswith("framework.engine"):
        return 3
    if module.startswith(("framework.drafting", "framework.search")):
        return 4
    if module.startswith(TOOLING):
        return 5
    if module.startswith("strategies"):
        return 6
    raise AssertionError(f"{module} belongs to no layer: add it to test_layering")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = modules()


def _resolve(name: str) -> str | None:
    """The project module an import names (``a.b.c`` may be a module or a name in ``a.b``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _in_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return True
    return False


def imports(module: str, *, type_only: bool = False) -> Iterator[tuple[str, int, bool]]:
    """``(imported project module, line, at function level)`` of the runtime imports of ``module``
    (``if TYPE_CHECKING:`` blocks excluded unless ``type_only``)."""
    tree = ast.parse(MODULES[module].read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if not type_only and _in_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif node.level:
            continue  # the project uses absolute imports only (checked below)
        else:
            names = [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                yield target, node.lineno, _in_function(node, parents)


GRAPH = {m: sorted({t for t, _, _ in imports(m)}) for m in MODULES}


def test_every_module_has_a_layer():
    for m in MODULES:
        layer(m)


def test_no_relative_imports():
    bad = []
    for m, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                bad.append(f"{m}:{node.lineno}")
    assert not bad, f"relative imports: {bad}"


@pytest.mark.parametrize("module", [m for m in MODULES if layer(m) <= 4])
def test_api_kernels_engine_and_policies_import_only_lower_layers(module):
    """The API imports only the API, the kernels the API and themselves, the engine both, the
    policies all three. The package root ``framework``, the facade of the author API, is API: it
    re-exports the API's names only."""
    here = layer(module)
    bad = [t for t in GRAPH[module] if layer(t) > here]
    assert not bad, f"{module} (layer {here}) imports higher layers: {bad}"


@pytest.mark.parametrize("module", sorted(API))
def test_the_api_never_imports_from_above_it_not_even_for_type_checking(module):
    """Issue 39, item 1: what a strategy reads (`ForwardOutput`, the protocols of a reduced draft
    head, a draft's weights and the cost model's prices) is declared in the API, so no API module
    names the engine or the kernels, even in annotations."""
    bad = [f"{t} (line {line})" for t, line, _ in imports(module, type_only=True) if layer(t) > 1]
    assert not bad, f"{module} imports from above the API: {bad}"


@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith("framework.kernels")])
def test_kernels_never_import_the_engine_not_even_for_type_checking(module):
    bad = [f"{t} (line {line})" for t, line, _ in imports(module, type_only=True) if layer(t) > 2]
    assert not bad, f"{module} imports from above the kernels: {bad}"


def _tooling_rank(module: str) -> int:
    return next(i for i, pkg in enumerate(TOOLING) if module == pkg or module.startswith(pkg + "."))


@pytest.mark.parametrize("module", [m for m in MODULES if layer(m) == 5])
def test_tooling_imports_only_tooling_below_it(module):
    """Within the tooling, arrows point down `TOOLING` too: the runner never imported by the
    session, results never by data, and so on."""
    here = _tooling_rank(module)
    bad = [t for t in GRAPH[module] if layer(t) == 5 and _tooling_rank(t) > here]
    assert not bad, f"{module} ({TOOLING[here]}) imports tooling above it: {bad}"


@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith("strategies")])
def test_strategies_never_import_tooling(module):
    bad = [t for t in GRAPH[module] if layer(t) == 5]
    assert not bad, f"{module} imports tooling: {bad}"


@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith("strategies")])
def test_strategies_see_the_author_api_only_not_even_for_type_checking(module):
    """Issue 56: a strategy imports the author API and the building blocks, never the engine or
    the kernels, not even for its annotations (the cost model's prices are `CostPrices`, a draft's
    weights are named by `framework.types.weights_key`)."""
    bad = [f"{t} (line {line})" for t, line, _ in imports(module, type_only=True) if layer(t) in (2, 3)]
    bad += [f"{t} (line {line})" for t, line, _ in imports(module) if layer(t) in (2, 3)]
    assert not bad, f"{module} imports the engine or the kernels: {bad}"


def test_framework_never_imports_strategies_directly():
    bad = {m: [t for t in GRAPH[m] if layer(t) == 6] for m in MODULES if layer(m) < 6}
    assert not {m: t for m, t in bad.items() if t}


def test_no_function_level_imports_of_project_modules():
    """A function-level import of a project module hides a cycle or a layering break."""
    bad = [f"{m}:{line} imports {t}" for m in MODULES for t, line, fn in imports(m) if fn]
    assert not bad, "\n".join(bad)


def test_framework_modules_do_not_import_names_from_the_package_root():
    """Inside ``framework``, import from the defining module: ``from framework import X`` there
    would run the package's ``__init__`` half-way through its own import."""
    bad = []
    for m, path in MODULES.items():
        if not m.startswith("framework"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "framework" and node.level == 0:
                bad.append(f"{m}:{node.lineno}")
    assert not bad, bad


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (Tarjan's strongly connected components), a package's
    ``__init__`` re-exporting its own submodules not counted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            pkgs = {c for c in comp if any(o.startswith(c + ".") for o in comp)}
            if len(comp) > 1 and len(set(comp) - pkgs) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    assert not cycles, f"import cycles: {cycles}"


def test_no_import_cycles_even_for_type_checking():
    """Issue 39, item 1: no circle closed by an ``if TYPE_CHECKING:`` import either (the view
    protocols, the strategies' interfaces and the engine each import only downwards)."""
    typed = {m: sorted({t for t, _, _ in imports(m, type_only=True)}) for m in MODULES}
    cycles = _cycles(typed)
    assert not cycles, f"import cycles through type-checking imports: {cycles}"


FORBIDDEN_AFTER_ENGINE = (
    "framework.runner",
    "framework.benchmark",
    "framework.sweep",
    "framework.testing",
    "strategies",
    "selfspec",
    "pytorch_lightning",
    "lightning",
    "wandb",
)


@pytest.mark.parametrize(
    "module",
    ["framework", "framework.engine.decoding", "framework.engine.state", "framework.drafting.gate"],
)
def test_importing_the_api_or_the_engine_loads_no_tooling(module):
    """In a fresh interpreter: what importing ``module`` actually loads (the static check above
    cannot see imports made by third-party code or at run time)."""
    code = (
        f"import sys, {module}\n"
        f"bad = sorted(m for m in sys.modules if m.startswith({FORBIDDEN_AFTER_ENGINE!r}))\n"
        "print('\\n'.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [], f"importing {module} loads tooling: {out}"


def _state_params(path: Path) -> Iterator[tuple[int, str, str]]:
    """``(line, function, annotation)`` of every parameter named ``state`` in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                if arg.arg == "state":
                    ann = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                    yield node.lineno, node.name, ann


def test_every_state_parameter_is_typed():
    """Strategies (and what they compose) read a round through the typed `framework.view.RoundView`;
    the engine passes its `DecodeState`: no ``state`` parameter is untyped or ``Any``."""
    bad = [
        f"{m}:{line} {fn}(state: {ann or '<untyped>'})"
        for m, path in MODULES.items()
        if m.startswith(("framework", "strategies"))
        for line, fn, ann in _state_params(path)
        if ann in ("", "Any", "object")
    ]
    assert not bad, "\n".join(bad)


#: The views a strategy function's ``state`` may be annotated with (`framework.view`).
VIEWS = ("RoundView", "DraftView", "VerifyView")


@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith("strategies")])
def test_strategies_never_see_the_engine_state(module):
    """A strategy's ``state`` is one of the views, never the engine's `DecodeState`."""
    bad = [
        f"{line} {fn}(state: {ann})" for line, fn, ann in _state_params(MODULES[module]) if ann not in VIEWS
    ]
    assert not bad, f"{module}: {bad}"


#: The longest function or method ``framework/`` may hold (docstring included): a driver that
#: grows past it is split into named steps.
MAX_FUNCTION_LINES = 80


def test_no_function_in_the_framework_is_longer_than_the_limit():
    long = []
    for m, path in MODULES.items():
        if not m.startswith("framework"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{m}:{node.lineno} {node.name} ({n} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def _view_members(name: str) -> set[str]:
    import framework.view as views

    view = getattr(views, name)
    names = {*dir(view)}
    for cls in view.__mro__:
        names |= set(getattr(cls, "__annotations__", {}))
    return {n for n in names if not n.startswith("_")}


def _state_uses(fn: ast.AST) -> Iterator[ast.Attribute]:
    """``state.<attr>`` in ``fn``'s body, not in a nested function with a ``state`` of its own."""
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and any(
            a.arg == "state" for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        ):
            continue
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "state":
            yield node
        todo.extend(ast.iter_child_nodes(node))


@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith(("strategies", "framework.drafting"))])
def test_strategies_and_their_building_blocks_see_views_not_the_engines_objects(module):
    """Issue 39, item 1 (issue 56: per view): a strategy, and a building block strategies compose,
    prepares with a `framework.interfaces.PrepareView` and runs rounds with a view: none names the
    engine's `PrepareContext` or reaches for a model adapter (``.adapter``), and a function uses of
    its ``state`` only what the view it is annotated with declares (`RoundView` for a selector's
    and a length controller's hooks, `DraftView` for ``draft``, `VerifyView` for ``verify``). The
    engine hands its `DecodeState` out as it is, so this check, not a wrapper, keeps strategies to
    the views."""
    members = {v: _view_members(v) for v in VIEWS}
    tree = ast.parse(MODULES[module].read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "PrepareContext":
            bad.append(f"line {node.lineno}: PrepareContext")
        elif isinstance(node, ast.alias) and node.name.split(".")[-1] == "PrepareContext":
            bad.append("imports PrepareContext")
        elif isinstance(node, ast.Attribute) and node.attr == "adapter":
            bad.append(f"line {node.lineno}: .adapter")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            ann = [
                ast.unparse(x.annotation)
                for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]
                if x.arg == "state" and x.annotation
            ]
            if not ann:
                continue
            allowed = members.get(ann[0], members["RoundView"])
            bad += [
                f"line {use.lineno}: state.{use.attr} (not a {ann[0]} member)"
                for use in _state_uses(node)
                if use.attr not in allowed
            ]
    assert not bad, f"{module}: {bad}"


#: Names of the engine's execution that strategy code never needs (issue 46): it hands its device
#: work to `RoundView.compute` and reads by name; graphs, their keys, rides and draws are the
#: engine's.
ENGINE_WORDS = {"run_static", "run_with_blocks", "ride", "Ride", "DraftSampler", "forward_graphs", "run_work"}


def _strategy_code_files() -> list[Path]:
    return sorted((ROOT / "strategies").rglob("*.py")) + sorted(
        (ROOT / "framework" / "drafting").rglob("*.py")
    )


@pytest.mark.parametrize("path", _strategy_code_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_strategy_code_names_no_graph_key_ride_or_draw(path):
    """No strategy or drafting building block names the engine's graphs, keys, rides or draws:
    no engine words in its code (names, not comments), no ``key=`` handed to the engine, and no
    identifier about graphs."""
    import io
    import tokenize

    names = [
        t.string
        for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        if t.type == tokenize.NAME
    ]
    bad = sorted({n for n in names if n in ENGINE_WORDS or "graph" in n.lower()})
    assert not bad, f"{path.relative_to(ROOT)} names the engine's execution: {bad}"
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr.startswith("compute")
        ):
            assert not any(k.arg == "key" for k in node.keywords), (
                f"{path.relative_to(ROOT)}:{node.lineno} hands a key"
            )
