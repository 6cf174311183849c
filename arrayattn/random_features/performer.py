r"""Performer attention (FAVOR+): softmax attention through random features, in O(n m d).

Choromanski et al. 2020, "Rethinking Attention with Performers" (ICLR 2021).

.. math::

    \widehat{\mathrm{Attn}}(Q, K, V)_i =
        \frac{\sum_j \phi(q_i)\cdot\phi(k_j)\, v_j}{\sum_j \phi(q_i)\cdot\phi(k_j)},
    \qquad \phi(q)\cdot\phi(k) \approx \exp(\mathrm{scale}\; q\cdot k),

computed as ``φ(Q) (φ(K)^T V)`` (never the n x s matrix).  The feature maps are in
:mod:`arrayattn.random_features.kinds`, the projection in :mod:`arrayattn.random_features.projection`.

Stabilisation (exact, and causal-safe bit for bit)
--------------------------------------------------
Every factor that is removed from the features cancels in the ratio; nothing is added
(no ``eps``: an ``eps`` floors small kernels and biases the estimate).

* Non-causal: each query row is divided by its own largest feature (a per-row factor,
  cancels); every key feature by ``exp(L)``, ``L`` the largest key exponent over the
  *unmasked* keys and all features of the sequence (one global factor, cancels; taken as
  per-block maxima whose states are merged, as the online softmax merges blocks).  For
  trig features the key factor ``exp(‖k̃‖²/2)`` is divided by its maximum the same way.
* Causal: a shift may not depend on other keys.  For the exponential maps
  ``ω_f·k̃ - ‖k̃‖²/2 <= ‖ω_f‖²/2`` for every ``k̃``, so the key features
  ``exp(ω_f·k̃ - ‖k̃‖²/2 - ‖ω_f‖²/2) = exp(-‖k̃ - ω_f‖²/2)`` lie in ``(0, 1]`` and depend on
  that key alone; the factor ``exp(‖ω_f‖²/2)`` moves to the query side, whose own row
  maximum is then divided out.  (FAVOR++: the bound is ``A‖ω_f‖² + B²‖ω_f‖²/2``.)
"""
from __future__ import annotations

import math

from .. import reference
from .._numpy import kernel as numpy_kernel
from .._numpy import performer as numpy_performer
from .calls import PerformerCall, checked_performer
from .kinds import EXP_KINDS
from ..core.pipeline import Spec, Working, run
from .projection import RandomFeatures

__all__ = ["performer_attention", "checked_performer", "SPEC", "uniform_call"]


def performer_attention(q, k, v, /, *, features=None, num_features=None, kind="positive",
                        projection="orthogonal", norms="chi", seed=0, scale=None,
                        causal=False, key_mask=None, gerf_a=None):
    r"""Performer attention: softmax attention through random features (FAVOR+).

    .. math::

        O_i = \frac{\sum_j \phi(q_i)\cdot\phi(k_j)\, v_j}{\sum_j \phi(q_i)\cdot\phi(k_j)},
        \qquad \phi(x)_f = m^{-1/2}\exp(\omega_f\cdot\tilde x - \|\tilde x\|^2/2),
        \quad \tilde x = \sqrt{\mathrm{scale}}\, x

    (``kind="positive"``), so that ``E[φ(q)·φ(k)] = exp(scale q·k)``: unbiased kernel,
    hence (to first order in ``1/m``) softmax attention.  Computed as ``φ(Q)(φ(K)^T V)`` in
    ``O((n + s) m d)`` time and ``O((n + s) m)`` memory; causal via the chunked prefix-sum
    form of linear attention.  Choromanski et al. 2020, "Rethinking Attention with
    Performers".

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
    k : array, shape ``(..., s, d)``
    v : array, shape ``(..., s, dv)``
    features : RandomFeatures or array ``(m, d)``, optional
        The projection ``ω``; a caller's (or a peer's) matrix is replayed exactly.  When
        given, ``num_features``, ``projection``, ``norms`` and ``seed`` are ignored.  One
        projection is shared by every batch element and head.  The backward
        (:func:`arrayattn.vjp`) treats it, like a drawn one, as a constant: no cotangent.
    num_features : int, optional
        ``m``, the number of random rows when ``features`` is not given (``None``: 256;
        with ``projection="identity"`` ``m = d``, and another value is an error).
    kind : {"positive", "hyperbolic", "trig", "favor++", "relu"} or callable
        Feature map (see :func:`arrayattn.estimate_kernel`).  ``"hyperbolic"`` and
        ``"trig"`` use ``2m`` features.  ``"trig"`` features may be negative, so the
        denominator may be near zero or negative: never clamped here (that would bias).
        ``"favor++"``: GERF optimal positive features (Likhosherstov et al. 2022) with
        ``A = gerf_a`` or the optimal ``A*`` of these inputs (:func:`arrayattn.gerf_parameter`),
        much lower variance on large-norm inputs.  ``"relu"`` or a callable ``f``: the
        generalized kernels ``f(ω·x̃)`` of the Performer paper (section 2.4; not an
        estimate of softmax); with ``projection="identity"``, ``f(x̃)`` without projection.
    projection : {"orthogonal", "iid", "identity"}
        ``"identity"``: no random projection (``ω = I_d``).
    norms : {"chi", "fixed", "quasi"}
    seed : int
        See :meth:`RandomFeatures.draw`.  Same seed, same output on every backend.
    scale : float, optional
        ``None`` means ``1/sqrt(d)``.
    causal : bool
        End-aligned causal attention (query ``i`` sees keys ``j <= i + s - n``).
    key_mask : boolean array, shape ``(..., s)``, optional
        ``True`` marks a real key; masked keys leave numerator *and* denominator.
    gerf_a : float or array ``(..., 1, 1)``, optional
        The GERF parameter ``A < 1/8`` of ``kind="favor++"``.  ``None``: the optimal
        ``A*`` of ``q`` and the unmasked keys -- it depends on every key, so
        ``causal=True`` requires an explicit ``gerf_a``.

    Returns
    -------
    array, shape ``(..., n, dv)``
        In the namespace, dtype and device of ``q``; a query with no visible key returns
        zeros.  float16/bfloat16 are computed in float32.

    Notes
    -----
    Stabilisation cancels exactly (see the module docstring and the docs page): nothing
    is added to the features.  In causal mode the key features ``exp(-‖k̃ - ω_f‖²/2)``
    underflow (float32) when ``‖k̃ - ω_f‖ > ~13``, e.g. for ``d = 64`` only once ``‖k‖``
    exceeds ~30; keys whose every feature underflows get weight 0.  The causal ``"trig"``
    map keeps ``exp(‖k̃‖²/2)`` unshifted (finite for ``‖k̃‖² < 176`` in float32).

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import performer_attention, softmax_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 64, 16)) for _ in range(3))
    >>> q, k = q / 2, k / 2  # moderate logits: FAVOR+ variance grows like exp(‖q̃ + k̃‖²)
    >>> out = performer_attention(q, k, v, num_features=1024, seed=0)
    >>> out.shape
    (2, 64, 16)
    >>> err = np.abs(out - softmax_attention(q, k, v)).mean()
    >>> bool(err < 0.02)
    True
    >>> c = performer_attention(q, k, v, causal=True)
    >>> bool(np.allclose(c[:, 0], v[:, 0]))  # the first query sees only the first key
    True
    """
    return run(SPEC, q, k, v, features=features, num_features=num_features, kind=kind,
               projection=projection, norms=norms, seed=seed, scale=scale, causal=causal,
               key_mask=key_mask, gerf_a=gerf_a)


def _omega_and_a(call: PerformerCall, w: Working):
    """The projection on the inputs' device, and FAVOR++'s ``A``: the caller's, or the
    optimum ``A*`` of these inputs (masked and non-finite keys taken out)."""
    p = call.p
    omega = call.features.on(p.xp, dtype=p.work_dtype, device=p.device)
    if call.kind == "favor++" and call.gerf_a is None:
        return omega, reference.gerf_optimum(w.q, w.k, scale=call.scale,
                                             key_mask=call.key_mask)
    return omega, call.gerf_a


def _poisoned(call: PerformerCall, w: Working, out):
    """Causal: the rows that see a key holding a non-finite value become NaN."""
    if w.bad is None:
        return out
    return reference.poison_rows(out, reference.seen_by_prefix(w.bad, call.p.n))


def _reference(call: PerformerCall, w: Working):
    omega, gerf_a = _omega_and_a(call, w)
    out = reference.performer_attention(w.q, w.k, w.v, omega, kind=call.kind,
                                        scale=call.scale, causal=call.causal,
                                        key_mask=call.key_mask, gerf_a=gerf_a)
    return _poisoned(call, w, out)


def _engine(call: PerformerCall, w: Working):
    p, kind = call.p, call.kind
    omega, gerf_a = _omega_and_a(call, w)
    rows = reference.favor_rows(omega, kind=kind, scale=call.scale, gerf_a=gerf_a)
    query_features, key_features = numpy_performer.performer_maps(
        w.q, w.k, rows, kind=kind, scale=call.scale, causal=call.causal,
        key_mask=call.key_mask)
    # eps=0: only a zero denominator (no visible key) gives zeros
    out, _ = numpy_kernel.kernel_attention(
        w.v, query_features=query_features, key_features=key_features, n=p.n, s=p.s,
        batch=p.batch, causal=call.causal, key_mask=None, method="chunked", chunk=64,
        sz0=None, eps=0.0, m=call.width,
        shifted_keys=not call.causal and kind in EXP_KINDS)
    return _poisoned(call, w, out)


def _work(call: PerformerCall, w: Working) -> int:
    """Bytes of the engine's largest temporary: features and values of every token."""
    p = call.p
    return math.prod(p.batch) * (p.n + p.s) * max(call.width, p.dv + 1) * 4


#: The pipeline of :func:`performer_attention`.
SPEC = Spec(name="performer_attention", check=checked_performer, reference=_reference,
            engine=_engine, work=_work, poison=lambda call: call.causal,
            none_means={"features": "drawn from num_features, projection, norms and seed",
                        "num_features": "256 (d with projection='identity')",
                        "scale": "1/sqrt(d)", "key_mask": "every key is real",
                        "gerf_a": "the optimal A* of q and the unmasked keys"})


def uniform_call(q, k, v, /, *, omega=None, **options):
    """The registry's uniform call: ``omega=`` replays a caller's ``(m, d)`` matrix."""
    if omega is not None:
        if options.get("features") is not None:
            raise ValueError("pass either omega or features, not both")
        options["features"] = RandomFeatures.from_matrix(omega)
    return performer_attention(q, k, v, **options)
