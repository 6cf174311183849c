"""The convention of xFormers' ``memory_efficient_attention``: layout ``(B, M, H, K)``,
grouped heads ``(B, M, G, H, K)``, the masks as ``attn_bias`` objects."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import xformers_bias
from .base import draw_qkv, host, swap
from .shipped import ShippedConvention

__all__ = ["XFormers", "real_bias_factory", "mirror_bias_factory"]

_BOTTOM_RIGHT = ("LowerTriangularFromBottomRightMask",
                 "LowerTriangularFromBottomRightLocalAttentionMask",
                 "LocalAttentionFromBottomRightMask", "BlockDiagonalCausalFromBottomRightMask")


def mirror_bias_factory(kind, **fields):
    """``attn_bias`` objects of :mod:`~arrayattn.testing.check.conventions.xformers_bias`
    (no xFormers needed)."""
    return xformers_bias.make_bias(kind, **fields)


def real_bias_factory(kind, **fields):
    """``attn_bias`` objects of the real ``xformers.ops.fmha.attn_bias`` (ImportError
    without xFormers)."""
    from xformers.ops.fmha import attn_bias
    return xformers_bias.make_bias(kind, namespace=attn_bias, **fields)


def _auto_factory():
    try:
        from xformers.ops.fmha import attn_bias  # noqa: F401
    except Exception:       # not installed, or installed without its compiled parts
        return mirror_bias_factory
    return real_bias_factory


class XFormers(ShippedConvention):
    """``fn(query, key, value, attn_bias=None, p=0.0, scale=None)``: xFormers'
    ``xformers.ops.memory_efficient_attention``.

    - layout ``(B, M, H, K)`` for q and ``(B, N, H, K)``/``(B, N, H, Kv)`` for k, v; with
      fewer key/value heads (or the ``grouped`` option) the 5-d grouped form
      ``(B, M, G, H, K)``, k and v ``(B, N, G, 1, K)`` expanded over ``H`` as xFormers'
      tests build them (query head ``g H + h`` reads key/value head ``g``); the result has
      q's layout;
    - ``scale`` (``None``: ``K ** -0.5``), ``p=0`` (dropout is random: never drawn);
    - ``attn_bias``: one of :data:`~arrayattn.testing.check.conventions.xformers_bias.KINDS`
      (causal top-left and bottom-right, local windows, block-diagonal varlen as a packed
      batch of one, a tensor bias ``(B, H, M, N)`` or ``(B, G, H, M, N)``).

    The bias objects come from ``bias_factory(kind, **fields)``: by default the real
    ``xformers.ops.fmha.attn_bias`` classes when they import, else the stand-ins of
    :mod:`~arrayattn.testing.check.conventions.xformers_bias` (same names and fields);
    :func:`real_bias_factory` and :func:`mirror_bias_factory` force one.  Only the output
    is returned (``memory_efficient_attention`` has no lse), and gradients of q, k, v are
    judged with ``backward``.

    Examples
    --------
    >>> conv = XFormers(bias_factory=mirror_bias_factory)
    >>> conv.bias_factory("LocalAttentionFromBottomRightMask", window_left=1, window_right=0)
    LocalAttentionFromBottomRightMask(window_left=1, window_right=0)

    With xFormers on a CUDA machine, its kernel against the real bias classes:

    >>> import xformers.ops as xops                                   # doctest: +SKIP
    >>> from arrayattn.testing import check_kernel                    # doctest: +SKIP
    >>> res = check_kernel(xops.memory_efficient_attention,
    ...                    XFormers(bias_factory=real_bias_factory),
    ...                    device="cuda")                             # doctest: +SKIP
    """

    name = "xformers"
    signature = "fn(query, key, value, attn_bias=None, p=0.0, scale=None) -> out"
    space = {"attn_bias": (None,) + xformers_bias.KINDS, "scale": (None, 0.3),
             "grouped": (False, True), "backward": (False, True)}

    def __init__(self, bias_factory=None):
        self.bias_factory = bias_factory if bias_factory is not None else _auto_factory()

    def normalize(self, case):
        kind = case.opts.get("attn_bias")
        if kind in _BOTTOM_RIGHT and case.n > case.s:
            # bottom-right masks leave the first n - s rows without a key (xFormers:
            # "the forward pass is not defined"): never drawn
            case = replace(case, n=case.s)
        if kind and kind.startswith("BlockDiagonal") and case.b < 2:
            case = replace(case, b=2)
        return case

    def _lengths(self, case, rng, kind):
        lq = rng.integers(1, case.n + 1, case.b)
        lk = rng.integers(1, case.s + 1, case.b)
        lq[0], lk[0] = case.n, case.s
        if kind == "BlockDiagonalCausalFromBottomRightMask":
            lk = np.maximum(lk, lq)
        return lq, lk

    def build_valid(self, case):
        rng = np.random.default_rng(case.seed)
        o = case.opts
        kind = o.get("attn_bias")
        fields, params = {}, {}
        if kind and kind.startswith("BlockDiagonal"):
            lq, lk = self._lengths(case, rng, kind)
            qkv = draw_qkv(replace(case, b=1, n=int(lq.sum()), s=int(lk.sum())), rng)
            fields.update(q_seqlen=[int(x) for x in lq], kv_seqlen=[int(x) for x in lk])
            params["mask"] = _block_diagonal(lq, lk, kind)
        else:
            qkv = draw_qkv(case, rng)
        n, s = qkv["q"].shape[-2], qkv["k"].shape[-2]
        i, j = np.arange(n)[:, None], np.arange(s)[None, :]
        if kind in ("LowerTriangularMask", "LowerTriangularMaskWithTensorBias"):
            params["mask"] = j <= i                       # top-left
        elif kind == "LowerTriangularFromBottomRightMask":
            params["causal"] = True
        elif kind == "LowerTriangularFromBottomRightLocalAttentionMask":
            fields["window_size"] = int(rng.integers(1, 7))
            params["window"] = (fields["window_size"] - 1, 0)
        elif kind == "LocalAttentionFromBottomRightMask":
            fields["window_left"], fields["window_right"] = (int(x) for x in
                                                             rng.integers(0, 6, 2))
            params["window"] = (fields["window_left"], fields["window_right"])
        arrays = {name: swap(qkv[name]) for name in ("q", "k", "v")}
        arrays["do"] = qkv["do"]                         # judged in (b, h, n, dv)
        if kind in ("tensor", "LowerTriangularMaskWithTensorBias"):
            arrays["attn_bias"] = rng.standard_normal((case.b, case.hq, n, s))
        if o.get("scale") is not None:
            params["scale"] = float(o["scale"])
        t = self.tensors(arrays, case)
        if "attn_bias" in t:
            params["bias"] = host(t["attn_bias"])
        t["bias_fields"] = fields
        inputs = {name: host(t[name]).swapaxes(-3, -2) for name in ("q", "k", "v")}
        inputs["do"] = host(t["do"])
        return self.judged_call(t, ("q", "k", "v"), params, inputs,
                                [f"xformers attn_bias: {kind}"])

    def grad_to_bhnd(self, name, g):
        return g.swapaxes(-3, -2)

    def call_valid(self, fn, t, case):
        o = case.opts
        q, k, v = t["q"], t["k"], t["v"]
        b, m, hq, dk = q.shape
        hkv = k.shape[2]
        grouped = hq != hkv or bool(o.get("grouped"))
        bias = _aligned(t.get("attn_bias"))
        if grouped:
            g, h = hkv, hq // hkv
            q = q.reshape(b, m, g, h, dk)
            k = k[:, :, :, None].expand(b, k.shape[1], g, h, dk)
            v = v[:, :, :, None].expand(b, v.shape[1], g, h, v.shape[-1])
            if bias is not None:
                bias = bias.reshape(b, g, h, *bias.shape[-2:])
        kind = o.get("attn_bias")
        attn_bias = None if kind is None else self.bias_factory(
            kind, device=self.device, bias=bias, **t["bias_fields"])
        out = fn(q, k, v, attn_bias=attn_bias, p=0.0, scale=o.get("scale"))
        if grouped:
            out = out.reshape(b, m, hq, out.shape[-1])
        return {"out": out.transpose(1, 2)}


def _aligned(bias):
    """A tensor bias as a slice of one whose last axis is padded to a multiple of 8, as
    xFormers asks of a bias whose key length is not one ("HINT: ... slicing a bigger
    tensor"); the values are unchanged."""
    if bias is None or bias.shape[-1] % 8 == 0:
        return bias
    wide = bias.new_zeros(*bias.shape[:-1], -(-bias.shape[-1] // 8) * 8)
    wide[..., :bias.shape[-1]] = bias
    return wide[..., :bias.shape[-1]]


def _block_diagonal(lq, lk, kind) -> np.ndarray:
    """The visible pairs of a packed batch: block-diagonal, each block causal top-left
    (``BlockDiagonalCausalMask``) or bottom-right (``...FromBottomRightMask``)."""
    cq, ck = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    mask = np.zeros((int(cq[-1]), int(ck[-1])), dtype=bool)
    for b in range(len(lq)):
        i, j = np.arange(lq[b])[:, None], np.arange(lk[b])[None, :]
        block = np.ones((lq[b], lk[b]), dtype=bool)
        if kind == "BlockDiagonalCausalMask":
            block = j <= i
        elif kind == "BlockDiagonalCausalFromBottomRightMask":
            block = j <= i + lk[b] - lq[b]
        mask[cq[b]:cq[b + 1], ck[b]:ck[b + 1]] = block
    return mask
