"""Testing helpers for arrayattn and for people validating their own kernels.

``xp_assert_close`` follows SciPy's ``scipy._lib._array_api.xp_assert_close``: it checks
the namespace, dtype, shape and device of ``actual`` against ``desired``, not only the
values.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ._xp import to_numpy, xp_device, xp_namespace

__all__ = ["xp_assert_close", "xp_assert_equal", "xp_assert_kind", "default_tolerance",
           "check_tolerance",
           "compare_to_reference", "assert_matches_reference", "Comparison", "Profile",
           "PROFILES", "get_profile", "LAYOUTS", "Prepared", "compare_grads",
           "assert_grads_match"]


def __getattr__(name):
    """The gradient referee (:mod:`arrayattn.grad_testing`), loaded on first use."""
    if name in ("compare_grads", "assert_grads_match"):
        from . import grad_testing
        return getattr(grad_testing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_tolerance(dtype, *, xp=None, factor: float = 1.0) -> float:
    """A relative tolerance for results computed in ``dtype``.

    ``sqrt(eps)``-free and explicit: ``factor * 64 * eps`` -- 64 ulps covers the
    rounding of a softmax-normalised sum of products of moderate length (the exp, the
    division and a length-``d`` dot product each contribute a few ulps).  Pass a larger
    ``factor`` only with a reason (large logits, long reductions).
    """
    if xp is None:
        eps = float(np.finfo(np.dtype(str(dtype).split(".")[-1])).eps)
    else:
        eps = float(xp.finfo(dtype).eps)
    return factor * 64.0 * eps


def check_tolerance(name: str, value, *, optional: bool = True):
    """``value`` of the tolerance argument ``name`` (``rtol``, ``atol``) as a float: a
    finite real number >= 0 (``None`` kept when ``optional``).  An infinite or NaN
    tolerance would pass any output, NaN included, so it is refused."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number >= 0; got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0; got {value}")
    return value


def _check_meta(actual, desired, *, check_namespace, check_dtype, check_shape,
                check_device):
    if check_namespace:
        xa = xp_namespace(actual)
        xd = xp_namespace(desired)
        assert xa == xd, f"namespace {xa.__name__} != expected {xd.__name__}"
    if check_dtype:
        assert actual.dtype == desired.dtype, f"dtype {actual.dtype} != expected {desired.dtype}"
    if check_shape:
        assert tuple(actual.shape) == tuple(desired.shape), (
            f"shape {tuple(actual.shape)} != expected {tuple(desired.shape)}")
    if check_device:
        da, dd = xp_device(actual), xp_device(desired)
        if da is not None and dd is not None:
            assert da == dd, f"device {da} != expected {dd}"


def xp_assert_close(actual, desired, *, rtol=None, atol=0.0, check_namespace=True,
                    check_dtype=True, check_shape=True, check_device=True, err_msg=""):
    """Assert ``actual`` is close to ``desired`` and of the same kind of array.

    ``rtol=None`` uses :func:`default_tolerance` of ``desired``'s dtype.  Values are
    compared on the host in float64 as ``|a - d| <= atol + rtol |d|``; the message gives
    the worst index and both values.
    """
    rtol, atol = check_tolerance("rtol", rtol), check_tolerance("atol", atol, optional=False)
    _check_meta(actual, desired, check_namespace=check_namespace, check_dtype=check_dtype,
                check_shape=check_shape, check_device=check_device)
    a = to_numpy(actual).astype(np.float64)
    d = to_numpy(desired).astype(np.float64)
    if rtol is None:
        rtol = default_tolerance(xp_namespace(desired).asarray(0, dtype=desired.dtype).dtype,
                                 xp=xp_namespace(desired))
    a, d = np.broadcast_arrays(a, d)
    err = np.abs(a - d)
    bound = atol + rtol * np.abs(d)
    bad = ~(err <= bound)  # NaN counts as bad
    if bad.any():
        excess = np.where(np.isnan(err), np.inf, err - bound)
        idx = np.unravel_index(int(np.argmax(excess)), err.shape)
        raise AssertionError(
            f"{int(bad.sum())} of {err.size} values differ (rtol={rtol:.3g}, atol={atol:.3g}); "
            f"worst at {tuple(int(i) for i in idx)}: actual {a[idx]!r}, desired {d[idx]!r}, "
            f"max abs error {np.nanmax(err) if np.isfinite(err).any() else math.nan:.3g}"
            + (f"\n{err_msg}" if err_msg else "")
        )


def xp_assert_kind(actual, desired):
    """Assert ``actual`` has the namespace, dtype, shape and device of ``desired``."""
    _check_meta(actual, desired, check_namespace=True, check_dtype=True, check_shape=True,
                check_device=True)


def xp_assert_equal(actual, desired, **kwargs):
    """Bit-for-bit equality with the same metadata checks as :func:`xp_assert_close`."""
    xp_assert_close(actual, desired, rtol=0.0, atol=0.0, **kwargs)


# ---------------------------------------------------------------------------------------
# Validating another implementation against the registry's reference
# ---------------------------------------------------------------------------------------

#: Machine epsilon of the floating dtypes an external output may have.
_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23,
        "float64": 2.0 ** -52}

#: Safety factor between arrayattn's own rounding error and the tolerance (see
#: :func:`compare_to_reference`).
TOLERANCE_FACTOR = 8.0


def _dtype_name(x) -> str:
    return str(x.dtype).split(".")[-1]


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (str, bytes))


def _host64(x) -> np.ndarray:
    """A host copy of ``x``: floating arrays as float64, others (masks, indices) as they are."""
    h = np.asarray(to_numpy(x))
    return h.astype(np.float64) if h.dtype.kind == "f" else h


def _heads(a: np.ndarray) -> np.ndarray:
    """``(..., n, dv)`` -> ``(heads, n, dv)``; a 2-D array is one head."""
    return a.reshape((-1, *a.shape[-2:]))


class Comparison:
    """Per-head result of :func:`compare_to_reference` (host NumPy arrays).

    Attributes
    ----------
    variant : str
        Registry name of the reference.
    dtype : str
        dtype of the output under test (sets the tolerance).
    heads : list of tuple
        Index of each head in the leading dimensions, e.g. ``(0, 3)``.
    max_abs, rel, tolerance : ndarray, shape ``(heads,)``
        Largest absolute error, the same relative to the head's largest reference entry,
        and the allowed absolute error.
    worst : list of tuple
        ``(query, column)`` of the largest error in each head.
    own_error : ndarray, shape ``(heads,)``
        Largest error of arrayattn's own evaluation in the output's precision.
    ref_scale : ndarray, shape ``(heads,)``
        The head's largest reference entry (``rel = max_abs / ref_scale``).
    profile : str or None
        The port profile the comparison used.
    notes : list of str
        Known deviations a profile could not reproduce, and other remarks.
    """

    def __init__(self, variant, dtype, heads, max_abs, rel, tolerance, worst, own_error,
                 notes=(), *, ref_scale=None, profile=None):
        self.variant, self.dtype, self.heads = variant, dtype, heads
        self.max_abs, self.rel, self.tolerance = max_abs, rel, tolerance
        self.worst, self.own_error, self.notes = worst, own_error, list(notes)
        self.ref_scale = (np.ones_like(max_abs) if ref_scale is None
                          else np.asarray(ref_scale, dtype=np.float64))
        self.profile = profile

    @property
    def own_rel(self) -> np.ndarray:
        """arrayattn's own error in the working precision relative to the head's largest
        reference entry: what a faithful implementation in that precision achieves on
        these inputs (the rounding baseline beside :attr:`rel`)."""
        return self.own_error / np.where(self.ref_scale > 0, self.ref_scale, 1.0)

    def precision(self) -> str:
        """The output's error against float64 beside the rounding baseline (worst heads).

        ``this output`` is the largest relative error of the output under test against
        the float64 reference; ``faithful float32`` (or float64) is arrayattn's own
        evaluation in the working precision on the same inputs, i.e. what a correct
        implementation in that precision achieves.  Their ratio says how many times
        rounding the output's error is -- whatever the tolerance.
        """
        work = "float64" if self.dtype == "float64" else "float32"
        r, b = float(np.max(self.rel, initial=0.0)), float(np.max(self.own_rel, initial=0.0))
        ratio = f"{r / b:.3g}x the baseline" if b > 0 else "baseline 0"
        return (f"error vs float64 (relative, worst head): this output {r:.3g}, a faithful "
                f"{work} evaluation {b:.3g} ({ratio})")

    @property
    def failing(self) -> list[int]:
        """Indices of the heads over tolerance, worst (largest error/tolerance) first."""
        with np.errstate(invalid="ignore"):
            ratio = np.where(self.tolerance > 0, self.max_abs / np.where(
                self.tolerance > 0, self.tolerance, 1.0), np.where(self.max_abs > 0, np.inf, 0.0))
        bad = [int(i) for i in np.flatnonzero(~self._within())]
        return sorted(bad, key=lambda i: -np.nan_to_num(ratio[i], nan=np.inf))

    def _within(self) -> np.ndarray:
        """Per head: within tolerance.  An infinite error (a NaN or inf in the output
        where the reference is finite, or the reverse) never is, whatever the tolerance."""
        return np.isfinite(self.max_abs) & (self.max_abs <= self.tolerance)

    @property
    def ok(self) -> bool:
        return not self.failing

    def _head_line(self, i: int) -> str:
        qi, ci = self.worst[i]
        if not np.isfinite(self.max_abs[i]):
            return (f"head {self.heads[i]}: non-finite error at query {qi}, column {ci} "
                    "(a NaN or inf in the output or the reference, not in both alike; never "
                    "within tolerance)")
        return (f"head {self.heads[i]}: max abs error {self.max_abs[i]:.3g} at query {qi}, "
                f"column {ci} (relative {self.rel[i]:.3g}, tolerance {self.tolerance[i]:.3g})")

    def verdict(self) -> str:
        """One line: MATCH or MISMATCH, with the worst head."""
        h = len(self.heads)
        if self.ok:
            i = int(np.argmax(self.max_abs / np.maximum(self.tolerance, 1e-300)))
            return (f"MATCH: {self.variant}, {h} head(s), {self.dtype} output; worst "
                    f"head (by error / tolerance) {self.heads[i]} max abs error {self.max_abs[i]:.3g} <= tolerance "
                    f"{self.tolerance[i]:.3g}{self._suffix()}")
        bad = self.failing
        i = bad[0]
        return (f"MISMATCH: {self.variant}, {len(bad)} of {h} head(s) over tolerance "
                f"({self.dtype} output); worst (by error / tolerance) "
                f"{self._head_line(i)}{self._suffix()}")

    def _suffix(self) -> str:
        prof = f"; profile {self.profile}" if self.profile else ""
        return f"; {self.precision()}{prof}"

    def table(self) -> str:
        """Per-head table: max abs error, relative error, arrayattn's own rounding error
        in the working precision (``own error``), tolerance, worst position, verdict."""
        head = ["head", "max abs error", "rel. error", "own error", "tolerance",
                "worst (query, col)", ""]
        rows = [[str(self.heads[i]), f"{self.max_abs[i]:.3e}", f"{self.rel[i]:.3e}",
                 f"{self.own_error[i]:.3e}", f"{self.tolerance[i]:.3e}",
                 str(tuple(self.worst[i])),
                 "ok" if self._within()[i] else "FAIL"]
                for i in range(len(self.heads))]
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(head, widths)).rstrip(),
                 "  ".join("-" * w for w in widths)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Comparison {self.verdict()}>"


# ---------------------------------------------------------------------------------------
# Layouts and port profiles
# ---------------------------------------------------------------------------------------

#: Axis orders of ``q``, ``k``, ``v`` and ``out`` that :func:`compare_to_reference` reads:
#: ``"bhnd"`` ``(..., heads, tokens, dim)`` (arrayattn, torch SDPA, performer-pytorch,
#: nystrom-attention) and ``"bnhd"`` ``(batch, tokens, heads, dim)`` (fla, flash-attn,
#: fast-transformers, HF before its head split).
LAYOUTS = ("bhnd", "bnhd")


def _to_bhnd(arrays: dict, layout: str) -> dict:
    """Host arrays in ``layout`` -> ``"bhnd"``.  In ``"bnhd"`` the tokens axis is -3:
    ``q``, ``k``, ``v``, ``out`` swap axes -3 and -2; a ``key_mask (batch, s)`` gains a
    heads axis, ``(batch, 1, s)``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if layout == "bhnd":
        return arrays
    res = dict(arrays)
    for name in ("q", "k", "v", "out"):
        a = res[name]
        if a.ndim < 3:
            raise ValueError(f"layout 'bnhd' needs {name} of shape (..., tokens, heads, dim); "
                             f"got {name} of shape {a.shape}")
        res[name] = np.swapaxes(a, -3, -2)
    km = res.get("key_mask")
    if _is_array(km) and km.ndim >= 1:
        res["key_mask"] = np.expand_dims(km, -2)
    return res


def _identity(x):
    """The identity feature map: the port's inputs already are the features."""
    return x


def _relu_plus(epsilon: float):
    """performer-pytorch's generalized kernel ``relu(t) + kernel_epsilon`` as a callable
    ``kind`` of :func:`arrayattn.performer_attention` (array API)."""
    def relu_plus(t):
        xp = xp_namespace(t)
        return xp.maximum(t, 0.0) + epsilon
    relu_plus.__name__ = f"relu_plus_{epsilon:g}"
    return relu_plus


def _accepts(variant: str, option: str) -> bool:
    """Whether the registry variant's function takes ``option`` (an option the lead may add)."""
    import inspect

    from .registry import get_variant
    return option in inspect.signature(get_variant(variant).fn).parameters


def _take(params: dict, profile: str, allowed: dict) -> dict:
    """The port-native options of ``profile`` with their defaults; unknown keys are errors."""
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"profile {profile!r} takes the port's options "
                         f"{sorted(allowed)}; got unknown option(s) {unknown}")
    return {key: params.get(key, default) for key, default in allowed.items()}


class Prepared:
    """What a profile makes of a port's problem: the registry ``variant``, the inputs
    and ``options`` in arrayattn's conventions, the query ``rows`` of the reference that
    correspond to the port's output (``None``: all) and ``notes`` on known deviations."""

    def __init__(self, variant, q, k, v, options, rows=None, notes=()):
        self.variant, self.q, self.k, self.v = variant, q, k, v
        self.options, self.rows, self.notes = options, rows, list(notes)


def _prep_sdpa(q, k, v, params):
    """``torch.nn.functional.scaled_dot_product_attention``."""
    o = _take(params, "sdpa", {"attn_mask": None, "is_causal": False, "scale": None,
                               "enable_gqa": False, "dropout_p": 0.0})
    if o["dropout_p"]:
        raise ValueError("dropout_p must be 0 to validate SDPA (dropout is random)")
    if o["enable_gqa"]:
        if q.ndim < 3 or k.ndim < 3 or q.shape[-3] % k.shape[-3]:
            raise ValueError(f"enable_gqa needs q heads a multiple of k heads; got q "
                             f"{q.shape}, k {k.shape}")
        # SDPA's GQA repeats each key/value head over hq // hk consecutive query heads
        group = q.shape[-3] // k.shape[-3]
        k, v = (np.repeat(x, group, axis=-3) for x in (k, v))
    n, s = q.shape[-2], k.shape[-2]
    opts = {}
    if o["is_causal"] and o["attn_mask"] is not None:
        raise ValueError("SDPA refuses attn_mask together with is_causal=True")
    if o["is_causal"]:
        # SDPA aligns is_causal top-left: query i sees keys j <= i (arrayattn's causal
        # is end-aligned, j <= i + s - n).  An explicit mask reproduces SDPA's.
        opts["mask"] = np.tril(np.ones((n, s), dtype=bool))
    elif o["attn_mask"] is not None:
        m = np.asarray(o["attn_mask"])
        if m.dtype == bool:
            opts["mask"] = m
        else:   # a float attn_mask is an additive logit bias (-inf entries: masked)
            opts["bias"] = m
    if o["scale"] is not None:
        opts["scale"] = float(o["scale"])
    return Prepared("softmax", q, k, v, opts)


def _prep_performer_pytorch(q, k, v, params):
    """performer-pytorch ``FastAttention`` (``softmax_kernel`` / ``generalized_kernel``)."""
    o = _take(params, "performer_pytorch", {
        "projection_matrix": None, "causal": False, "generalized_attention": False,
        "kernel_epsilon": 1e-3, "eps": 1e-4, "causal_eps": 1e-6})
    if o["projection_matrix"] is None:
        raise ValueError("profile 'performer_pytorch' needs projection_matrix= (the "
                         "module's buffer FastAttention.projection_matrix, shape (m, d))")
    causal = bool(o["causal"])
    opts = {"omega": o["projection_matrix"], "causal": causal}
    notes = []
    if o["generalized_attention"]:
        variant = "performer_relu"
        opts["kind"] = _relu_plus(float(o["kernel_epsilon"]))
    else:
        variant = "performer_positive"
        if o["eps"]:
            if _accepts(variant, "feature_eps"):
                opts["feature_eps"] = float(o["eps"])
            else:
                notes.append(
                    f"performer-pytorch's softmax_kernel adds eps={o['eps']:g} to every "
                    "feature after its max shift (performer_pytorch.py:108-113); "
                    "performer_attention has no such option yet (docs/port-options.md 'feature_eps'): "
                    "a mismatch is expected. With eps=0 in the port it matches.")
    if causal and o["causal_eps"]:
        if _accepts(variant, "key_sum_eps"):
            # in arrayattn's units: the generalized features carry m^-1/2, the port's not
            m = np.shape(o["projection_matrix"])[0]
            opts["key_sum_eps"] = float(o["causal_eps"]) / (
                math.sqrt(m) if o["generalized_attention"] else 1.0)
        else:
            notes.append(
                f"performer-pytorch's causal path adds eps={o['causal_eps']:g} to every "
                "component of the key-feature prefix sums (performer_pytorch.py:188, "
                "208-210); no such option yet (docs/port-options.md 'key_sum_eps').")
    return Prepared(variant, q, k, v, opts, notes=notes)


def _conv_taps(weight):
    """A port's depthwise ``Conv2d(heads, heads, (K, 1), groups=heads)`` weight
    ``(heads, 1, K, 1)`` (or ``(heads, K)``) -> ``conv_kernel (heads, K)``."""
    w = np.asarray(weight)
    if w.ndim == 4:
        w = w[:, 0, :, 0]
    if w.ndim != 2:
        raise ValueError(f"conv weight must have shape (heads, 1, K, 1) or (heads, K); "
                         f"got {np.shape(weight)}")
    return w


def _prep_lucidrains_nystrom(q, k, v, params):
    """lucidrains ``nystrom-attention`` ``NystromAttention`` (the attention core)."""
    o = _take(params, "lucidrains_nystrom", {"num_landmarks": None, "pinv_iterations": 6,
                                             "res_conv_weight": None})
    m = o["num_landmarks"]
    if m is None:
        raise ValueError("profile 'lucidrains_nystrom' needs num_landmarks=")
    n = q.shape[-2]
    rows = None
    if n % m:
        # The port pads the sequence at the front with zero tokens (q = k = v = 0, no
        # bias in to_qkv) up to a multiple of m and returns the last n rows: the zero
        # keys stay in every softmax and in the landmark means.  Reproduced exactly.
        pad = m - n % m
        q, k, v = (np.concatenate([np.zeros((*x.shape[:-2], pad, x.shape[-1]), x.dtype), x],
                                  axis=-2) for x in (q, k, v))
        rows = slice(pad, None)
    opts = {"num_landmarks": int(m), "pinv_iters": int(o["pinv_iterations"]),
            "pinv_init": "global"}  # torch.max over the whole batch and all heads
    if o["res_conv_weight"] is not None:
        opts["conv_kernel"] = _conv_taps(o["res_conv_weight"])
    return Prepared("nystrom_iterative", q, k, v, opts, rows=rows)


def _prep_hf_nystromformer(q, k, v, params):
    """HF ``transformers`` ``NystromformerSelfAttention``."""
    o = _take(params, "hf_nystromformer", {"num_landmarks": 64, "segment_means_seq_len": None,
                                           "conv_weight": None})
    m, n = int(o["num_landmarks"]), q.shape[-2]
    seq = n if o["segment_means_seq_len"] is None else int(o["segment_means_seq_len"])
    if seq != n or n % m:
        raise ValueError(f"HF Nystromformer reshapes the sequence into num_landmarks={m} "
                         f"segments of segment_means_seq_len // num_landmarks tokens: it needs "
                         f"n == segment_means_seq_len, a multiple of num_landmarks; got n={n}, "
                         f"segment_means_seq_len={seq}")
    opts = {"num_landmarks": m}
    if o["conv_weight"] is not None:
        opts["conv_kernel"] = _conv_taps(o["conv_weight"])
    if m == n:  # HF computes exact softmax attention here (plus the conv)
        if "conv_kernel" not in opts:
            return Prepared("softmax", q, k, v, {})
        # softmax has no conv skip: Nystrom with every token a landmark and the SVD
        # pinv is softmax attention, with a tolerance from its (larger) float32 error
        opts.update(pinv="svd")
        return Prepared("nystrom_svd", q, k, v, opts)
    # HF's "original" Z0 = A^T / max colsum over the whole batch and all heads; the rows
    # of a softmax sum to 1, so that is the global ||A||_1 ||A||_inf init to rounding.
    opts.update(pinv_iters=6, pinv_init="global")
    return Prepared("nystrom_iterative", q, k, v, opts)


def _prep_fast_transformers(q, k, v, params):
    """fast-transformers ``LinearAttention`` / ``CausalLinearAttention`` (elu+1)."""
    o = _take(params, "fast_transformers", {"causal": False, "eps": 1e-6})
    opts = {"causal": bool(o["causal"])}
    notes = []
    if o["eps"]:
        if _accepts("linear_elu", "denominator_eps"):
            opts["denominator_eps"] = float(o["eps"])
        else:
            notes.append(f"fast-transformers adds eps={o['eps']:g} to the denominator "
                         "(linear_attention.py:75, causal_linear_attention.py:95); not "
                         "reproduced (docs/port-options.md 'denominator_eps'); its relative effect is "
                         "eps / denominator")
    return Prepared("linear_elu", q, k, v, opts, notes=notes)


def _prep_fla(q, k, v, params):
    """fla ``chunk_linear_attn`` / ``fused_chunk_linear_attn`` / ``naive_*_linear_attn``."""
    o = _take(params, "fla", {"normalize": True, "scale": None, "eps": 1e-10})
    scale = q.shape[-1] ** -0.5 if o["scale"] is None else float(o["scale"])
    if not o["normalize"] and _accepts("linear_elu", "normalize"):
        # o_i = sum_{j<=i} (scale q_i . k_j) v_j: the scale moves onto q
        return Prepared("linear_elu", q * scale, k, v,
                        {"feature_map": _identity, "causal": True, "normalize": False})
    if not o["normalize"]:
        raise ValueError("fla with normalize=False is unnormalised causal linear attention "
                         "(o_i = sum_{j<=i} scale (q_i.k_j) v_j); linear_attention has no "
                         "normalize option yet (docs/port-options.md 'normalize')")
    # fla's ops take the features: q, k are phi(q), phi(k) already (identity map); with
    # normalize=True the scale cancels between numerator and denominator.
    opts = {"feature_map": _identity, "causal": True}
    notes = []
    if o["eps"]:
        if _accepts("linear_elu", "denominator_eps"):
            opts["denominator_eps"] = float(o["eps"]) / scale  # fla's den is scaled
        else:
            notes.append(f"fla adds {o['eps']:g} to the scaled denominator "
                         "(ops/linear_attn/utils.py:29, naive.py:39); not reproduced")
    return Prepared("linear_elu", q, k, v, opts, notes=notes)


class Profile:
    """A port's conventions mapped onto an arrayattn variant (see ``docs/validating.rst``).

    Attributes
    ----------
    name : str
        The ``profile=`` name.
    port : str
        The implementation it describes (package and function or module).
    layout : str
        The port's axis order (one of :data:`LAYOUTS`).
    options : str
        The port-native options the profile takes (``**params``).
    deviations : str
        Where the port departs from the maths, and whether the profile reproduces it.
    """

    def __init__(self, name, port, layout, options, deviations, prepare):
        self.name, self.port, self.layout = name, port, layout
        self.options, self.deviations, self.prepare = options, deviations, prepare

    def __repr__(self) -> str:
        return f"<Profile {self.name}: {self.port}, layout {self.layout}>"


#: The named port profiles of :func:`compare_to_reference` (``profile=``).
PROFILES = {p.name: p for p in (
    Profile("sdpa", "torch.nn.functional.scaled_dot_product_attention", "bhnd",
            "attn_mask (bool, or float 0/-inf), is_causal, scale, enable_gqa, dropout_p=0",
            "is_causal is top-left aligned (query i sees keys j <= i), reproduced by an "
            "explicit mask; GQA repeats each key/value head over consecutive query heads, "
            "reproduced; a float attn_mask other than 0/-inf is an additive bias, not "
            "reproducible yet.", _prep_sdpa),
    Profile("performer_pytorch", "performer-pytorch FastAttention", "bhnd",
            "projection_matrix (required), causal, generalized_attention, kernel_epsilon, "
            "eps (softmax_kernel, default 1e-4), causal_eps (default 1e-6)",
            "softmax_kernel adds eps = 1e-4 to the features after the max shift and the key "
            "shift is one max over all keys; the causal path adds 1e-6 to the key prefix "
            "sums: neither is reproduced yet (docs/port-options.md 'feature_eps', 'key_sum_eps'). The "
            "generalized kernel "
            "relu(w.x) + kernel_epsilon is reproduced exactly (a callable kind).",
            _prep_performer_pytorch),
    Profile("lucidrains_nystrom", "nystrom-attention NystromAttention (attention core)",
            "bhnd", "num_landmarks (required), pinv_iterations, res_conv_weight",
            "front zero padding to a multiple of num_landmarks (reproduced: padded inputs, "
            "last n rows), pinv init as one max over batch and heads (pinv_init='global'), "
            "residual depthwise convolution of v (conv_kernel).", _prep_lucidrains_nystrom),
    Profile("hf_nystromformer", "transformers NystromformerSelfAttention", "bnhd",
            "num_landmarks, segment_means_seq_len, conv_weight",
            "pinv init Z0 = A^T / max colsum over batch and heads (pinv_init='global'); "
            "q and k each scaled by d^-1/4 (same logits); conv skip (conv_kernel); "
            "num_landmarks == seq_len is exact softmax (nystrom_svd with m = n). The "
            "additive attention_mask reaches only the third softmax (padding stays in "
            "the landmark means): not reproduced.", _prep_hf_nystromformer),
    Profile("fast_transformers", "pytorch-fast-transformers LinearAttention / "
            "CausalLinearAttention", "bnhd", "causal, eps (default 1e-6)",
            "elu+1 features; eps = 1e-6 added to the denominator (not reproduced; "
            "relative effect eps / denominator).", _prep_fast_transformers),
    Profile("fla", "flash-linear-attention chunk_linear_attn, fused_chunk_linear_attn, "
            "naive_recurrent_linear_attn, naive_chunk_linear_attn", "bnhd",
            "normalize (True only), scale, eps (default 1e-10)",
            "the ops take features (q, k after the feature map) and are causal; scale "
            "cancels when normalize=True; 1e-10 added to the denominator (not reproduced).",
            _prep_fla),
)}


def get_profile(profile) -> Profile:
    """A :class:`Profile` from its name (or the profile itself)."""
    if isinstance(profile, Profile):
        return profile
    try:
        return PROFILES[profile]
    except (KeyError, TypeError):
        raise ValueError(f"profile must be one of {sorted(PROFILES)}; got {profile!r}") from None


def compare_to_reference(out, variant, q, k, v, /, *, rtol=None, atol=0.0, layout=None,
                         profile=None, **params) -> Comparison:
    r"""Compare another implementation's ``out`` with arrayattn's float64 reference.

    The reference is the variant's reference form (:meth:`Variant.reference`, never an
    engine), ``variant(q, k, v, **params)`` evaluated by the registry record in
    float64 on the host, from the caller's own inputs (and the caller's own random
    matrices, passed as array ``params``; floating arrays are converted to float64,
    boolean masks are kept).

    Parameters
    ----------
    out : array, shape ``(..., n, dv)``
        The output under test, any supported array library.  Its dtype sets the
        tolerance.
    variant : str, Variant or None
        Registry name (see :func:`arrayattn.variants`); ``None`` with a ``profile``
        takes the profile's variant.
    q, k, v : array
        The inputs ``out`` was computed from.
    rtol : float, optional
        Override: allowed max-abs error of a head relative to the head's largest
        reference entry.  ``None`` derives the tolerance as below.  A finite number
        >= 0 (an infinite tolerance would pass a NaN output: refused).
    atol : float
        An absolute allowance added to each head's tolerance (default 0; finite, >= 0).
    layout : {"bhnd", "bnhd"}, optional
        Axis order of ``q``, ``k``, ``v`` and ``out``: ``"bhnd"`` (``(..., heads,
        tokens, dim)``, the default without a profile) or ``"bnhd"`` (``(batch, tokens,
        heads, dim)``, fla, flash-attn, fast-transformers; a ``key_mask`` is then
        ``(batch, s)``).  ``None``: the profile's layout, else ``"bhnd"``.  Heads are
        reported as ``(batch, head)`` in either layout.
    profile : str or Profile, optional
        A port's conventions (:data:`PROFILES`: ``"sdpa"``, ``"performer_pytorch"``,
        ``"lucidrains_nystrom"``, ``"hf_nystromformer"``, ``"fast_transformers"``,
        ``"fla"``).  ``**params`` are then the *port's* options (``is_causal=``,
        ``projection_matrix=``, ``res_conv_weight=`` ...), mapped onto the variant's:
        top-left causal masks, the port's scale, front padding, pinv init, conv skip.
        Deviations a profile cannot reproduce yet are listed in ``Comparison.notes``.
    **params
        Options of the variant (``causal=True``, ``num_features=64``, ``omega=...``), or
        of the port with a ``profile``.

    Returns
    -------
    Comparison
        Per-head errors, tolerances and worst positions; ``.ok``, ``.verdict()``,
        ``.table()``; ``.rel`` (this output against float64) beside ``.own_rel`` (the
        float32 -- or float64 -- rounding baseline: what a faithful implementation
        achieves on these inputs), stated in the verdict by ``.precision()``.

    Notes
    -----
    **Tolerance.**  A head is the trailing ``(n, dv)`` block of ``out``; all leading
    dimensions index heads.  For head ``h`` with reference ``R_h`` the allowed
    max-abs error is

    .. math::

       \tau_h = F \cdot \max\bigl(e_h,\; \epsilon_{out} \|R_h\|_\infty\bigr),
       \qquad F = 8,

    where

    * :math:`e_h` is the max-abs error of *arrayattn's own* evaluation of the same
      variant in the working precision (float64 for a float64 output, float32
      otherwise: float16 and bfloat16 are computed in float32, as every arrayattn
      variant and every fused kernel does), on the inputs with a random relative
      perturbation of one unit roundoff of that precision.  It measures the rounding
      error that this variant incurs on *these* inputs: large logits, long sequences
      or an ill-conditioned pseudo-inverse all show up in it.  This is the criterion
      of FlashAttention's own test suite (error at most a small multiple of a plain
      implementation's error in the same precision);
    * the floor :math:`\epsilon_{out}\|R_h\|_\infty` (machine epsilon of the output dtype
      times the head's largest entry) is the rounding of the result itself: it is what
      counts for float16 and bfloat16 outputs, whose arithmetic is float32;
    * :math:`F = 8` allows a correct implementation to sum in another order (blocked
      or online softmax, fused kernels, another BLAS), whose rounding error is of
      the same order but not the same value (measured: torch's
      ``scaled_dot_product_attention``, blockwise softmax and a plain float32 port stay
      within 1.4 e_h at n = 256 ... 2048, d = 64, diffuse and sharp attention).

    For random-feature and random-pattern variants pass the matrix the other
    implementation used (e.g. ``omega=``, ``e=``, ``f=``): the reference then uses the
    same matrix, the comparison is deterministic and the same rounding-level tolerance
    applies.  Without it the reference draws its own from ``seed`` and only matches an
    implementation that drew the identical matrix.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import softmax_attention
    >>> from arrayattn.testing import compare_to_reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 3, 16, 8), dtype=np.float32) for _ in range(3))
    >>> out = softmax_attention(q, k, v, causal=True, block_size=4)  # "their" kernel
    >>> c = compare_to_reference(out, "softmax", q, k, v, causal=True)
    >>> c.ok, len(c.heads), c.heads[4]
    (True, 6, (1, 1))
    >>> bad = out.copy(); bad[1, 2] += 1e-3
    >>> compare_to_reference(bad, "softmax", q, k, v, causal=True).verdict()[:60]
    'MISMATCH: softmax, 1 of 6 head(s) over tolerance (float32 ou'
    """
    from .registry import get_variant

    rtol, atol = check_tolerance("rtol", rtol), check_tolerance("atol", atol, optional=False)
    dtype = _dtype_name(out)
    if dtype not in _EPS:
        raise TypeError(f"out must have a floating dtype ({', '.join(_EPS)}); got {dtype}")
    prof = None if profile is None else get_profile(profile)
    layout = (prof.layout if prof is not None else "bhnd") if layout is None else layout
    host = {"q": _host64(q), "k": _host64(k), "v": _host64(v), "out": _host64(out)}
    host.update({key: _host64(val) if _is_array(val) else val for key, val in params.items()})
    host = _to_bhnd(host, layout)
    out64, q64, k64, v64 = (host.pop(name) for name in ("out", "q", "k", "v"))
    p64, rows, notes = host, None, []
    if prof is not None:
        prep = prof.prepare(q64, k64, v64, p64)
        if variant is not None and get_variant(variant).name != prep.variant:
            raise ValueError(f"profile {prof.name!r} validates {prep.variant!r} for these "
                             f"options; got variant {get_variant(variant).name!r}")
        variant, q64, k64, v64 = prep.variant, prep.q, prep.k, prep.v
        p64, rows, notes = prep.options, prep.rows, list(prep.notes)
    elif variant is None:
        raise ValueError("variant is required unless a profile names it")
    rec = get_variant(variant)

    def evaluate(*args, **options):
        res = np.asarray(to_numpy(rec.reference(*args, **options)), dtype=np.float64)
        return res if rows is None else res[..., rows, :]

    ref = evaluate(q64, k64, v64, **p64)
    if out64.shape != ref.shape:
        raise ValueError(
            f"out has shape {out64.shape} but {rec.name} gives {ref.shape} for q "
            f"{q64.shape}, k {k64.shape}, v {v64.shape}" + (
                f" (layout {layout!r}; shapes shown as (..., heads, tokens, dim))"
                if layout != "bhnd" else ""))
    if out64.ndim < 2:
        raise ValueError(f"out must have at least 2 dimensions (..., n, dv); got {out64.shape}")
    lead = out64.shape[:-2]
    heads = [tuple(int(i) for i in idx) for idx in np.ndindex(*lead)] or [()]
    o, r = _heads(out64), _heads(ref)
    err = np.abs(o - r)
    err = np.where(np.isnan(err), np.inf, err)
    flat = err.reshape(len(heads), -1)
    max_abs = flat.max(axis=1, initial=0.0)
    arg = flat.argmax(axis=1) if flat.shape[1] else np.zeros(len(heads), int)
    worst = [tuple(int(t) for t in np.unravel_index(int(a), err.shape[1:])) for a in arg]
    scale = np.abs(r).reshape(len(heads), -1).max(axis=1, initial=0.0)
    rel = max_abs / np.where(scale > 0, scale, 1.0)

    # arrayattn's own evaluation in the output's precision, inputs perturbed by one
    # unit roundoff (fixed seed: the tolerance is reproducible).
    work = "float64" if dtype == "float64" else "float32"
    u = _EPS[work] / 2
    prng = np.random.default_rng(0)

    def nudge(x):
        return (x * (1.0 + u * prng.choice([-1.0, 1.0], size=x.shape))).astype(work)

    pw = {key: val.astype(work) if _is_array(val) and val.dtype.kind == "f" else val
          for key, val in p64.items()}
    own = evaluate(nudge(q64), nudge(k64), nudge(v64), **pw)
    own_err = np.abs(_heads(own) - r).reshape(len(heads), -1).max(axis=1, initial=0.0)
    if not np.all(np.isfinite(own_err)):
        notes.append(f"arrayattn's own {work} evaluation is not finite on these inputs; "
                     "the tolerance uses the rounding floor only")
        own_err = np.where(np.isfinite(own_err), own_err, 0.0)
    low = sorted({_dtype_name(x) for x in (q, k, v)} & {"float32", "float16", "bfloat16"})
    if dtype == "float64" and low:
        notes.append(f"out is float64 but the inputs are {'/'.join(low)}: the tolerance is "
                     "a float64 computation's; if the kernel computed in float32 and cast its "
                     "result up, pass out in the dtype it computed in")
    floor = scale * _EPS[dtype]
    if rtol is None:
        tol = TOLERANCE_FACTOR * np.maximum(own_err, floor) + atol
    else:
        tol = rtol * scale + atol
    return Comparison(rec.name, dtype, heads, max_abs, rel, tol, worst, own_err, notes,
                      ref_scale=scale, profile=None if prof is None else prof.name)


def assert_matches_reference(out, variant, q, k, v, /, *, rtol=None, atol=0.0, layout=None,
                             profile=None, **params) -> None:
    """Assert that ``out`` equals arrayattn's float64 reference to rounding, per head.

    Runs :func:`compare_to_reference` (see there for the tolerance derivation) and
    raises ``AssertionError`` naming the worst heads, their largest errors and the
    positions ``(query, column)`` where they occur.

    Parameters
    ----------
    out : array, shape ``(..., n, dv)``
        The output under test.
    variant : str, Variant or None
        Registry name of the reference (``None`` with a ``profile``: the profile's).
    q, k, v : array
        The inputs ``out`` was computed from.
    rtol : float, optional
        Override of the derived tolerance (max-abs error relative to the head's largest
        reference entry); finite, >= 0.
    atol : float
        Absolute allowance added to each head's tolerance (default 0); finite, >= 0.
    layout : {"bhnd", "bnhd"}, optional
        Axis order of ``q``, ``k``, ``v``, ``out`` (see :func:`compare_to_reference`).
    profile : str, optional
        A port's conventions (see :data:`PROFILES`); ``**params`` are then the port's
        own options.
    **params
        Options of the variant, including the random matrices the other implementation
        used (``omega=``, ``e=``, ``f=`` ...).

    Raises
    ------
    AssertionError
        When a head's max-abs error exceeds its tolerance, or the output holds a NaN or
        inf where the reference is finite (whatever the tolerance).
    ValueError, TypeError
        A negative, infinite or NaN ``rtol`` / ``atol`` (or one that is not a number).

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn.testing import assert_matches_reference
    >>> rng = np.random.default_rng(1)
    >>> q, k, v = (rng.standard_normal((4, 32, 16)) for _ in range(3))
    >>> w = np.exp(q @ k.swapaxes(-1, -2) / 4.0)
    >>> mine = (w / w.sum(-1, keepdims=True)) @ v         # a plain float64 port
    >>> assert_matches_reference(mine, "softmax", q, k, v)  # passes silently
    >>> mine[2, 7, 3] += 1e-6
    >>> assert_matches_reference(mine, "softmax", q, k, v)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    AssertionError: MISMATCH: softmax, 1 of 4 head(s) over tolerance (float64 output); worst (by error / tolerance) head (2,): max abs error 1e-06 at query 7, column 3 ...
    """
    c = compare_to_reference(out, variant, q, k, v, rtol=rtol, atol=atol, layout=layout,
                             profile=profile, **params)
    if not c.ok:
        lines = [c.verdict()]
        lines += ["  " + c._head_line(i) for i in c.failing[:5]]
        if len(c.failing) > 5:
            lines.append(f"  ... and {len(c.failing) - 5} more head(s)")
        lines += ["  " + c.precision()]
        lines += ["  note: " + note for note in c.notes]
        raise AssertionError("\n".join(lines))
