"""The reference layer and the one dispatch: every variant's public path (NumPy engine,
whole and split, and every other backend) equals its reference form, the reference
forms use nothing but the array API, every variant traces under ``jax.jit`` (no host
reads), and every module exports what its ``__all__`` says."""
from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import pkgutil

import numpy as np
import pytest

import arrayattn
from arrayattn.testing import xp_assert_close

from conftest import get_backend, implementation, make_qkv

PACKAGE = pathlib.Path(arrayattn.__file__).parent
RECORDS = arrayattn.variants()
IDS = [r.name for r in RECORDS]
F64 = float(np.finfo(np.float64).eps)


def _inputs(rec, rng):
    n, s = (80, 96) if rec.cross else (96, 96)
    return make_qkv(rng, batch=(2,), n=n, s=s, d=16, dv=5, norm=6.0)


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_reference_imports_no_engine():
    """Array API only: no NumPy, no engine, no thread map in the reference forms."""
    for path in (PACKAGE / "reference").glob("*.py"):
        for name in _imports(path):
            assert name.split(".")[0] != "numpy", f"{path.name} imports {name}"
            bare = name.lstrip(".")
            assert not bare.startswith(("_numpy", "_parallel")), f"{path.name} imports {name}"
            # the reference forms import nothing of the rest of the package (#38)
            assert not name.startswith(".."), f"{path.name} imports {name}"


def _modules():
    yield arrayattn
    for info in pkgutil.walk_packages(arrayattn.__path__, "arrayattn."):
        if info.name.endswith(("__main__", "make_real_heads")):
            continue
        yield importlib.import_module(info.name)


@pytest.mark.parametrize("module", list(_modules()), ids=lambda m: m.__name__)
def test_all_is_what_the_module_exports(module):
    """``__all__`` names exist, and every public function or class defined in the
    module is in it."""
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{module.__name__} has no __all__"
    assert len(set(exported)) == len(exported), "duplicates in __all__"
    for name in exported:
        assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name}"
    for name, obj in vars(module).items():
        if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        if getattr(obj, "__module__", None) == module.__name__:
            assert name in exported, f"{module.__name__}.{name} is public but not in __all__"


def test_no_private_cross_module_imports():
    """Shared helpers have package-level names: no ``from .x import _private``."""
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                for alias in node.names:
                    assert not (alias.name.startswith("_") and not alias.name.startswith("__")), (
                        f"{path.relative_to(PACKAGE)} imports the private {alias.name} "
                        f"from {node.module}")


@pytest.fixture(params=RECORDS, ids=IDS)
def record(request):
    return request.param


@pytest.mark.parametrize("impl", ["engine", "engine_split"])
def test_numpy_engine_equals_reference(record, impl, rng):
    """The NumPy engine (whole, and split one row per block over 2 threads) equals the
    reference form to rounding, in float32 and float64.

    A row's output is ``sum_j A_ij v_j`` with ``A``'s rows summing to 1; the rounding of
    its terms is amplified by the row's ``sum_j |A_ij|``: 1 where the weights are
    non-negative, more where a signed estimator cancels (performer_trig's ``sin``
    features), so the bound carries that condition number, measured on ``A``."""
    q, k, v = _inputs(record, rng)
    with implementation("reference"):
        a = arrayattn.attention_matrix(record, q, k)
    cond = max(1.0, float(np.abs(a).sum(axis=-1).max()))
    for dtype in (np.float64, np.float32):
        args = [x.astype(dtype) for x in (q, k, v)]
        ref = record.reference(*args)
        with implementation(impl):
            out = record(*args)
        eps = float(np.finfo(dtype).eps)
        xp_assert_close(out, ref, rtol=0,
                        atol=256 * eps * cond * float(np.abs(ref).max() + 1))


@pytest.mark.parametrize("name", ["strict", "torch", "jax"])
def test_every_backend_runs_the_reference(record, name, rng):
    """Other libraries run the reference form: the uniform call equals ``reference``."""
    backend = get_backend(name)
    q, k, v = (backend.asarray(x, "float64") for x in _inputs(record, rng))
    xp_assert_close(record(q, k, v), record.reference(q, k, v), rtol=0,
                    atol=16 * F64 * 100)


def test_every_variant_traces_under_jit(record, rng):
    """Every public function (and so its reference form) traces under ``jax.jit``: no
    host read of an array value anywhere on the path, and the traced result equals the
    eager one."""
    jax = pytest.importorskip("jax")
    backend = get_backend("jax")
    q, k, v = (backend.asarray(x, "float64") for x in _inputs(record, rng))
    eager = record(q, k, v)
    traced = jax.jit(lambda a, b, c: record(a, b, c))(q, k, v)
    # XLA fuses and reorders under jit: rounding of sums of s = 96 terms (~s eps of the
    # output's scale), amplified up to ~1e2 times by performer_trig's cancellation (its
    # denominator is a difference of cosine features).
    top = float(np.abs(np.asarray(eager)).max())
    xp_assert_close(traced, eager, rtol=0, atol=96 * 100 * F64 * max(1.0, top))


class TestEngineChoice:
    def test_env_and_context(self, monkeypatch):
        from arrayattn.core.engine import engine_choice, numpy_engine
        import array_api_compat.numpy as xp
        assert engine_choice() == "auto"
        assert not numpy_engine(xp, 10) and numpy_engine(xp, 1 << 30)
        with arrayattn.use_engine("reference"):
            assert not numpy_engine(xp, 1 << 30)
            with arrayattn.use_engine("numpy"):
                assert numpy_engine(xp, 1)
        monkeypatch.setenv("ARRAYATTN_ENGINE", "reference")
        assert not numpy_engine(xp, 1 << 30)
        monkeypatch.setenv("ARRAYATTN_ENGINE", "fast")
        with pytest.raises(ValueError, match="ARRAYATTN_ENGINE"):
            engine_choice()
        with pytest.raises(ValueError, match="engine must be one of"):
            with arrayattn.use_engine("gpu"):
                pass

    def test_other_libraries_never_take_the_numpy_engine(self):
        from arrayattn.core.engine import numpy_engine
        strict = pytest.importorskip("array_api_strict")
        with arrayattn.use_engine("numpy"):
            assert not numpy_engine(strict, 1 << 40)
