"""Array-API plumbing shared by every variant.

Public functions infer the namespace from their arguments (:func:`xp_namespace`);
private helpers take ``xp`` explicitly.  Nothing here calls NumPy on a user array:
the only NumPy use is for host-drawn random matrices (:func:`xp_from_host`) and for
the explicit host transfer used by the CLI and the testing helpers (:func:`to_numpy`).
"""
from __future__ import annotations

from typing import Any

import array_api_compat
import numpy as np

__all__ = [
    "xp_namespace",
    "xp_device",
    "compute_dtype",
    "xp_from_host",
    "to_numpy",
    "host_values",
]


def xp_namespace(*arrays: Any, names: tuple[str, ...] | None = None):
    """Return the array namespace shared by ``arrays`` (``None`` entries are skipped).

    Raises ``TypeError`` naming the arguments when they come from different libraries.
    """
    present = [(i, a) for i, a in enumerate(arrays) if a is not None]
    try:
        return array_api_compat.array_namespace(*(a for _, a in present))
    except TypeError as exc:
        if names is None:
            raise
        kinds = ", ".join(
            f"{names[i]} is {type(a).__module__}.{type(a).__name__}" for i, a in present
        )
        raise TypeError(
            f"arrays come from different array libraries ({kinds}); "
            "pass all of them from one library"
        ) from exc


def xp_device(x):
    """The device of ``x``, or ``None`` when the library cannot say (e.g. a JAX tracer)."""
    try:
        return array_api_compat.device(x)
    except Exception:  # pragma: no cover - defensive for tracers of exotic libraries
        return None


def compute_dtype(xp, dtype):
    """The dtype the arithmetic is carried out in for inputs of ``dtype``.

    float16 and bfloat16 are accumulated in float32 (their 10/7-bit mantissas cannot
    hold a softmax denominator over thousands of keys); float32 and float64 are kept.
    """
    if dtype == xp.float32 or dtype == xp.float64:
        return dtype
    return xp.float32



def xp_from_host(xp, array: np.ndarray, *, dtype, device):
    """Move a host NumPy ``array`` to ``xp`` on ``device`` with ``dtype``.

    Random matrices are drawn on the host (float64) so that the same seed gives the
    same matrix on every backend, and index/mask data of static patterns is built there
    (int64, bool); this is the one place where host data crosses to the device.  The
    host dtype is kept for the transfer (integers and booleans are exact), then cast.
    """
    host = np.ascontiguousarray(array)
    try:
        out = xp.asarray(host, device=device)
    except (TypeError, ValueError, RuntimeError):
        # Some namespaces (array-api-strict on a non-default device, CuPy) only accept
        # buffers or nested sequences for a cross-device copy; go via the default device.
        out = xp.asarray(host)
        if device is not None:
            out = array_api_compat.to_device(out, device)
    out = out if out.dtype == dtype else xp.astype(out, dtype)
    if array_api_compat.is_jax_array(out):
        # Under jax.jit the host array is a constant of the program: without a barrier
        # XLA evaluates everything computed from it alone (cumulative gate sums, masks
        # from index tables) at compile time, on its slow interpreter.
        import jax
        out = jax.lax.optimization_barrier(out)
    return out


def host_values(x):
    """A small array's values on the host, for validating parameters (a few decays, say)
    the way a list is validated; ``None`` for a traced JAX array, whose values do not
    exist yet (its checks then happen in the computation)."""
    try:
        return np.asarray(to_numpy(x), dtype=np.float64)
    except Exception as exc:        # jax.errors.TracerArrayConversionError and kin
        if "Tracer" in type(exc).__name__ or "Tracer" in str(exc)[:200]:
            return None
        raise


def to_numpy(x) -> np.ndarray:
    """Copy any supported array to a NumPy array on the host (testing, CLI, reports).

    Never used on a hot path: on a GPU it synchronises.
    """
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__
    if mod.startswith("array_api_strict"):
        return np.asarray(x._array)
    if mod.startswith("torch"):
        x = x.detach().cpu()
        if x.dtype.is_floating_point and x.element_size() == 2 and str(x.dtype) != "torch.float16":
            x = x.float()  # bfloat16 has no NumPy dtype
        return x.numpy()
    if mod.startswith("cupy"):
        return x.get()
    return np.asarray(x)
