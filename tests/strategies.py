"""Hypothesis strategies for attention problems."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


@st.composite
def attention_problems(draw, *, max_batch_dims=2, max_n=12, max_s=12, max_d=8,
                       masks=True, logit_scales=(0.1, 1.0, 10.0, 100.0, 1e4)):
    """A random attention problem as a dict of float64 NumPy arrays and options.

    Shapes include n = 1, s = 1, n != s and several (broadcasting) batch dims; masks
    include all-False rows; ``logit_scale`` rescales q so that the largest logit is of
    that size (|q.k.scale| up to 1e4).
    """
    nb = draw(st.integers(0, max_batch_dims))
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=nb, max_size=nb)))
    n = draw(st.integers(1, max_n))
    s = draw(st.integers(1, max_s))
    d = draw(st.integers(1, max_d))
    dv = draw(st.integers(1, max_d))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    # Broadcasting: k/v may drop or collapse leading dims.
    kbatch = tuple(1 if draw(st.booleans()) else b for b in batch)
    q = rng.standard_normal((*batch, n, d))
    k = rng.standard_normal((*kbatch, s, d))
    v = rng.standard_normal((*kbatch, s, dv))
    target = draw(st.sampled_from(logit_scales))
    current = np.abs(q @ np.swapaxes(k, -1, -2)).max() / np.sqrt(d)
    q = q * (target / max(current, 1e-12))
    out = dict(q=q, k=k, v=v, causal=draw(st.booleans()))
    if masks and draw(st.booleans()):
        p_keep = draw(st.sampled_from([0.0, 0.3, 0.8]))
        out["key_mask"] = rng.random((*batch, s)) < p_keep
    if masks and draw(st.booleans()):
        m = rng.random((*batch, n, s)) < 0.6
        if n > 1:
            m[..., 0, :] = False  # an all-False row
        out["mask"] = m
    return out
