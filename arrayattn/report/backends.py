"""Array libraries for the report and the benchmarks: host NumPy data in, timing-safe.

Each backend turns host float64 data into arrays of its library (on its GPU when it has
one), waits for queued work before a clock is read (``sync``), and says how peak memory
can be measured: ``"tracemalloc"`` (NumPy-backed arrays: NumPy reports its buffers to
:mod:`tracemalloc`), ``"cuda"`` (torch's CUDA allocator) or ``None`` (not measurable
from Python without a separate process; reported as missing, never guessed).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

BACKENDS = ("numpy", "torch", "jax", "cupy", "array_api_strict")
DTYPES = ("float16", "bfloat16", "float32", "float64")


__all__ = ["BackendUnavailable", "ArrayBackend", "get_array_backend"]


class BackendUnavailable(RuntimeError):
    """The requested array library is not installed or cannot run here."""


@dataclass
class ArrayBackend:
    name: str
    device: str
    asarray: Callable[[np.ndarray, str], Any]
    sync: Callable[[Any], None]
    memory: str | None
    module: Any = None
    #: How a timed function is prepared: ``jax.jit`` on JAX (compiled by the warm-up
    #: call, then timed), the function itself elsewhere.
    compile: Callable[[Callable], Callable] = staticmethod(lambda fn: fn)

    def reset_peak(self):
        if self.memory == "cuda":
            self.module.cuda.reset_peak_memory_stats()

    def peak_bytes(self):
        if self.memory == "cuda":
            return self.module.cuda.max_memory_allocated()
        return None


def _import(module: str, backend: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise BackendUnavailable(
            f"backend {backend!r} needs the {module!r} package, which is not installed "
            f"({exc}); install it with the project's extra "
            f"(pip install \"arrayattn[{_EXTRAS.get(backend, backend)}]\"{_HINTS.get(backend, '')}) "
            f"or choose another --backend") from None


#: The pyproject extra that installs each backend, and what it means.
_EXTRAS = {"torch": "torch", "jax": "jax", "cupy": "cupy", "array_api_strict": "test"}
_HINTS = {"cupy": ", a cupy-cuda12x wheel: needs an NVIDIA GPU and CUDA 12"}


def get_array_backend(name: str, dtype: str = "float32") -> ArrayBackend:
    """The backend ``name`` for data of ``dtype``; :class:`BackendUnavailable` if absent."""
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown backend {name!r}; choose one of "
                                 f"{', '.join(BACKENDS)}")
    if dtype not in DTYPES:
        raise BackendUnavailable(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if dtype == "bfloat16" and name in ("numpy", "array_api_strict", "cupy"):
        raise BackendUnavailable(f"{name} has no bfloat16; use --backend torch or jax")
    if name == "numpy":
        return ArrayBackend("numpy", "cpu", lambda x, dt: np.array(x, dtype=dt),
                            lambda x: None, "tracemalloc", np)
    if name == "array_api_strict":
        xp = _import("array_api_strict", name)
        return ArrayBackend(name, "cpu", lambda x, dt: xp.asarray(np.array(x, dtype=dt)),
                            lambda x: None, "tracemalloc", xp)
    if name == "torch":
        torch = _import("torch", name)
        dev = "cuda" if torch.cuda.is_available() else "cpu"

        def as_torch(x, dt):
            host = np.array(x, dtype="float32" if dt == "bfloat16" else dt)
            return torch.from_numpy(host).to(device=dev, dtype=getattr(torch, dt))

        def sync(x):
            if dev == "cuda":
                torch.cuda.synchronize()
        return ArrayBackend(name, dev, as_torch, sync, "cuda" if dev == "cuda" else None,
                            torch)
    if name == "jax":
        jax = _import("jax", name)
        if dtype == "float64":
            jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp

        def as_jax(x, dt):
            return jnp.asarray(np.array(x, dtype="float32" if dt == "bfloat16" else dt),
                               dtype=getattr(jnp, dt))

        def sync(x):
            if hasattr(x, "block_until_ready"):
                x.block_until_ready()
        return ArrayBackend(name, str(jax.devices()[0].platform), as_jax, sync, None, jax,
                            compile=jax.jit)
    cupy = _import("cupy", name)
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no GPU")
    except Exception as exc:  # pragma: no cover - depends on the machine
        raise BackendUnavailable(f"backend 'cupy' is installed but cannot use a GPU "
                                 f"here ({exc})") from None
    return ArrayBackend(  # pragma: no cover - needs a GPU
        name, "cuda", lambda x, dt: cupy.asarray(np.array(x, dtype=dt)),
        lambda x: cupy.cuda.Device().synchronize(), None, cupy)
