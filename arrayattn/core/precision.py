"""Full float32 precision for the duration of a call, whatever the backend's default.

A reference must compute at the precision its dtype promises.  Three backends may run
float32 matmuls in TF32 (10-bit mantissa, ~1e-3 relative) instead:

* **JAX** on a GPU does by default.  Every call runs inside
  ``jax.default_matmul_precision("highest")`` -- a thread-local configuration context,
  read when JAX traces, so it also holds when the call is traced inside the user's own
  ``jax.jit``.
* **torch** when the user has switched TF32 on (``torch.backends.cuda.matmul.allow_tf32``
  or ``torch.set_float32_matmul_precision("high")``).  torch has only process-wide
  switches: when (and only when) one is on and CUDA is available, the call switches them
  off under a process lock and restores them afterwards, also on error.  Another thread
  running torch matmuls at that moment sees full precision too (never less).
* **CuPy** reads ``CUPY_TF32=1`` once at import; it cannot be pinned per call.  arrayattn
  warns once when it is set.

``ARRAYATTN_ALLOW_TF32=1`` opts out of all of this (TF32 where the backend allows it: faster
on a GPU, ~1e-3 relative error in float32).
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings

import array_api_compat

__all__ = ["full_precision", "tf32_allowed"]

_torch_lock = threading.Lock()
_warned_cupy = False


def tf32_allowed() -> bool:
    """Whether the user opted in to TF32 (``ARRAYATTN_ALLOW_TF32=1``)."""
    return os.environ.get("ARRAYATTN_ALLOW_TF32", "").strip() in ("1", "true", "yes")


@contextlib.contextmanager
def _torch_full_precision():
    import torch
    if not torch.cuda.is_available():
        yield          # CPU matmuls never use TF32
        return
    matmul = torch.backends.cuda.matmul
    if not matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest" \
            and not torch.backends.cudnn.allow_tf32:
        yield
        return
    with _torch_lock:
        saved = (matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                 torch.get_float32_matmul_precision())
        matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(saved[2])
            matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[0], saved[1]


@contextlib.contextmanager
def full_precision(xp):
    """Pin full-precision float32 matmuls on ``xp``'s backend inside the block (see the
    module docstring); nothing on NumPy and array-api-strict."""
    global _warned_cupy
    if tf32_allowed():
        yield
    elif array_api_compat.is_jax_namespace(xp):
        import jax
        with jax.default_matmul_precision("highest"):
            yield
    elif array_api_compat.is_torch_namespace(xp):
        with _torch_full_precision():
            yield
    else:
        if (array_api_compat.is_cupy_namespace(xp) and not _warned_cupy
                and os.environ.get("CUPY_TF32", "") == "1"):
            _warned_cupy = True
            warnings.warn("CUPY_TF32=1: CuPy runs float32 matmuls in TF32 (~1e-3 relative "
                          "error) and cannot be pinned per call; unset it for reference "
                          "precision", RuntimeWarning, stacklevel=3)
        yield
