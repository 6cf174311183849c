"""The house (issues #27 and #38), measured on the source: module and function sizes, the
import graph and its layers, one registry table and one call pipeline.

Each test reads ``arrayattn/`` as text or as Python's AST; none imports a backend.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

import arrayattn

PACKAGE = pathlib.Path(arrayattn.__file__).parent
SOURCES = sorted(PACKAGE.rglob("*.py"))

#: The bars of the issue: a module of ~450 lines, a function body of ~60, a reference
#: form's body of 45 (docstrings excluded).
MAX_MODULE_LINES = 450
MAX_BODY_LINES = 60
MAX_REFERENCE_BODY_LINES = 45


def _name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _functions(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                body = body[1:]
            length = body[-1].end_lineno - body[0].lineno + 1 if body else 0
            yield node.name, length


def _module_imports(path: pathlib.Path) -> set[str]:
    """The arrayattn modules ``path`` imports, at module level or inside a function (a lazy
    import that closes a loop is still a loop)."""
    me = _name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("arrayattn"):
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists()
                              or (PACKAGE.parent / sub.replace(".", "/")).is_dir()
                              else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("arrayattn"))
    found.discard(me)
    return found


def test_no_module_over_the_bar():
    big = {_name(p): len(p.read_text().splitlines()) for p in SOURCES}
    over = {name: n for name, n in big.items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_no_function_body_over_the_bar():
    over = []
    for path in SOURCES:
        limit = (MAX_REFERENCE_BODY_LINES if path.parent.name == "reference"
                 else MAX_BODY_LINES)
        over += [(_name(path), fn, n) for fn, n in _functions(path) if n > limit]
    assert not over, f"function bodies over the bar (reference forms: 45 lines): {over}"


def test_import_graph_has_no_cycle():
    graph = {_name(p): _module_imports(p) for p in SOURCES}
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


#: The root's entries and what each may import besides itself: the architecture, bottom up.
#: The reference forms import nothing else; the NumPy engine only them; the core (pipeline,
#: engine choice, array-API plumbing, shared checks) those two; each family the core;
#: random features build on kernel attention (and RFA's gate on the gated family); the
#: registry reads every family; the tools sit on top.
FAMILIES = ("arrayattn.exact", "arrayattn.kernel", "arrayattn.gated", "arrayattn.lowrank",
            "arrayattn.sparse")
BELOW_FAMILIES = ("arrayattn.reference", "arrayattn._numpy", "arrayattn.core")
LAYERS = {
    "arrayattn.reference": (),
    "arrayattn._numpy": ("arrayattn.reference",),
    "arrayattn.core": ("arrayattn.reference", "arrayattn._numpy"),
    **{family: BELOW_FAMILIES for family in FAMILIES},
    "arrayattn.random_features": BELOW_FAMILIES + ("arrayattn.kernel", "arrayattn.gated"),
    "arrayattn.registry": BELOW_FAMILIES + FAMILIES + ("arrayattn.random_features",),
    "arrayattn.backward": BELOW_FAMILIES + FAMILIES + ("arrayattn.random_features",
                                                       "arrayattn.registry"),
    "arrayattn.distributed": BELOW_FAMILIES + FAMILIES + ("arrayattn.registry",),
    "arrayattn.testing": BELOW_FAMILIES + FAMILIES + ("arrayattn.registry",
                                                      "arrayattn.backward"),
    "arrayattn.report": BELOW_FAMILIES + ("arrayattn.registry", "arrayattn.data"),
    "arrayattn.cli": ("arrayattn.core", "arrayattn.registry", "arrayattn.report",
                      "arrayattn.testing"),
    "arrayattn.__main__": ("arrayattn.cli",),
    "arrayattn.data": (),
}


def _entry(module: str) -> str:
    """The root entry (package or module) that ``module`` belongs to."""
    return ".".join(module.split(".")[:2])


def test_root_reads_as_the_architecture():
    """The root holds about fifteen entries, each one named in :data:`LAYERS`."""
    entries = {_entry(_name(p)) for p in SOURCES if p.parent != PACKAGE or p.name != "__init__.py"}
    assert entries == set(LAYERS), ("root entries not in the layer table",
                                    entries ^ set(LAYERS))
    assert len(entries) <= 18


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_no_import_runs_back_up(layer):
    """Each root entry imports only itself and the entries below it (:data:`LAYERS`),
    lazy imports included: the reference forms none of the rest, the NumPy engine only the
    reference forms, no family another family's internals but as the table says."""
    up = []
    for path in SOURCES:
        name = _name(path)
        if _entry(name) == layer and name != "arrayattn":
            up += [(name, t) for t in _module_imports(path)
                   if _entry(t) != layer and _entry(t) not in LAYERS[layer]]
    assert not up, f"imports running back up: {up}"


def test_the_layer_table_has_no_circle():
    """The layers themselves form no circle (so no module-level circle can hide in them)."""
    done: set[str] = set()

    def visit(node, path):
        assert node not in path, "circle in LAYERS: " + " -> ".join(path + (node,))
        for below in LAYERS[node]:
            if below not in done:
                visit(below, path + (node,))
        done.add(node)

    for node in LAYERS:
        visit(node, ())


def test_registry_is_the_catalogue_table():
    """The registry holds exactly the catalogue's rows, in their order; no module
    registers a variant at import."""
    from arrayattn.registry.catalogue import VARIANTS
    assert [rec.name for rec in arrayattn.variants()][:len(VARIANTS)] == [
        rec.name for rec in VARIANTS]
    callers = [_name(p) for p in SOURCES
               if "register(Variant(" in p.read_text() and p.name != "registry.py"]
    assert not callers, f"modules registering at import: {callers}"


def test_every_catalogue_function_runs_one_pipeline():
    """Each catalogue row's public function is its signature, numpydoc and one
    ``run(SPEC, ...)`` call: its body is a single ``return run(...)``."""
    from arrayattn.registry.catalogue import VARIANTS
    import inspect
    import textwrap
    for fn in {rec.fn for rec in VARIANTS}:
        fn = inspect.unwrap(fn)
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        body = tree.body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        assert len(body) == 1 and isinstance(body[0], ast.Return), fn.__name__
        call = body[0].value
        assert isinstance(call, ast.Call) and getattr(call.func, "id", None) == "run", (
            f"{fn.__name__} does not return run(SPEC, ...)")


def _spec_of(fn):
    """The :class:`~arrayattn.core.pipeline.Spec` a public function runs (``return run(S, ...)``)."""
    import inspect
    import textwrap
    fn = inspect.unwrap(fn)
    ret = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body[-1]
    return eval(compile(ast.Expression(ret.value.args[0]), "<spec>", "eval"), fn.__globals__)


def test_every_spec_says_what_none_means():
    """Options declared as data: for every catalogue function, its Spec names exactly the
    options whose default is ``None`` and says what ``None`` means for each."""
    import inspect
    from arrayattn.registry.catalogue import VARIANTS
    from arrayattn.core.pipeline import Spec
    for fn in {rec.fn for rec in VARIANTS}:
        spec = _spec_of(fn)
        assert isinstance(spec, Spec), fn.__name__
        nones = {name for name, par in inspect.signature(fn).parameters.items()
                 if par.default is None}
        assert set(spec.none_means) == nones, (fn.__name__, set(spec.none_means) ^ nones)
        assert all(isinstance(m, str) and m for m in spec.none_means.values())
