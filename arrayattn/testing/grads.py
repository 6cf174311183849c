r"""The gradient referee: another implementation's gradients against :func:`arrayattn.vjp`
in float64, per head and per argument."""
from __future__ import annotations

import numpy as np

from ..core.xp import to_numpy
from .assertions import check_tolerance
from .comparison import Comparison
from .measures import (EPS, TOLERANCE_FACTOR, Nudge, cast_floating, derived_tolerance,
                       dtype_name, head_errors, host64, is_array, own_head_error)
from .problem import to_bhnd

__all__ = ["compare_grads", "assert_grads_match", "round_to", "GradComparison", "RULES"]

#: The tolerance rules (see :func:`compare_grads`).
RULES = ("float64", "same-dtype")

_HALF = ("float16", "bfloat16")


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded (to nearest, ties to even) to ``dtype`` and back to float64; bfloat16
    by its bit pattern (the top 16 bits of a float32), so no extension is needed.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn.testing import round_to
    >>> float(round_to(np.array(1.0 + 2.0 ** -9), "bfloat16"))
    1.0
    """
    if dtype == "float64":
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
        """Whether every head of every gradient is within its tolerance."""
        return all(c.ok for c in self.items.values())

    def verdict(self) -> str:
        """One line: GRADIENTS MATCH or MISMATCH, with the worst head of the first failing
        gradient."""
        bad = [name for name, c in self.items.items() if not c.ok]
        names = ", ".join(f"d{name}" for name in self.items)
        if not bad:
            return f"GRADIENTS MATCH: {self.variant} ({names}; rule {self.rule})"
        worst = self.items[bad[0]]
        return (f"GRADIENTS MISMATCH: {self.variant}: {', '.join('d' + b for b in bad)} over "
                f"tolerance (rule {self.rule}); d{bad[0]} worst "
                f"{worst.head_line(worst.failing[0])}")

    def table(self) -> str:
        """One per-head table per gradient."""
        return "\n".join(f"d{name}:\n{c.table()}" for name, c in self.items.items())

    def __repr__(self) -> str:
        return f"<GradComparison {self.verdict()}>"


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
        The tolerance rule (Notes); default by the gradients' dtype.
    factor : float
        The multiple of the ``same-dtype`` rule (FlashAttention's tests use 2).
    **params
        The forward's options (arrays as host data or any library).

    Returns
    -------
    GradComparison

    Notes
    -----
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
    from ..registry import get_variant

    rtol, atol = check_tolerance("rtol", rtol), check_tolerance("atol", atol, optional=False)
    factor = check_tolerance("factor", factor, optional=False)
    if not grads:
        raise ValueError("grads is empty: give at least one of dq, dk, dv, ...")
    rec = get_variant(variant)
    dtypes, rule = _dtypes_and_rule(grads, rule)
    args, options, theirs = _host_problem(grads, q, k, v, do, params, layout)
    ref = _vjp(rec, args, options, "float64")
    _check_shapes(rec.name, theirs, ref)
    own = _baseline(rec, args, options, dtypes, rule)
    items = {}
    for name, g in theirs.items():
        dt = dtype_name(grads[name])
        errors = head_errors(np.abs(g - ref[name]), ref[name])
        own_err, _ = own_head_error(own[name], ref[name], len(errors.heads))
        tol = derived_tolerance(errors, own_err, dt, rtol=rtol, atol=atol, factor=(
            factor if rule == "same-dtype" else TOLERANCE_FACTOR))
        items[name] = Comparison.of(f"{rec.name} d{name}", dt, errors, tol, own_err)
    return GradComparison(rec.name, items, rule)


def _dtypes_and_rule(grads: dict, rule) -> tuple[set, str]:
    """The gradients' dtypes and the rule: ``same-dtype`` for half precision by default."""
    dtypes = {dtype_name(g) for g in grads.values()}
    for dt in dtypes:
        if dt not in EPS:
            raise TypeError(f"gradients must have a floating dtype; got {dt}")
    rule = ("same-dtype" if dtypes & set(_HALF) else "float64") if rule is None else rule
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}; got {rule!r}")
    return dtypes, rule


def _host_problem(grads, q, k, v, do, params, layout) -> tuple[dict, dict, dict]:
    """``(q, k, v, do; the options; the gradients)`` as host arrays in ``"bhnd"``."""
    layout = "bhnd" if layout is None else layout
    host = {"q": host64(q), "k": host64(k), "v": host64(v), "do": host64(do)}
    host.update({key: host64(val) if is_array(val) else val for key, val in params.items()})
    host = to_bhnd(host, layout, ("q", "k", "v", "do"))
    theirs = to_bhnd({name: host64(g) for name, g in grads.items()}, layout, ("q", "k", "v"))
    args = {key: host.pop(key) for key in ("q", "k", "v", "do")}
    unknown = sorted(set(theirs) - set(args) - set(host))
    if unknown:
        raise ValueError(f"grads has {', '.join(unknown)}, not arguments of this call")
    return args, host, theirs


def _vjp(rec, args: dict, options: dict, dtype: str, nudge=None) -> dict:
    """:func:`arrayattn.vjp` by the reference form in ``dtype`` (floating arrays perturbed by
    ``nudge`` first), as host float64 arrays."""
    from ..core.engine import use_engine
    from ..backward import vjp

    a, p = cast_floating(args, dtype, nudge), cast_floating(options, dtype, nudge)
    with use_engine("reference"):
        res = vjp(rec, a["q"], a["k"], a["v"], a["do"], **p)
    return {name: np.asarray(to_numpy(g), dtype=np.float64) for name, g in res.items()}


def _check_shapes(name: str, theirs: dict, ref: dict) -> None:
    missing = sorted(set(theirs) - set(ref))
    if missing:
        raise ValueError(f"{name} has no gradient for {', '.join(missing)} in this call")
    for key, g in theirs.items():
        if g.shape != ref[key].shape:
            raise ValueError(f"grads[{key!r}] has shape {g.shape} but d{key} has shape "
                             f"{ref[key].shape}")


def _baseline(rec, args: dict, options: dict, dtypes: set, rule: str) -> dict:
    """arrayattn's own gradients by the rule: ``same-dtype``, from the inputs rounded to the
    half dtype, in float32, each gradient rounded once; ``float64``, in the working
    precision from inputs perturbed by one unit roundoff."""
    if rule == "same-dtype":
        dt = sorted(dtypes & set(_HALF))[0] if dtypes & set(_HALF) else sorted(dtypes)[0]
        own = _vjp(rec, args, options, "float32", lambda x: round_to(x, dt))
        return {name: round_to(g, dt) for name, g in own.items()}
    work = "float64" if dtypes == {"float64"} else "float32"
    nudge = Nudge(work)
    return _vjp(rec, args, options, work, nudge)


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
            lines += [f"  d{name} " + item.head_line(i) for i in item.failing[:3]]
        raise AssertionError("\n".join(lines))
