"""What a kernel does not support: the checker isolates what made a case raise
``NotImplementedError`` -- the backward, a shape property, the dtype, one option value, a
combination of options -- and the search goes on without it.

Shape properties are tested one at a time on the convention's plainest case (``b=1 h=2
n=s=16 d=dv=16`` float32, no option) carrying only that property of the failing case:

========================  ==============================================================
``b > 1``                 several sequences in the batch
``hq != hkv (GQA)``       fewer key/value heads than query heads
``n < s`` / ``n > s``     query and key lengths differ (tested at 16 and 24 tokens)
``d=<value>``             a head dim (with ``dv = d``): kernels built for some dims only
``dv != d``               value dim other than the key dim (torch's CPU flash backend)
========================  ==============================================================

Example: a kernel raising ``NotImplementedError`` whenever ``dv != d`` gets
``Unsupported("shape", "dv!=d", "dv != d")``, and every later case with ``dv != d`` is
skipped:

>>> from arrayattn.testing.check.cases import Case
>>> u = Unsupported("shape", "dv!=d", "dv != d")
>>> u.matches(Case(d=16, dv=8)), u.matches(Case(d=16, dv=16))
(True, False)
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .cases import Case

__all__ = ["Unsupported", "isolate_unsupported", "SHAPE_PROPERTIES"]


def _lengths(case, plain):
    """The plainest case with query and key lengths ordered as in ``case`` (16 and 24)."""
    return replace(plain, n=16, s=24) if case.n < case.s else replace(plain, n=24, s=16)


#: name -> (does the case have it, the plainest case with it, label, key of the exclusion)
SHAPE_PROPERTIES = {
    "b>1": (lambda c, p: c.b > 1, lambda c, p: replace(p, b=c.b), lambda c: "b > 1",
            lambda c: None),
    "gqa": (lambda c, p: c.hq != c.hkv, lambda c, p: replace(p, hq=c.hq, hkv=c.hkv),
            lambda c: "hq != hkv (GQA)", lambda c: None),
    "n<s": (lambda c, p: c.n < c.s, _lengths, lambda c: "n < s", lambda c: None),
    "n>s": (lambda c, p: c.n > c.s, _lengths, lambda c: "n > s", lambda c: None),
    "d": (lambda c, p: c.d != p.d, lambda c, p: replace(p, d=c.d, dv=c.d),
          lambda c: f"d={c.d}", lambda c: c.d),
    "dv!=d": (lambda c, p: c.dv != c.d, lambda c, p: replace(p, d=c.d, dv=c.dv),
              lambda c: "dv != d", lambda c: None),
}

_SHAPE_MATCH = {
    "b>1": lambda c, v: c.b > 1,
    "gqa": lambda c, v: c.hq != c.hkv,
    "n<s": lambda c, v: c.n < c.s,
    "n>s": lambda c, v: c.n > c.s,
    "d": lambda c, v: c.d == v,
    "dv!=d": lambda c, v: c.dv != c.d,
}

_DIMS = ("b", "hq", "hkv", "n", "s", "d", "dv")


@dataclass(frozen=True)
class Unsupported:
    """One thing a kernel does not support: ``kind`` ``"backward"``, ``"dtype"`` (``key``
    the dtype's name), ``"option"`` (``key`` the pair ``(name, value)``), ``"options"`` (a
    frozenset of pairs: the combination), ``"shape"`` (``key`` a name of
    :data:`SHAPE_PROPERTIES`, ``value`` its value if it has one) or ``"case"`` (``key``
    the exact dims, dtype and options: nothing smaller isolated it) or ``"dims"`` (the exact
    dims: no shape property alone raised); ``label`` is what the summary prints."""

    kind: str
    key: object
    label: str
    value: object = None

    def __str__(self) -> str:
        return self.label

    def matches(self, case: Case) -> bool:
        """Whether ``case`` has it (and is skipped)."""
        active = case.active()
        if self.kind == "backward":
            return bool(active.get("backward"))
        if self.kind == "dtype":
            return case.dtype == self.key
        if self.kind == "option":
            name, value = self.key
            return name in active and active[name] == value
        if self.kind == "options":
            return all(k in active and active[k] == v for k, v in self.key)
        if self.kind == "shape":
            return _SHAPE_MATCH[self.key](case, self.value)
        if self.kind == "dims":
            return _dims(case) == self.key
        return _signature(case) == self.key


def _dims(case: Case) -> tuple:
    return tuple(getattr(case, a) for a in _DIMS)


def _signature(case: Case) -> tuple:
    return _dims(case) + (case.dtype, case.options)


def _pairs(pairs) -> str:
    return " + ".join(f"{k}={v}" for k, v in sorted(pairs))


def isolate_unsupported(case: Case, conv, raises) -> Unsupported | None:
    """What of ``case`` makes the kernel raise ``NotImplementedError`` (``raises(c)``: True
    when it does on ``c``), tested in isolation in this order: the backward alone (the
    forward passes), the shape (no option, float32; then each shape property alone on the
    plainest case), the dtype (the case's shape, no option), each option value alone (the
    case's shape and dtype), the combination of the case's options, and else the exact
    case.  None when the plainest case of the convention raises it too (nothing can be
    checked)."""
    active = case.active()
    if active.get("backward") and not raises(conv.normalize(case.with_options(backward=None))):
        return Unsupported("backward", None, "backward=True")
    plain = conv.normalize(Case())
    bare = conv.normalize(replace(case, options=(), dtype="float32"))
    if raises(bare):
        if raises(plain):
            return None
        for name, (has, build, label, value) in SHAPE_PROPERTIES.items():
            if has(case, plain) and raises(conv.normalize(build(case, plain))):
                return Unsupported("shape", name, label(case), value(case))
        dims = " ".join(f"{a}={getattr(case, a)}" for a in _DIMS)
        return Unsupported("dims", _dims(bare), f"shape {dims}")
    if case.dtype != "float32" and raises(replace(bare, dtype=case.dtype)):
        return Unsupported("dtype", case.dtype, case.dtype)
    base = replace(case, options=())
    for key, value in active.items():
        if key == "backward":
            continue
        if raises(conv.normalize(base.with_options(**{key: value}))):
            return Unsupported("option", (key, value), f"{key}={value}")
    pairs = frozenset((k, v) for k, v in active.items() if k != "backward")
    if len(pairs) > 1:
        return Unsupported("options", pairs, _pairs(pairs))
    return Unsupported("case", _signature(case), f"the case {case.describe()}")
