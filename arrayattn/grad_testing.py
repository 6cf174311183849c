r"""The referee of the backward pass: another implementation's gradients against
:func:`arrayattn.vjp` in float64, per head and per argument.

Two rules set the tolerance of each head of each gradient:

* ``"float64"`` (the default for float32 and float64 gradients): as for outputs
  (:func:`arrayattn.testing.compare_to_reference`), ``8 max(e, eps |R|_inf)`` with ``e``
  arrayattn's own gradient error in the working precision (float32, or float64) on inputs
  perturbed by one unit roundoff;
* ``"same-dtype"`` (the default for float16 / bfloat16 gradients): FlashAttention's rule --
  the kernel's error against the float64 reference may be at most ``factor`` (2) times
  the error of the reference itself computed at the inputs' precision.  That reference
  takes the inputs (and ``do``) rounded to the dtype, computes in float32 (as every
  fused kernel accumulates) and rounds each gradient to the dtype once; intermediates are
  *not* rounded to the half dtype, so this baseline is at most as large as that of a
  reference written with every operation in the half dtype (FlashAttention's
  ``attention_ref(upcast=False)``): the rule is the stricter one.
"""
from __future__ import annotations

import numpy as np

from ._xp import to_numpy
from .testing import (_EPS, LAYOUTS, TOLERANCE_FACTOR, Comparison, _dtype_name, _host64,
                      check_tolerance)

__all__ = ["compare_grads", "assert_grads_match", "compare_lse", "round_to", "GradComparison",
           "RULES"]

#: The tolerance rules (see the module docstring).
RULES = ("float64", "same-dtype")

_HALF = ("float16", "bfloat16")


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded (to nearest, ties to even) to ``dtype`` and back to float64; bfloat16
    by its bit pattern (the top 16 bits of a float32), so no extension is needed."""
    if dtype in ("float64",):
        return np.asarray(x, dtype=np.float64)
    if dtype == "bfloat16":
        bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = bits.astype(np.uint32).view(np.float32).astype(np.float64)
        return np.where(np.isfinite(x), out, x)
    return np.asarray(x, dtype=dtype).astype(np.float64)


class GradComparison:
    """Per-argument :class:`~arrayattn.testing.Comparison` of gradients (``.items``, a dict
    name -> Comparison), with ``.ok``, ``.verdict()`` and ``.table()``."""

    def __init__(self, variant: str, items: dict, rule: str):
        self.variant, self.items, self.rule = variant, items, rule

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.items.values())

    def verdict(self) -> str:
        bad = [name for name, c in self.items.items() if not c.ok]
        names = ", ".join(f"d{name}" for name in self.items)
        if not bad:
            return f"GRADIENTS MATCH: {self.variant} ({names}; rule {self.rule})"
        worst = self.items[bad[0]]
        return (f"GRADIENTS MISMATCH: {self.variant}: {', '.join('d' + b for b in bad)} over "
                f"tolerance (rule {self.rule}); d{bad[0]} worst "
                f"{worst._head_line(worst.failing[0])}")

    def table(self) -> str:
        return "\n".join(f"d{name}:\n{c.table()}" for name, c in self.items.items())

    def __repr__(self) -> str:
        return f"<GradComparison {self.verdict()}>"


def _heads2(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.reshape((-1, *a.shape[-2:])) if a.ndim >= 2 else a.reshape((1, 1, -1))


def _bnhd(arrays: dict, names) -> dict:
    out = dict(arrays)
    for name in names:
        if name in out and _array(out[name]):
            if out[name].ndim < 3:
                raise ValueError(f"layout 'bnhd' needs {name} of shape (..., tokens, heads, "
                                 f"dim); got shape {out[name].shape}")
            out[name] = np.swapaxes(out[name], -3, -2)
    if _array(out.get("key_mask")):
        out["key_mask"] = np.expand_dims(out["key_mask"], -2)
    return out


def _array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def compare_grads(grads: dict, variant, q, k, v, do, /, *, rtol=None, atol=0.0, layout=None,
                  rule=None, factor: float = 2.0, **params) -> GradComparison:
    """Compare ``grads`` (``{"q": dq, "k": dk, "v": dv, <argument>: d<argument>}``, any
    array library) with arrayattn's float64 :func:`~arrayattn.vjp` of ``variant`` at
    ``(q, k, v, do, **params)``.

    Parameters
    ----------
    grads : dict
        The gradients under test, keyed like :func:`arrayattn.vjp`'s result; any subset.
    variant : str or Variant
        Registry name.
    q, k, v, do : array
        The forward's inputs and the output cotangent the gradients were computed with.
    rtol : float, optional
        Override: allowed max-abs error of a head relative to its largest reference entry
        (finite, >= 0).
    atol : float
        Absolute allowance added to each head's tolerance (default 0; finite, >= 0).
    layout : {"bhnd", "bnhd"}, optional
        Axis order of q, k, v, do and their gradients (default ``"bhnd"``).
    rule : {"float64", "same-dtype"}, optional
        The tolerance rule (module docstring); default by the gradients' dtype.
    factor : float
        The multiple of the ``same-dtype`` rule (FlashAttention's tests use 2).
    **params
        The forward's options (arrays as host data or any library).

    Returns
    -------
    GradComparison

    Examples
    --------
    >>> import numpy as np
    >>> import arrayattn
    >>> from arrayattn.testing import compare_grads
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, do = (rng.standard_normal((2, 16, 8), dtype=np.float32) for _ in range(4))
    >>> mine = arrayattn.vjp("softmax", q, k, v, do, causal=True)   # "their" kernel
    >>> compare_grads(mine, "softmax", q, k, v, do, causal=True).ok
    True
    >>> mine["k"][1, 3, 2] += 1e-3
    >>> compare_grads(mine, "softmax", q, k, v, do, causal=True).verdict()[:35]
    'GRADIENTS MISMATCH: softmax: dk ove'
    """
    from ._engine import use_engine
    from .backward import vjp
    from .registry import get_variant

    rtol, atol = check_tolerance("rtol", rtol), check_tolerance("atol", atol, optional=False)
    factor = check_tolerance("factor", factor, optional=False)
    if not grads:
        raise ValueError("grads is empty: give at least one of dq, dk, dv, ...")
    rec = get_variant(variant)
    layout = "bhnd" if layout is None else layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    dtypes = {_dtype_name(g) for g in grads.values()}
    for dt in dtypes:
        if dt not in _EPS:
            raise TypeError(f"gradients must have a floating dtype; got {dt}")
    half = bool(dtypes & set(_HALF))
    rule = ("same-dtype" if half else "float64") if rule is None else rule
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}; got {rule!r}")
    host = {"q": _host64(q), "k": _host64(k), "v": _host64(v), "do": _host64(do)}
    host.update({key: _host64(val) if _array(val) else val for key, val in params.items()})
    theirs = {name: _host64(g) for name, g in grads.items()}
    if layout == "bnhd":
        host = _bnhd(host, ("q", "k", "v", "do"))
        theirs = _bnhd(theirs, ("q", "k", "v"))
    args = {key: host.pop(key) for key in ("q", "k", "v", "do")}
    unknown = sorted(set(theirs) - set(args) - set(host))
    if unknown:
        raise ValueError(f"grads has {', '.join(unknown)}, not arguments of this call")

    def evaluate(a, p, dtype):
        cast = {key: (val.astype(dtype) if _array(val) and val.dtype.kind == "f" else val)
                for key, val in {**a, **p}.items()}
        with use_engine("reference"):
            res = vjp(rec, cast.pop("q"), cast.pop("k"), cast.pop("v"), cast.pop("do"), **cast)
        return {name: np.asarray(to_numpy(g), dtype=np.float64) for name, g in res.items()}

    ref = evaluate(args, host, "float64")
    missing = sorted(set(theirs) - set(ref))
    if missing:
        raise ValueError(f"{rec.name} has no gradient for {', '.join(missing)} in this call")
    prng = np.random.default_rng(0)
    items = {}
    for name, g in theirs.items():
        r = ref[name]
        if g.shape != r.shape:
            raise ValueError(f"grads[{name!r}] has shape {g.shape} but d{name} has shape "
                             f"{r.shape}")
    if rule == "same-dtype":
        dt = sorted(dtypes & set(_HALF))[0] if half else sorted(dtypes)[0]
        rounded = {key: round_to(val, dt) for key, val in args.items()}
        pr = {key: (round_to(val, dt) if _array(val) and val.dtype.kind == "f" else val)
              for key, val in host.items()}
        own = {name: round_to(g, dt) for name, g in evaluate(rounded, pr, "float32").items()}
    else:
        work = "float64" if dtypes == {"float64"} else "float32"
        u = _EPS[work] / 2

        def nudge(x):
            return x * (1.0 + u * prng.choice([-1.0, 1.0], size=x.shape))

        own = evaluate({key: nudge(val) for key, val in args.items()},
                       {key: (nudge(val) if _array(val) and val.dtype.kind == "f" else val)
                        for key, val in host.items()}, work)
    for name, g in theirs.items():
        r, o = _heads2(ref[name]), _heads2(g)
        heads = [tuple(int(i) for i in idx) for idx in np.ndindex(*ref[name].shape[:-2])] \
            if ref[name].ndim > 2 else [()] * r.shape[0]
        err = np.abs(o - r)
        err = np.where(np.isnan(err), np.inf, err).reshape(len(r), -1)
        max_abs = err.max(axis=1, initial=0.0)
        arg = err.argmax(axis=1) if err.shape[1] else np.zeros(len(r), int)
        worst = [tuple(int(t) for t in np.unravel_index(int(a), r.shape[1:])) for a in arg]
        scale = np.abs(r).reshape(len(r), -1).max(axis=1, initial=0.0)
        own_err = np.abs(_heads2(own[name]) - r).reshape(len(r), -1).max(axis=1, initial=0.0)
        own_err = np.where(np.isfinite(own_err), own_err, 0.0)
        dt = _dtype_name(grads[name])
        floor = scale * _EPS[dt]
        if rtol is not None:
            tol = rtol * scale + atol
        elif rule == "same-dtype":
            tol = factor * np.maximum(own_err, floor) + atol
        else:
            tol = TOLERANCE_FACTOR * np.maximum(own_err, floor) + atol
        items[name] = Comparison(f"{rec.name} d{name}", dt, heads, max_abs,
                                 max_abs / np.where(scale > 0, scale, 1.0), tol, worst,
                                 own_err, ref_scale=scale)
    return GradComparison(rec.name, items, rule)


def assert_grads_match(grads: dict, variant, q, k, v, do, /, **kwargs) -> None:
    """Assert that ``grads`` equal arrayattn's float64 :func:`~arrayattn.vjp` per head and
    argument (:func:`compare_grads`; same keywords); ``AssertionError`` names the worst.
    A NaN or inf gradient where the reference is finite never passes; a negative or
    non-finite ``rtol`` / ``atol`` is a ``ValueError``.

    Examples
    --------
    >>> import numpy as np
    >>> import arrayattn
    >>> from arrayattn.testing import assert_grads_match
    >>> rng = np.random.default_rng(1)
    >>> q, k, v, do = (rng.standard_normal((3, 12, 8)) for _ in range(4))
    >>> assert_grads_match(arrayattn.vjp("softmax", q, k, v, do), "softmax", q, k, v, do)
    """
    c = compare_grads(grads, variant, q, k, v, do, **kwargs)
    if not c.ok:
        lines = [c.verdict()]
        for name, item in c.items.items():
            lines += [f"  d{name} " + item._head_line(i) for i in item.failing[:3]]
        raise AssertionError("\n".join(lines))


def compare_lse(lse, variant, q, k, v, /, *, rtol=None, atol=0.0, layout=None,
                **params) -> Comparison:
    """Compare a kernel's log-sum-exp ``lse (..., heads, n)`` (FlashAttention's
    ``softmax_lse``, in either layout of q, k, v) with the reference's
    (``return_lse=True``), one head per row.  A row with no visible key agrees when both
    are infinite (arrayattn stores ``-inf``, FlashAttention ``+inf``).  Tolerance
    ``8 max(e, eps |L|_inf)`` with ``e`` arrayattn's own float32 (or float64) error."""
    from .registry import get_variant

    rtol, atol = check_tolerance("rtol", rtol), check_tolerance("atol", atol, optional=False)
    rec = get_variant(variant)
    dt = _dtype_name(lse)
    if dt not in _EPS:
        raise TypeError(f"lse must have a floating dtype; got {dt}")
    host = {"q": _host64(q), "k": _host64(k), "v": _host64(v)}
    host.update({key: _host64(val) if _array(val) else val for key, val in params.items()})
    if (layout or "bhnd") == "bnhd":
        host = _bnhd(host, ("q", "k", "v"))
    a = {key: host.pop(key) for key in ("q", "k", "v")}

    def evaluate(dtype, nudge=None):
        cast = {key: (val.astype(dtype) if _array(val) and val.dtype.kind == "f" else val)
                for key, val in {**a, **host}.items()}
        if nudge is not None:
            cast = {key: (nudge(val) if key in "qkv" else val) for key, val in cast.items()}
        res = rec.reference(cast.pop("q"), cast.pop("k"), cast.pop("v"), return_lse=True,
                            **cast)[1]
        return np.asarray(to_numpy(res), dtype=np.float64)

    ref = evaluate("float64")
    theirs = _host64(lse)
    if theirs.shape != ref.shape:
        raise ValueError(f"lse has shape {theirs.shape} but the reference's is {ref.shape}")
    work = "float64" if dt == "float64" else "float32"
    u, prng = _EPS[work] / 2, np.random.default_rng(0)
    own = evaluate(work, lambda x: (x * (1.0 + u * prng.choice([-1.0, 1.0], size=x.shape))
                                    ).astype(work))
    empty = np.isinf(ref)
    agree = np.where(empty, np.isinf(theirs), True)
    finite_ref = np.where(empty, 0.0, ref)
    err = np.where(empty, np.where(agree, 0.0, np.inf),
                   np.abs(np.where(np.isinf(theirs), np.inf, theirs) - finite_ref))
    err = np.where(np.isnan(err), np.inf, err)
    r = ref.reshape(-1, ref.shape[-1]) if ref.ndim > 1 else ref.reshape(1, -1)
    e = err.reshape(r.shape)
    scale = np.abs(np.where(np.isfinite(r), r, 0.0)).max(axis=1, initial=0.0)
    with np.errstate(invalid="ignore"):
        own_err = np.where(empty | ~np.isfinite(own), 0.0, np.abs(own - finite_ref))
    own_err = own_err.reshape(r.shape)
    own_err = np.where(np.isfinite(own_err), own_err, 0.0).max(axis=1, initial=0.0)
    max_abs = e.max(axis=1, initial=0.0)
    tol = atol + (rtol * scale if rtol is not None
                  else TOLERANCE_FACTOR * np.maximum(own_err, scale * _EPS[dt]))
    heads = [tuple(int(i) for i in idx) for idx in np.ndindex(*ref.shape[:-1])] or [()]
    worst = [(int(i), 0) for i in e.argmax(axis=1)]
    return Comparison(f"{rec.name} lse", dt, heads, max_abs,
                      max_abs / np.where(scale > 0, scale, 1.0), tol, worst, own_err,
                      ref_scale=scale)
