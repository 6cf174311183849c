"""The checker's cases: the :class:`Case` record, the fixed catalogue of edge cases visited
first, and the Hypothesis strategy of the random draws (imported lazily: Hypothesis is the
``check`` extra)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

__all__ = ["Case", "catalogue", "case_strategy", "MAGNITUDES", "HALF", "smaller"]

#: Scales of q and k: the logits grow like their square (100: past float16's exp range at
#: once, 30: past float32's without a max shift).
MAGNITUDES = (1.0, 0.05, 3.0, 10.0, 30.0)
HALF = ("float16", "bfloat16")
#: Sequence lengths of the catalogue: 1, tile remainders around 64 and 128.
LENGTHS = (1, 2, 7, 63, 65, 127, 129)


@dataclass(frozen=True)
class Case:
    """One problem: shapes (batch ``b``, query heads ``hq``, key/value heads ``hkv``, query
    and key tokens ``n``, ``s``, head dims ``d``, ``dv``), ``dtype``, the convention's
    ``options`` (a sorted tuple of ``(name, value)``; a value ``None``/``False``/``0`` is
    off), the ``seed`` of the inputs and the ``magnitude`` of q and k."""

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
        return (self.n + self.s, self.hq + self.hkv, self.b, len(self.active()),
                self.d + self.dv, abs(np.log(self.magnitude)), self.dtype != "float32",
                repr(self.options))

    def describe(self) -> str:
        """One line: shapes, dtype, options, magnitude, seed."""
        heads = f"h={self.hq}" + (f" (kv heads {self.hkv})" if self.hkv != self.hq else "")
        opts = ", ".join(f"{k}={v}" for k, v in self.active().items()) or "no options"
        return (f"b={self.b} {heads} n={self.n} s={self.s} d={self.d} dv={self.dv} "
                f"{self.dtype}, {opts}, magnitude {self.magnitude:g}, seed {self.seed}")


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


def case_strategy(conv, dtypes, grads: bool, skip=()):
    """The Hypothesis strategy of random cases: small values first, so that shrinking moves
    toward few tokens, heads, options and the plain magnitude."""
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
        return conv.normalize(case.with_options(**opts))

    return draw_case()


def smaller(case: Case, conv) -> list:
    """Candidate one-step reductions of ``case`` (for the final greedy shrink): fewer tokens
    (halved, or one less), heads, batch, dims, options, the plain magnitude and seed 0."""
    cands = []
    for n, s in ((case.n // 2, case.s), (case.n, case.s // 2), (case.n // 2, case.s // 2),
                 (case.n - 1, case.s), (case.n, case.s - 1), (case.n - 1, case.s - 1)):
        if conv.equal_lengths:
            n = s = min(n, s)
        if n >= 1 and s >= 1 and (n, s) != (case.n, case.s):
            cands.append(replace(case, n=n, s=s))
    if case.hq > 1:
        cands.append(replace(case, hq=case.hkv) if case.hq != case.hkv else
                     replace(case, hq=1, hkv=1))
    if case.b > 1:
        cands.append(replace(case, b=1))
    if case.d != 8 or case.dv != 8:
        cands.append(replace(case, d=8, dv=8))
    cands += [case.with_options(**{k: None}) for k in case.active()]
    if case.magnitude != 1.0:
        cands.append(replace(case, magnitude=1.0))
    if case.seed:
        cands.append(replace(case, seed=0))
    return [conv.normalize(c) for c in cands]
