"""The conventions of flash-linear-attention's gated kernels (``chunk_gla``,
``chunk_simple_gla``, ``chunk_delta_rule``, ``chunk_gated_delta_rule``): layout
``(B, T, H, K)``, ``scale`` (None: ``K ** -0.5``), ``initial_state`` and
``output_final_state`` (the state ``(B, H, K, V)`` is judged too), returning
``(o, final_state)``."""
from __future__ import annotations

import numpy as np

from .base import Call, Convention, draw_qkv, swap

__all__ = ["FlaGla", "FlaSimpleGla", "FlaDeltaRule", "FlaGatedDeltaRule"]

_GATES = (None, "near_zero", "very_negative")


def _log_gates(kind, rng, shape) -> np.ndarray:
    """Log gates: logsigmoid of N(3, 1) (typical), within 1e-3 of 0, or down to -40."""
    if kind == "near_zero":
        return -1e-3 * rng.random(shape)
    if kind == "very_negative":
        return -5.0 - 35.0 * rng.random(shape)
    return -np.log1p(np.exp(-(rng.standard_normal(shape) + 3.0)))


class _Fla(Convention):
    """The shared machinery; subclasses name the variant and their extra arrays."""

    framework = "torch"
    equal_lengths = True
    gqa = False
    variant = ""
    #: (fla's argument, arrayattn's option, "gate" | "beta", per key dimension?)
    extras: tuple = ()
    unit_qk = False

    def build(self, case) -> Call:
        rng = np.random.default_rng(case.seed)
        o = case.opts
        qkv = draw_qkv(case, rng, unit_qk=self.unit_qk)
        bhnd = dict(qkv)
        for port, _, kind, per_dim in self.extras:
            shape = (case.b, case.hq, case.n) + ((case.d,) if per_dim else ())
            bhnd[port] = (_log_gates(o.get("gate"), rng, shape) if kind == "gate" else
                          1.0 / (1.0 + np.exp(-rng.standard_normal(shape))))
        if o.get("initial_state"):
            bhnd["initial_state"] = rng.standard_normal((case.b, case.hq, case.d, case.dv))
        arrays = {k: (swap(v) if v.ndim == 4 and k != "initial_state" else
                      np.ascontiguousarray(np.moveaxis(v, 1, 2)) if v.ndim == 3 else v)
                  for k, v in bhnd.items()}
        t = self.tensors(arrays, case)
        judge = {k: (swap(_h(v)) if _h(v).ndim == 4 and k != "initial_state" else
                     np.moveaxis(_h(v), 2, 1) if _h(v).ndim == 3 else _h(v))
                 for k, v in t.items()}
        scale = o.get("scale") or case.d ** -0.5
        params = {"scale": scale, "causal": True}
        params.update({ours: judge[port] for port, ours, _, _ in self.extras})
        if self.variant in ("deltanet", "gated_deltanet"):
            params["normalize_qk"] = False
        if "initial_state" in judge:
            params["initial_state"] = judge["initial_state"]
        diff = ("q", "k", "v") + tuple(p for p, *_ in self.extras) + (
            ("initial_state",) if "initial_state" in t else ())
        return Call(t, diff, self.variant, None, "bhnd", params, grad_params=params,
                    state=params if o.get("output_final_state") else None, inputs=judge,
                    rename={port: ours for port, ours, _, _ in self.extras},
                    notes=[f"judged in (b, h, n, d): {self.variant}"])

    def to_judge(self, name, x):
        if name in ("final_state", "initial_state"):
            return x
        return x.swapaxes(1, 2)

    def call(self, fn, t, case):
        o = case.opts
        args = [t[port] for port, *_ in self.extras]
        res = fn(t["q"], t["k"], t["v"], *args, scale=o.get("scale"),
                 initial_state=t.get("initial_state"),
                 output_final_state=bool(o.get("output_final_state")))
        out, state = res
        return {"out": out, "final_state": state if o.get("output_final_state") else None}


def _h(x) -> np.ndarray:
    from .base import host
    return host(x)


_FLA_SPACE = {"scale": (None, 0.5), "initial_state": (False, True),
              "output_final_state": (False, True), "backward": (False, True)}


class FlaGla(_Fla):
    """``fn(q, k, v, g, scale=None, initial_state=None, output_final_state=False)``, ``g``
    the log gates ``(B, T, H, K)``."""

    name, variant = "fla_gla", "gla"
    signature = "fn(q, k, v, g, scale=None, initial_state=None, output_final_state=False)"
    extras = (("g", "g", "gate", True),)
    space = {"gate": _GATES, **_FLA_SPACE}


class FlaSimpleGla(_Fla):
    """``fn(q, k, v, g, scale=None, initial_state=None, output_final_state=False)``, ``g``
    one log gate per head and token ``(B, T, H)`` (arrayattn's ``ssd``)."""

    name, variant = "fla_simple_gla", "ssd"
    signature = "fn(q, k, v, g, scale=None, initial_state=None, output_final_state=False)"
    extras = (("g", "a", "gate", False),)
    space = {"gate": _GATES, **_FLA_SPACE}


class FlaDeltaRule(_Fla):
    """``fn(q, k, v, beta, scale=None, initial_state=None, output_final_state=False)``,
    ``beta (B, T, H)``; q and k L2-normalised by the checker."""

    name, variant, unit_qk = "fla_delta_rule", "deltanet", True
    signature = ("fn(q, k, v, beta, scale=None, initial_state=None, "
                 "output_final_state=False)")
    extras = (("beta", "beta", "beta", False),)
    space = dict(_FLA_SPACE)


class FlaGatedDeltaRule(_Fla):
    """``fn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False)``,
    ``g`` and ``beta`` ``(B, T, H)``; q and k L2-normalised by the checker."""

    name, variant, unit_qk = "fla_gated_delta_rule", "gated_deltanet", True
    signature = ("fn(q, k, v, g, beta, scale=None, initial_state=None, "
                 "output_final_state=False)")
    extras = (("g", "g", "gate", False), ("beta", "beta", "beta", False))
    space = {"gate": _GATES, **_FLA_SPACE}
