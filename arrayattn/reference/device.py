"""Where an array lives, in the one word the rules read: ``"gpu"`` or ``"cpu"`` (the sizes
chosen per device, :mod:`arrayattn.core.devices`, and the scan's form, :mod:`.scan`)."""
from __future__ import annotations

import array_api_compat

__all__ = ["device_kind"]


def device_kind(x) -> str:
    """``"gpu"`` for CuPy arrays, torch CUDA tensors and JAX arrays on a GPU; else
    ``"cpu"``."""
    if array_api_compat.is_cupy_array(x):
        return "gpu"
    if array_api_compat.is_torch_array(x):
        return "gpu" if x.device.type == "cuda" else "cpu"
    if array_api_compat.is_jax_array(x):
        try:
            devices = x.devices()
        except Exception:   # a tracer: ask the default backend
            import jax
            return "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu"
        return "gpu" if any(d.platform in ("gpu", "cuda", "rocm") for d in devices) else "cpu"
    return "cpu"
