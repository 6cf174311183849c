"""The ``custom`` convention: an adapter object a user writes for any other signature."""
from __future__ import annotations

import numpy as np

from .base import VALUE_CLASSES, Call, Convention, draw_qkv, host

__all__ = ["Custom", "CUSTOM_OPTIONS"]

#: The options a custom adapter may declare, in arrayattn's names and meanings (``causal``
#: end-aligned, ``window=(left, right)``, ``alibi_slopes (h,)``), with the values drawn.
CUSTOM_OPTIONS = {"causal": (False, True), "scale": (None, 0.3),
                  "window": (None, (0, 0), (3, 0), (2, 5)), "softcap": (None, 1.0, 50.0),
                  "alibi_slopes": (None, "h"), "return_lse": (False, True),
                  "backward": (False, True)}


class Custom(Convention):
    """Wraps a user's adapter: an object with

    - ``call(fn, q, k, v, **options)`` -> ``out`` or ``(out, lse)`` (``lse`` when
      ``options["return_lse"]``), q, k, v in the adapter's ``layout``;
    - ``options``: the names of :data:`CUSTOM_OPTIONS` the kernel takes (arrayattn's
      meanings: the adapter translates them to the kernel's);
    - optional ``framework`` (``"torch"``, default, or ``"jax"``), ``layout`` (``"bhnd"``,
      default, or ``"bnhd"``), ``gqa`` (default False), ``name``.
    """

    def __init__(self, adapter):
        if not callable(getattr(adapter, "call", None)):
            raise TypeError("a custom convention needs an adapter object with a call(fn, q, "
                            "k, v, **options) method (see arrayattn.testing.check.Custom)")
        self.adapter = adapter
        self.name = getattr(adapter, "name", "custom")
        self.framework = getattr(adapter, "framework", "torch")
        self.layout = getattr(adapter, "layout", "bhnd")
        self.gqa = bool(getattr(adapter, "gqa", False))
        wanted = tuple(getattr(adapter, "options", ()))
        unknown = sorted(set(wanted) - set(CUSTOM_OPTIONS))
        if unknown:
            raise ValueError(f"custom adapter options {unknown} unknown; known: "
                             f"{sorted(CUSTOM_OPTIONS)}")
        self.space = {k: v for k, v in CUSTOM_OPTIONS.items() if k in wanted}

    values = VALUE_CLASSES
    signature = "adapter.call(fn, q, k, v, **options) -> out or (out, lse)"

    def _swap(self, x):
        return np.ascontiguousarray(np.swapaxes(x, -3, -2)) if self.layout == "bnhd" else x

    def build(self, case) -> Call:
        rng = np.random.default_rng(case.seed)
        arrays = {k: self._swap(v) for k, v in draw_qkv(case, rng).items()}
        opts = {k: v for k, v in case.active().items() if k not in ("backward", "return_lse")}
        if opts.get("alibi_slopes"):
            arrays["alibi_slopes"] = rng.uniform(0.05, 1.0, case.hq)
        t = self.tensors(arrays, case)
        params = dict(opts)
        if "alibi_slopes" in t:
            params["alibi_slopes"] = host(t["alibi_slopes"])
        return Call(t, ("q", "k", "v"), "softmax", None, self.layout, params,
                    grad_params=params)

    def call(self, fn, t, case):
        opts = {k: v for k, v in case.active().items() if k != "backward"}
        if "alibi_slopes" in t:
            opts["alibi_slopes"] = t["alibi_slopes"]
        res = self.adapter.call(fn, t["q"], t["k"], t["v"], **opts)
        if opts.get("return_lse"):
            return {"out": res[0], "lse": res[1]}
        return {"out": res}
