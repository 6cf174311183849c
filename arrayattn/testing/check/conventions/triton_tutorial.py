"""The convention of the Triton tutorial's fused attention (``python/tutorials/
06-fused-attention.py``): ``attention(q, k, v, causal, sm_scale)``, an autograd Function
many kernels start from."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .base import draw_qkv, host
from .shipped import ShippedConvention

__all__ = ["TritonTutorial"]


class TritonTutorial(ShippedConvention):
    """``fn(q, k, v, causal, sm_scale)`` (positional, ``attention = _attention.apply``) ->
    out, and its backward (``out.backward(do)`` gives dq, dk, dv).

    Layout ``(Z, H, N_CTX, HEAD_DIM)`` for q, k, v and the output; one length for queries
    and keys (``n == s``, so causal top-left and bottom-right agree), as many key/value
    heads as query heads, one head dim ``HEAD_DIM`` in {16, 32, 64, 128, 256} (the
    tutorial's assert); ``sm_scale`` is required (the checker passes ``HEAD_DIM ** -0.5``,
    0.3 or 1.3, the tutorial's benchmark value).

    The tutorial's own kernel asks more than its signature says: its backward asserts
    ``N_CTX % 128 == 0`` and is written for the causal case only (its benchmark skips the
    non-causal backward), so ``TritonTutorial(n_multiple=128)`` draws only such lengths; the
    default (every length) checks a kernel that claims the signature in general.  The lse
    the forward keeps for the backward (``M``, base 2) is not returned."""

    name = "triton_tutorial"
    signature = "fn(q, k, v, causal, sm_scale) -> out (autograd: out.backward(do))"
    head_dims = (16, 32, 64, 128, 256)
    equal_lengths = True
    equal_dims = True
    gqa = False
    space = {"causal": (False, True), "sm_scale": (None, 0.3, 1.3), "backward": (False, True)}

    def __init__(self, n_multiple: int = 1):
        if int(n_multiple) < 1:
            raise ValueError(f"n_multiple must be >= 1; got {n_multiple!r}")
        self.n_multiple = int(n_multiple)

    def normalize(self, case):
        case = super().normalize(case)
        m = self.n_multiple
        n = -(-case.n // m) * m
        if (n, n) != (case.n, case.s):
            case = replace(case, n=n, s=n)
        return case

    def build_valid(self, case):
        rng = np.random.default_rng(case.seed)
        t = self.tensors(draw_qkv(case, rng), case)
        params = {"causal": bool(case.opts.get("causal")),
                  "scale": float(case.opts.get("sm_scale") or case.d ** -0.5)}
        inputs = {name: host(t[name]) for name in ("q", "k", "v", "do")}
        return self.judged_call(t, ("q", "k", "v"), params, inputs)

    def call_valid(self, fn, t, case):
        scale = float(case.opts.get("sm_scale") or case.d ** -0.5)
        return {"out": fn(t["q"], t["k"], t["v"], bool(case.opts.get("causal")), scale)}
