"""Shared test infrastructure: the backend fixture, hypothesis profiles, input makers.

Every backend test runs on: numpy with the NumPy engine at every size, read-only numpy
with the engine split over two threads into one row (or chunk) per block (catches
mutation of inputs and block-boundary bugs), numpy with the reference forms,
array-api-strict on its default device and on ``Device("device1")`` (catches arrays
created without ``device=``), torch CPU, JAX CPU (catches in-place updates) and CuPy
when a GPU is present.  A backend that is not installed is skipped with the reason.
"""
from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from arrayattn.core.xp import to_numpy

# Hypothesis: a quick profile for CI (the default), a thorough one to run by hand:
#   HYPOTHESIS_PROFILE=thorough pytest
settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "thorough", max_examples=500, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@dataclass
class Backend:
    """One array library (and device) that tests run on."""

    name: str
    xp: Any          # the array-API (compat) namespace
    device: Any      # the device arrays are created on
    _make: Any

    def asarray(self, x, dtype: str | None = None):
        """A backend array from host data ``x`` (``dtype`` by name, e.g. "float32")."""
        x = np.asarray(x)
        if dtype is None:
            dtype = "bool" if x.dtype == np.bool_ else str(x.dtype)
        return self._make(x, dtype)

    def to_numpy(self, x) -> np.ndarray:
        return to_numpy(x)

    def dtype(self, name: str):
        return getattr(self.xp, name)

    def __repr__(self) -> str:
        return self.name


def _numpy(readonly: bool):
    import array_api_compat.numpy as xp

    def make(x, dtype):
        out = np.array(x, dtype=np.dtype(dtype))
        if readonly:
            out.setflags(write=False)
        return out
    return xp, "cpu", make


def _strict(device_name: str | None):
    import array_api_strict as xp
    device = xp.Device(device_name) if device_name else None

    def make(x, dtype):
        return xp.asarray(np.array(x, dtype=np.dtype(dtype)), device=device)
    return xp, device, make


def _torch():
    import array_api_compat.torch as xp
    import torch
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    def make(x, dtype):
        return torch.asarray(np.array(x, dtype=np.float32 if dtype == "bfloat16" else dtype)
                             ).to(getattr(torch, dtype))
    return xp, torch.device("cpu"), make


def _jax():
    import jax
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp

    def make(x, dtype):
        return jnp.asarray(np.array(x, dtype=np.float32 if dtype == "bfloat16" else dtype),
                           dtype=getattr(jnp, dtype))
    return jnp, jax.devices("cpu")[0], make


def _cupy():
    import array_api_compat.cupy as xp
    import cupy
    if cupy.cuda.runtime.getDeviceCount() < 1:  # pragma: no cover - needs a GPU
        raise ImportError("no GPU")

    def make(x, dtype):  # pragma: no cover - needs a GPU
        return cupy.asarray(np.array(x, dtype=dtype))
    return xp, cupy.cuda.Device(0), make


_BACKENDS = {
    "numpy": (lambda: _numpy(False), "numpy"),
    "numpy_readonly": (lambda: _numpy(True), "numpy"),
    "numpy_reference": (lambda: _numpy(False), "numpy"),
    "strict": (lambda: _strict(None), "array_api_strict"),
    "strict_device1": (lambda: _strict("device1"), "array_api_strict"),
    "torch": (_torch, "torch"),
    "jax": (_jax, "jax"),
    "cupy": (_cupy, "cupy"),
}

_cache: dict[str, Backend | str] = {}


def get_backend(name: str) -> Backend:
    """The backend called ``name``; ``pytest.skip`` with the reason when unavailable."""
    if name not in _cache:
        factory, module = _BACKENDS[name]
        try:
            importlib.import_module(module)
            xp, device, make = factory()
            _cache[name] = Backend(name, xp, device, make)
        except Exception as exc:  # ImportError, or no GPU for CuPy
            _cache[name] = f"{name} backend unavailable: {type(exc).__name__}: {exc}"
    b = _cache[name]
    if isinstance(b, str):
        pytest.skip(b)
    return b


def skip_jax_compile(backend, covered_by):
    """Skip on JAX the tests whose code path another JAX test already runs: eager JAX
    compiles every primitive for every new shape (seconds each, ~11 s for an SVD), which
    would make these files several minutes long on a loaded machine."""
    if backend.name == "jax":
        pytest.skip(f"jax: same code path as {covered_by} (compile time per shape)")


BACKEND_NAMES = list(_BACKENDS)


#: How each NumPy backend runs: the engine whole, the engine split, the reference forms.
IMPLEMENTATIONS = {"numpy": "engine", "numpy_readonly": "engine_split",
                   "numpy_reference": "reference"}


@contextlib.contextmanager
def implementation(name: str):
    """Run arrayattn's NumPy paths as ``name``: ``"engine"`` (the NumPy engine at any
    size, one block), ``"engine_split"`` (the engine split over 2 threads, one row or
    chunk per block) or ``"reference"`` (the reference forms)."""
    from arrayattn import use_engine
    from arrayattn._numpy.parallel import split_everything

    with contextlib.ExitStack() as stack:
        stack.enter_context(use_engine("reference" if name == "reference" else "numpy"))
        if name == "engine_split":
            stack.enter_context(split_everything(2))
        elif name == "engine":
            stack.enter_context(one_block())
        yield


@contextlib.contextmanager
def one_block():
    """The engine with one block per problem (no thread split) however large."""
    from arrayattn._numpy import parallel
    token = parallel._split.set((1, 1 << 62, 1 << 62, None))
    try:
        yield
    finally:
        parallel._split.reset(token)


@pytest.fixture(params=BACKEND_NAMES)
def backend(request) -> Backend:
    """Every backend in turn (skipped with the reason when not installed); the three
    NumPy entries run the three implementations (:data:`IMPLEMENTATIONS`)."""
    b = get_backend(request.param)
    if request.param in IMPLEMENTATIONS:
        with implementation(IMPLEMENTATIONS[request.param]):
            yield b
    else:
        yield b


@pytest.fixture
def np_backend() -> Backend:
    return get_backend("numpy")


# ---------------------------------------------------------------------------------
# Inputs.  Uniform [0, 1) inputs make every approximation look good, so the makers
# give unit Gaussians *and* "sharp" inputs with the norms of trained BERT heads.
# ---------------------------------------------------------------------------------

def make_qkv(rng, *, batch=(2,), n=16, s=None, d=8, dv=None, norm=None, sharp=False):
    """Gaussian ``q (*batch, n, d)``, ``k (*batch, s, d)``, ``v (*batch, s, dv)`` (float64).

    ``norm`` rescales every query and key row to that l2 norm (the norms of trained BERT
    heads are 6-10 at d = 32-64).  Norms alone do not make attention sharp: with random
    directions q.k/sqrt(d) ~ N(0, norm^4/d^2), i.e. N(0, 1) at norm 8, d = 64.  With
    ``sharp=True`` each query is also aimed at one random key (cosine ~0.9), so that
    key's logit is ~0.9 norm^2/sqrt(d) (7 at norm 8, d = 64) and a handful of keys carry
    each row -- the peaked attention of trained heads.
    """
    s = n if s is None else s
    dv = d if dv is None else dv
    q = rng.standard_normal((*batch, n, d))
    k = rng.standard_normal((*batch, s, d))
    v = rng.standard_normal((*batch, s, dv))
    if sharp:
        target = rng.integers(0, s, size=(*batch, n))
        aimed = np.take_along_axis(k, target[..., None], axis=-2)
        aimed = aimed / np.linalg.norm(aimed, axis=-1, keepdims=True)
        q = aimed + 0.5 * q / np.sqrt(d)
    if norm is not None:
        q = q / np.linalg.norm(q, axis=-1, keepdims=True) * norm
        k = k / np.linalg.norm(k, axis=-1, keepdims=True) * norm
    return q, k, v


@pytest.fixture
def rng():
    return np.random.default_rng(20261122)
