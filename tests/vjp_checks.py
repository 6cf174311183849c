"""One check shared by the backward's test files: a vjp on another backend equals the
NumPy one (same keys; the backend's array type and device; the values to ``rtol``)."""
from __future__ import annotations

import numpy as np

from arrayattn.core.xp import xp_device


def assert_grads_on_backend(backend, call, q, k, v, do, opts=None, *, rtol=1e-12):
    """``call(q, k, v, do, **opts) -> dict`` on ``backend``'s arrays (array options moved
    too) equals the NumPy call."""
    opts = opts or {}
    expected = call(q, k, v, do, **opts)
    moved = {key: (backend.asarray(val) if hasattr(val, "shape") else val)
             for key, val in opts.items()}
    grads = call(*(backend.asarray(x) for x in (q, k, v, do)), **moved)
    assert sorted(grads) == sorted(expected)
    for key, g in grads.items():
        assert type(g) is type(backend.asarray(q)), key
        if backend.device is not None:
            assert xp_device(g) == backend.device, key
        np.testing.assert_allclose(backend.to_numpy(g), expected[key], rtol=rtol,
                                   atol=rtol * np.max(np.abs(expected[key])), err_msg=key)
