"""The checker's cases: the :class:`Case` record, the fixed catalogue of edge cases visited
first, and the Hypothesis strategy of the random draws (imported lazily: Hypothesis is the
``check`` extra)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

__all__ = ["Case", "catalogue", "reach_catalogue", "large_catalogue", "case_strategy", "fitted",
           "MAGNITUDES", "HALF", "smaller", "VALUES", "POISONS", "DIMS", "cost", "fit",
           "value_classes", "forward_only"]

#: Scales of q and k: the logits grow like their square (100: past float16's exp range at
#: once, 30: past float32's without a max shift).
MAGNITUDES = (1.0, 0.05, 3.0, 10.0, 30.0)
HALF = ("float16", "bfloat16")
#: Sequence lengths of the catalogue: 1, tile remainders around 64 and 128.
LENGTHS = (1, 2, 7, 63, 65, 127, 129)
#: The value classes of q and k (:func:`~arrayattn.testing.check.conventions.base.draw_qkv`):
#: ``normal`` (Gaussian of ``magnitude``), rows whose logits all lie ``far_below`` zero
#: (scaled logits -1e2 .. -1e5) or ``far_above``, exact ``ties``, one ``dominant`` key,
#: rows at a masking ``sentinel``'s value (-1e4, -3e4, -5e4, -65504, -1e5) and, for half
#: precision, q.k that ``overflow``s float16 before scaling (|q.k| 7e4 .. 3e5).
VALUES = ("normal", "far_below", "far_above", "ties", "dominant", "sentinel", "overflow")
#: What the slots a correct kernel never reads hold: ``""`` finite values, ``"nan"``, or
#: ``"inf"`` (+-inf and huge finite values); ``"nan:REGION"`` poisons one region alone.
POISONS = ("", "nan", "inf")
#: The head dims kernels compile a path for, largest first (the order ``smaller`` tries).
DIMS = (256, 192, 160, 128, 96, 80, 64, 40, 32, 16, 8)


@dataclass(frozen=True)
class Case:
    """One problem: shapes (batch ``b``, query heads ``hq``, key/value heads ``hkv``, query
    and key tokens ``n``, ``s``, head dims ``d``, ``dv``), ``dtype``, the convention's
    ``options`` (a sorted tuple of ``(name, value)``; a value ``None``/``False``/``0`` is
    off), the ``seed`` of the inputs, the ``magnitude`` of q and k, their value class
    ``values`` (:data:`VALUES`) and the ``poison`` of the slots a kernel must skip
    (:data:`POISONS`)."""

    b: int = 1
    hq: int = 2
    hkv: int = 2
    n: int = 16
    s: int = 16
    d: int = 16
    dv: int = 16
    dtype: str = "float32"
    options: tuple = field(default_factory=tuple)
    seed: int = 0
    magnitude: float = 1.0
    values: str = "normal"
    poison: str = ""

    @property
    def opts(self) -> dict:
        """The options as a dict."""
        return dict(self.options)

    def with_options(self, **changes) -> "Case":
        """A copy with options changed (``None``, ``False``, ``0`` remove one)."""
        opts = {**self.opts, **changes}
        return replace(self, options=tuple(sorted((k, v) for k, v in opts.items() if v)))

    def active(self) -> dict:
        """The options that are on."""
        return {k: v for k, v in self.options if v}

    def size(self) -> tuple:
        """The order of smallness: tokens, then heads, batch, dims, options, magnitude."""
        extra = (self.values != "normal") + bool(self.poison)
        return (self.n + self.s, self.hq + self.hkv, self.b, len(self.active()) + extra,
                self.d + self.dv, abs(np.log(self.magnitude)), self.dtype != "float32",
                0 if not self.poison else 1 if ":" in self.poison else 2,
                repr(self.options))

    def elements(self) -> int:
        """The elements of the largest tensor of the problem (the logits ``b h n s`` or an
        input): what ``max_size`` bounds."""
        return max(self.b * self.hq * self.n * self.s, self.b * self.hq * self.n * self.d,
                   self.b * self.hkv * self.s * max(self.d, self.dv))

    def describe(self) -> str:
        """One line: shapes, dtype, options, magnitude, seed."""
        heads = f"h={self.hq}" + (f" (kv heads {self.hkv})" if self.hkv != self.hq else "")
        opts = ", ".join(f"{k}={v}" for k, v in self.active().items()) or "no options"
        extra = "" if self.values == "normal" else f", values {self.values}"
        if self.poison:
            kind, _, region = self.poison.partition(":")
            extra += (f", poison {kind} in the slots it must skip"
                      + (f" ({region.replace('_', ' ')})" if region else ""))
        return (f"b={self.b} {heads} n={self.n} s={self.s} d={self.d} dv={self.dv} "
                f"{self.dtype}, {opts}, magnitude {self.magnitude:g}{extra}, seed {self.seed}")


def _edges(conv, base: Case) -> list:
    """One case per edge of every dimension the convention has."""
    out = []
    pairs = [(1, 1), (7, 65), (65, 7), (63, 63), (127, 129), (129, 63)] if not conv.equal_lengths \
        else [(1, 1), (63, 63), (65, 65), (129, 129)]
    out += [replace(base, n=n, s=s) for n, s in pairs]
    if conv.gqa:
        out += [replace(base, hq=4, hkv=2), replace(base, hq=6, hkv=2), replace(base, hq=3, hkv=1)]
    out += [replace(base, b=2, hq=1, hkv=1), replace(base, d=8, dv=32), replace(base, d=64, dv=8)]
    return out


def catalogue(conv, dtypes, grads: bool, skip=()) -> list:
    """The fixed catalogue: every dimension's edges, each option value alone (with n != s
    both ways where the convention allows), the magnitudes, the dtypes, the backward."""
    base = Case(n=16, s=16 if conv.equal_lengths else 24)
    flipped = replace(base, n=base.s, s=base.n)
    cases, later = [base], []
    for name, values in conv.space.items():
        if name in skip or (name == "backward" and not grads):
            continue
        for value in values[1:]:
            cases += [conv.normalize(c.with_options(**{name: value})) for c in (base, flipped)]
            later.append(conv.normalize(replace(base, n=65, s=65 if conv.equal_lengths else 33)
                                        .with_options(**{name: value})))
    cases += _edges(conv, base) + later
    cases += [replace(base, magnitude=m) for m in MAGNITUDES[1:]]
    for dt in dtypes:
        cases += [replace(base, dtype=dt), replace(base, dtype=dt, magnitude=10.0)]
    if grads and "backward" in conv.space:
        cases += [replace(c, dtype=dt).with_options(backward=True)
                  for c in (base, flipped) for dt in dtypes]
        cases += [replace(base, n=65, s=65 if conv.equal_lengths else 33).with_options(
            backward=True, **{k: v[-1]}) for k, v in conv.space.items()
            if k != "backward" and k not in skip]
    seen, unique = set(), []
    for c in (conv.normalize(replace(c, dtype=c.dtype if c.dtype in dtypes else dtypes[0]))
              for c in cases):
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return unique


def value_classes(conv, skip=()) -> tuple:
    """The value classes the search draws for ``conv``: its own (``conv.values``), less
    those named in ``skip`` (``"values"`` skips them all)."""
    values = getattr(conv, "values", ("normal",))
    if "values" in skip:
        return values[:1]
    return tuple(v for v in values if v == values[0] or v not in skip)


def reach_catalogue(conv, dtypes, grads: bool, skip=()) -> list:
    """The small cases of the value classes and the poison, after :func:`catalogue`: each
    value class of the convention alone (``overflow`` in the half precisions), with the
    backward; each poison (``nan``, ``inf``) alone and with every window (4 queries against
    64 keys: whole pages before the window)."""
    base = Case(n=16, s=16 if conv.equal_lengths else 24)
    cases = []
    half = [dt for dt in dtypes if dt in HALF]
    for v in value_classes(conv, skip)[1:]:
        if v == "overflow":
            cases += [replace(base, values=v, dtype=dt) for dt in half]
            continue
        cases.append(replace(base, values=v))
        if grads and "backward" in conv.space and "backward" not in skip and \
                v not in FORWARD_ONLY:
            cases.append(replace(base, values=v).with_options(backward=True))
        cases += [replace(base, values=v, dtype=dt) for dt in half]
    if "segments" in conv.space and "segments" not in skip and grads and \
            "backward" in conv.space and "backward" not in skip:
        cases += [base.with_options(segments=seg, backward=True)
                  for seg in conv.space["segments"][1:]]
    if conv.poison_regions(base) or conv.poison_regions(base.with_options(
            window_size=(3, 0))):
        windows = [w for w in conv.space.get("window_size", ()) if w[0] >= 0] \
            if "window_size" not in skip else []
        for kind in POISONS[1:]:
            cases.append(replace(base, poison=kind))
            cases += [replace(base, n=4, s=64, poison=kind).with_options(window_size=w)
                      for w in windows]
    return _unique(conv, cases, dtypes)


def large_catalogue(conv, dtypes, grads: bool, skip=(), max_size: int = 2 ** 24) -> list:
    """A few large cases, cheapest first, where kernels switch code paths: every head dim
    of :data:`DIMS` (and ``dv != d``), keys past 512 and 1024 (split-KV, memory-efficient
    paths), decoding (1 and 4 queries against up to 16384 keys), causal and windowed
    ``n != s`` across several tiles, hundreds of programs (batch x heads), many varlen
    tokens; each within ``max_size`` elements (:meth:`Case.elements`)."""
    base = Case(n=16, s=16 if conv.equal_lengths else 24)
    cases = [replace(base, d=d, dv=d) for d in DIMS if d > 64] + [
        replace(base, d=d, dv=d) for d in (40, 80)]
    if not conv.equal_dims:
        cases += [replace(base, d=128, dv=64), replace(base, d=64, dv=128)]
    if grads and "backward" in conv.space and "backward" not in skip:
        cases += [replace(base, d=d, dv=d).with_options(backward=True) for d in (128, 256)]
    sizes = [(1, 513), (1, 1025), (4, 2048), (1, 4096), (1, 16384)] \
        if not conv.equal_lengths else [(257, 257), (513, 513)]
    cases += [replace(base, n=n, s=s) for n, s in sizes]
    cases.append(replace(base, n=1, s=16384, hq=32, hkv=8 if conv.gqa else 32, d=128, dv=128))
    causal = [(k, v[1]) for k, v in conv.space.items()
              if k in ("causal", "is_causal", "mask_mod") and k not in skip]
    windows = [("window_size", (256, 0))] if "window_size" in conv.space else \
        [("local_window_size", (256, 0))] if "local_window_size" in conv.space else []
    shapes = [(300, 300), (257, 520), (520, 1100)] if not conv.equal_lengths else [(300, 300)]
    for key, value in causal + [w for w in windows if w[0] not in skip]:
        cases += [replace(base, n=n, s=s).with_options(**{key: value}) for n, s in shapes]
    if not conv.equal_lengths:      # many rows of several tiles: the sampled judge's regime
        tiles = replace(base, hq=4, hkv=4, n=2048, s=2048, d=64, dv=64)
        cases += [tiles] + [tiles.with_options(**{key: value}) for key, value in causal[:1]]
        if grads and "backward" in conv.space and "backward" not in skip:
            cases += [tiles.with_options(backward=True)] + [tiles.with_options(
                backward=True, **{key: value}) for key, value in causal[:1]]
    cases += [replace(base, b=3, hq=24, hkv=24 if not conv.gqa else 6),
              replace(base, b=2, hq=64, hkv=64 if not conv.gqa else 8, n=8, s=8)]
    if "segments" in conv.space and "segments" not in skip:
        cases.append(replace(base, b=12, n=400, s=400).with_options(segments="many"))
    out = [c for c in _unique(conv, cases, dtypes) if c.elements() <= max_size]
    return sorted(out, key=cost)


def cost(case: Case) -> float:
    """The work of a case, roughly: the logits times the head dims (times 3 backward)."""
    work = case.b * case.hq * case.n * max(case.s, 1) * (case.d + case.dv)
    return work * (3 if case.opts.get("backward") else 1)


#: The largest :func:`cost` of a random draw (2**22 logits at d = dv = 16 forward: about a
#: second of the float64 referee on one core).
RANDOM_COST = 2 ** 27


def fit(case: Case, max_size: int, max_cost: float = float("inf")) -> Case:
    """``case`` with its largest of n, s, heads, batch halved until :meth:`Case.elements`
    is at most ``max_size`` and its :func:`cost` at most ``max_cost``."""
    while case.elements() > max_size or cost(case) > max_cost:
        if max(case.n, case.s) > 1:
            case = replace(case, s=max(case.s // 2, 1)) if case.s >= case.n else \
                replace(case, n=max(case.n // 2, 1))
        elif case.hq > 1:
            case = replace(case, hq=max(case.hq // 2, 1), hkv=max(case.hkv // 2, 1))
        elif case.b > 1:
            case = replace(case, b=case.b // 2)
        else:
            break
    return case


#: The value classes judged forward only: their gradients' float32 error comes from the
#: rounding of the lse at its own size (``P = exp(S - lse)`` with ``S`` and ``lse`` near
#: -1e4: an absolute error of ~1e-3 in every exponent, as in FlashAttention's backward),
#: which the gradient referee's baseline does not carry yet (torch's SDPA backward was
#: flagged at 3.7x on ``dq``).
FORWARD_ONLY = ("far_below", "far_above", "sentinel", "overflow")


def forward_only(case: Case) -> Case:
    """``case`` without the backward when its value class is judged forward only."""
    if case.values in FORWARD_ONLY and case.opts.get("backward"):
        return case.with_options(backward=None)
    return case


def _unique(conv, cases, dtypes) -> list:
    seen, unique = set(), []
    for c in (forward_only(conv.normalize(replace(
            c, dtype=c.dtype if c.dtype in dtypes else dtypes[0]))) for c in cases):
        if conv.equal_lengths and c.n != c.s:
            c = replace(c, s=c.n)
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return unique


def case_strategy(conv, dtypes, grads: bool, skip=(), max_size: int = 2 ** 24):
    """The Hypothesis strategy of random cases: small values first, so that shrinking moves
    toward few tokens, heads, options and the plain magnitude; one draw in sixteen large
    (:func:`_large`), each fitted within ``max_size`` elements (and 2**22 logits and
    :data:`RANDOM_COST`: a random draw stays cheap; ``max_size=0``: small draws only)."""
    from hypothesis import strategies as st

    @st.composite
    def draw_case(draw):
        n = draw(st.integers(1, 160))
        s = n if conv.equal_lengths else draw(st.integers(1, 160))
        hkv = draw(st.integers(1, 3))
        hq = hkv * (draw(st.integers(1, 3)) if conv.gqa else 1)
        d = draw(st.sampled_from((16, 8, 32, 64)))
        dv = d if conv.equal_dims else draw(st.sampled_from((d, 8, 32)))
        opts = {}
        for name, values in conv.space.items():
            if name in skip or (name == "backward" and not grads):
                continue
            opts[name] = draw(st.sampled_from(values))
        case = Case(b=draw(st.integers(1, 2)), hq=hq, hkv=hkv, n=n, s=s, d=d, dv=dv,
                    dtype=draw(st.sampled_from(tuple(dtypes))),
                    seed=draw(st.integers(0, 2**16)),
                    magnitude=draw(st.sampled_from(MAGNITUDES)))
        # the reach (drawn after the dimensions above, so that their draws stay as before):
        # one draw in four a value class, one in eight poison, one in sixteen large sizes
        values = value_classes(conv, skip)
        if len(values) > 1 and draw(st.integers(0, 3)) == 3:
            case = replace(case, values=draw(st.sampled_from(values[1:])))
        if conv.poison_regions(conv.normalize(case.with_options(**opts))) and \
                draw(st.integers(0, 7)) == 7:
            case = replace(case, poison=draw(st.sampled_from(POISONS[1:])))
        if max_size and draw(st.integers(0, 15)) == 15:
            case = _large(draw, st, conv, case)
        if case.values == "overflow" and case.dtype not in HALF:
            case = replace(case, values="far_above")
        return fitted(conv, forward_only(conv.normalize(case.with_options(**opts))),
                      min(max_size or 2 ** 22, 2 ** 22))

    return draw_case()


def fitted(conv, case: Case, max_size: int) -> Case:
    """A random draw cut to ``max_size`` elements and :data:`RANDOM_COST` (:func:`fit`),
    normalized again by the convention (fitting halves ``s`` first where ``n = s``, which
    made ``n > s`` under a JAX window, a case the convention never draws)."""
    case = conv.normalize(fit(case, max_size, RANDOM_COST))
    if conv.equal_lengths and case.s != case.n:
        case = replace(case, n=min(case.n, case.s), s=min(case.n, case.s))
    return case


def _large(draw, st, conv, case: Case) -> Case:
    """Large sizes: a head dim of :data:`DIMS`, tokens across several tiles (up to 2048) or
    decoding (1 to 4 queries against up to 16384 keys), up to 2 x 64 programs (query
    heads at most 64: the per-head tolerance of hundreds of heads flagged a clean kernel,
    one head at 1.36x, see docs/check.rst)."""
    d = draw(st.sampled_from(DIMS[::-1]))
    dv = d if conv.equal_dims else draw(st.sampled_from((d,) + DIMS[::-1]))
    if draw(st.booleans()):
        n, s = draw(st.integers(1, 4)), draw(st.integers(1, 16384))
    else:
        n, s = draw(st.integers(1, 2048)), draw(st.integers(1, 2048))
    hkv = draw(st.integers(1, 16))
    group = draw(st.integers(1, max(64 // hkv, 1))) if conv.gqa else 1
    return replace(case, n=n, s=s, d=d, dv=dv, hq=hkv * group, hkv=hkv,
                   b=draw(st.integers(1, 2)))


def smaller(case: Case, conv) -> list:
    """Candidate one-step reductions of ``case`` (for the final greedy shrink): fewer tokens
    (halved, one less, then less by every power of two: a threshold at 513 keys is reached
    from 16384 in a few dozen steps), heads, batch, dims (8, then each smaller size of
    :data:`DIMS`: a bug of the d = 128 path stays at 128), options, the normal values, the
    poison in one region alone then none, the plain magnitude and seed 0."""
    cands = []
    steps = [(case.n // 2, case.s), (case.n, case.s // 2), (case.n // 2, case.s // 2)]
    for k in range(int(np.log2(max(case.n, 1))), 0, -1):
        steps.append((case.n - 2 ** k, case.s))
    for k in range(int(np.log2(max(case.s, 1))), 0, -1):
        steps.append((case.n, case.s - 2 ** k))
    steps += [(case.n - 1, case.s), (case.n, case.s - 1), (case.n - 1, case.s - 1)]
    seen = set()
    for n, s in steps:
        if conv.equal_lengths:
            n = s = min(n, s)
        if n >= 1 and s >= 1 and (n, s) != (case.n, case.s) and (n, s) not in seen:
            seen.add((n, s))
            cands.append(replace(case, n=n, s=s))
    if case.hq > 1:
        cands.append(replace(case, hq=case.hkv) if case.hq != case.hkv else
                     replace(case, hq=1, hkv=1))
        group = case.hq // case.hkv
        for k in range(int(np.log2(case.hkv)), -1, -1):
            if case.hkv - 2 ** k >= 1:
                hkv = case.hkv - 2 ** k
                cands.append(replace(case, hkv=hkv, hq=hkv * group))
        cands += [replace(case, hq=case.hkv * (group - 2 ** k))
                  for k in range(int(np.log2(group)), -1, -1) if group - 2 ** k >= 1]
    if case.b > 1:
        cands.append(replace(case, b=1))
        cands += [replace(case, b=case.b - 2 ** k)
                  for k in range(int(np.log2(case.b)), -1, -1) if case.b - 2 ** k >= 1]
    if case.d != 8 or case.dv != 8:
        cands.append(replace(case, d=8, dv=8))
        for d in DIMS:
            if d < max(case.d, case.dv):
                cands.append(replace(case, d=min(d, case.d), dv=min(d, case.dv)))
                if case.d != case.dv:
                    cands.append(replace(case, d=d if d < case.d else case.d))
                    cands.append(replace(case, dv=d if d < case.dv else case.dv))
    cands += [case.with_options(**{k: None}) for k in case.active()]
    if case.values != "normal":
        cands.append(replace(case, values="normal"))
    if case.poison:
        cands.append(replace(case, poison=""))
        if ":" not in case.poison:
            cands += [replace(case, poison=f"{case.poison}:{r}")
                      for r in conv.poison_regions(case)]
    if case.magnitude != 1.0:
        cands.append(replace(case, magnitude=1.0))
    if case.seed:
        cands.append(replace(case, seed=0))
    out = []
    for c in cands:
        c = forward_only(conv.normalize(c))
        if c != case and c not in out:
            out.append(c)
    return out
