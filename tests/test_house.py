"""The house (issue #27, point 5), measured on the source: module and function sizes, the
import graph, one registry table and one call pipeline.

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
    """The arrayattn modules ``path`` imports at module level (not inside functions)."""
    me = _name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
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


@pytest.mark.parametrize("layer, allowed", [
    ("arrayattn.reference", ("arrayattn.reference", "arrayattn._xp")),
    ("arrayattn._numpy", ("arrayattn._numpy", "arrayattn.reference", "arrayattn._xp")),
])
def test_no_import_runs_back_up(layer, allowed):
    """The reference forms import only each other (and the array-API helpers); the NumPy
    engine imports only itself and the reference forms: neither reaches back up into
    the public modules, the pipeline or the validation."""
    up = []
    for path in SOURCES:
        name = _name(path)
        if name == layer or name.startswith(layer + "."):
            up += [(name, t) for t in _module_imports(path)
                   if not any(t == a or t.startswith(a + ".") for a in allowed)]
    assert not up, f"imports running back up: {up}"


def test_registry_is_the_catalogue_table():
    """The registry holds exactly the catalogue's rows, in their order; no module
    registers a variant at import."""
    from arrayattn.catalogue import VARIANTS
    assert [rec.name for rec in arrayattn.variants()][:len(VARIANTS)] == [
        rec.name for rec in VARIANTS]
    callers = [_name(p) for p in SOURCES
               if "register(Variant(" in p.read_text() and p.name != "registry.py"]
    assert not callers, f"modules registering at import: {callers}"


def test_every_catalogue_function_runs_one_pipeline():
    """Each catalogue row's public function is its signature, numpydoc and one
    ``run(SPEC, ...)`` call: its body is a single ``return run(...)``."""
    from arrayattn.catalogue import VARIANTS
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
    """The :class:`~arrayattn.pipeline.Spec` a public function runs (``return run(S, ...)``)."""
    import inspect
    import textwrap
    fn = inspect.unwrap(fn)
    ret = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body[-1]
    return eval(compile(ast.Expression(ret.value.args[0]), "<spec>", "eval"), fn.__globals__)


def test_every_spec_says_what_none_means():
    """Options declared as data: for every catalogue function, its Spec names exactly the
    options whose default is ``None`` and says what ``None`` means for each."""
    import inspect
    from arrayattn.catalogue import VARIANTS
    from arrayattn.pipeline import Spec
    for fn in {rec.fn for rec in VARIANTS}:
        spec = _spec_of(fn)
        assert isinstance(spec, Spec), fn.__name__
        nones = {name for name, par in inspect.signature(fn).parameters.items()
                 if par.default is None}
        assert set(spec.none_means) == nones, (fn.__name__, set(spec.none_means) ^ nones)
        assert all(isinstance(m, str) and m for m in spec.none_means.values())
