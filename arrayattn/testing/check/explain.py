"""What a finding means (issue #50): the *named deviation* a kernel's results match -- the
softmax scale applied twice, causal aligned top-left, grouped heads tiled, the lse in base
2 ... -- and which of the smallest case's dimensions the failure needs.

After the search has shrunk a finding, :func:`explain` varies each dimension of the smallest
case (the seed, the magnitude, the dtype, the lengths, the heads, each active option off:
a handful of evaluations, in the manner of Hypothesis' explain phase) and says under which
the failure persists.  Then it re-evaluates the float64 reference under each entry of
:data:`DEVIATIONS` on the smallest failing case and on a few of those other failing cases,
and names the entries that the kernel's results equal, within the tolerance of the judge's
original comparison, on every one of them: a coincidence on one tiny case does not name
the wrong mistake.

A deviation is data: a name, a sentence, and a transformation of the reference problem --
of the port's options (``port``), of arrayattn's problem once the profile mapped them
(``native``, a :class:`~arrayattn.testing.problem.Problem`), of the reference's result
(``result``) or of the reference gradients (``grads``) -- which returns ``None`` where the
deviation does not apply (an option the case does not use, a convention it cannot occur
in).  Adding one is one entry of :data:`DEVIATIONS`.

Examples
--------
>>> from arrayattn.testing.check.explain import DEVIATIONS
>>> [d.name for d in DEVIATIONS][:3]
['scale_twice', 'scale_one', 'scale_sqrt_dv']
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..problem import Problem, prepare, to_bhnd
from .conventions.base import host
from .deviation import Ctx, Deviation
from .deviations import BOTTOM_RIGHT, DEVIATIONS
from .judge import grad_options, judge, judge_inputs

__all__ = ["Deviation", "DEVIATIONS", "Explanation", "explain", "match_deviations",
           "dimensions", "run_case", "Ctx", "Run", "match_one", "CONVENTION_NAMES"]


# -- running and matching ----------------------------------------------------------------
@dataclass
class Run:
    """One case run again: its call, the kernel's results and gradients, the verdict."""

    case: object
    call: object
    results: dict
    grads: dict
    verdict: object


def run_case(fn, conv, case) -> Run | None:
    """Run and judge ``case``, keeping the kernel's results (None: unsupported or raised)."""
    try:
        call = conv.build(case)
        results, grads = conv.run(fn, call, case, bool(case.opts.get("backward")))
        verdict = judge(call, conv, results, grads)
    except Exception:
        return None
    return Run(case, call, results, grads, verdict)


def _ctx(run: Run, conv) -> Ctx:
    ctx = Ctx(run.case, conv, run.call)
    ctx.conv_bottom_right = conv.name in BOTTOM_RIGHT or (
        conv.name not in CONVENTION_NAMES and run.call.profile is None)
    return ctx


CONVENTION_NAMES = ("sdpa", "flex_attention", "jax_dot_product_attention", "flash_attn",
                    "flash_attn_varlen", "flash_attn_kvcache", "fla_gla", "fla_simple_gla",
                    "fla_delta_rule", "fla_gated_delta_rule")


def _errors(theirs: np.ndarray, alt: np.ndarray, heads: int) -> np.ndarray:
    """Per head ``max |theirs - alt|``, NaN against NaN and equal infinities agreeing."""
    theirs, alt = np.asarray(theirs, np.float64), np.asarray(alt, np.float64)
    if theirs.shape != alt.shape:
        raise ValueError("shape")
    with np.errstate(invalid="ignore"):
        err = np.abs(theirs - alt)
    same = (np.isnan(theirs) & np.isnan(alt)) | (np.isinf(theirs) & (theirs == alt))
    err = np.where(same, 0.0, np.where(np.isnan(err), np.inf, err))
    return err.reshape(heads, -1).max(axis=1, initial=0.0)


def _forward_alt(dev: Deviation, run: Run, ctx: Ctx, label: str):
    call, x = run.call, judge_inputs(run.call)
    params, xx = dict(call.params), dict(x)
    if dev.port is not None:
        got = dev.port(params, xx, ctx)
        if got is None:
            return None
        params, xx = got
    p = prepare(None if call.profile else call.variant, xx["q"], xx["k"], xx["v"],
                layout=call.layout, profile=call.profile, params=params)
    if dev.native is not None:
        p = dev.native(p, ctx)
        if p is None:
            return None
    if label == "final_state":
        from ...registry import get_variant
        ref = get_variant(p.name).reference(p.q, p.k, p.v, return_state=True, **p.options)[1]
        ref = np.asarray(ref, np.float64)
    else:
        ref = p.evaluate(lse=label == "lse")
    if dev.result is not None:
        ref = dev.result(label, ref, p, ctx)
    return ref


def _theirs(run: Run, conv, label: str, layout: str) -> np.ndarray:
    if label == "out":
        out = host(conv.to_judge("out", run.results["out"]))
        return to_bhnd({"out": out}, layout, ("out",))["out"]
    return host(run.results[label])


def _grad_alts(dev: Deviation, run: Run, ctx: Ctx, conv):
    """``(theirs, alt)`` gradients in arrayattn's layout under the deviation."""
    from ..grads import host_problem, reference_vjp
    call, x = run.call, judge_inputs(run.call)
    theirs = {call.rename.get(k, k): conv.to_judge(k, g) for k, g in run.grads.items()}
    if call.grad_params is None and call.profile is not None:
        params, variant, profile = dict(call.params), None, call.profile
    else:
        params, variant, profile = dict(grad_options(call, x)), call.variant, None
    xx = dict(x)
    if dev.port is not None:
        got = dev.port(params, xx, ctx)
        if got is None:
            return None
        params, xx = got
    rec, args, options, theirs, how = host_problem(theirs, variant, xx["q"], xx["k"],
                                                    xx["v"], xx["do"], params, call.layout,
                                                    profile)
    if dev.grads is not None:
        ref = dev.grads(rec, args, options, how, ctx)
        return None if ref is None else (theirs, ref)
    p = Problem(rec.name, rec.reference, args["q"], args["k"], args["v"], dict(options))
    if dev.native is not None:
        p = dev.native(p, ctx)
        if p is None:
            return None
    if p.reference != rec.reference:
        return "skip"                   # a reference of its own: no vjp (gradients unjudged)
    tiled = "gqa-tiled" in p.notes
    ref = reference_vjp(rec,
               {"q": p.q, "k": p.k, "v": p.v, "do": args["do"]}, p.options, "float64",
               how={**how, "groups": 1} if tiled else how)
    if tiled:
        hkv = ctx.case.hkv
        for name in ("k", "v"):
            g = ref[name]
            ref[name] = g.reshape(*g.shape[:-3], g.shape[-3] // hkv, hkv,
                                  *g.shape[-2:]).sum(axis=-4)
    if dev.result is not None:
        ref = {name: dev.result(f"d{name}", g, p, ctx) for name, g in ref.items()}
    return theirs, ref


def match_one(dev: Deviation, run: Run, conv) -> tuple | None:
    """``(matched, worst error, labels compared)`` of ``dev`` on a failing run, or None
    where it does not apply."""
    ctx = _ctx(run, conv)
    if dev.conventions and conv.name not in dev.conventions and not (
            "custom" in dev.conventions and conv.name not in CONVENTION_NAMES):
        return None
    items = run.verdict.items
    fwd = [(lab, c) for lab, c in items if not lab.startswith("d")]
    grads = [(lab, c) for lab, c in items if lab.startswith("d")]
    covers = (lambda lab: True) if dev.items is None else (lambda lab: lab in dev.items)
    worst, compared = 0.0, []
    try:
        for lab, c in fwd:
            if not covers(lab):
                if not c.ok:
                    return False, math.inf, compared
                continue
            alt = _forward_alt(dev, run, ctx, lab)
            if alt is None:
                return None
            theirs = _theirs(run, conv, lab, run.call.layout)
            err = _errors(theirs, alt, len(c.heads))
            if not np.all(err <= c.tolerance):
                return False, float(np.max(err)), [lab]
            compared.append(lab)
            worst = max(worst, float(np.max(err, initial=0.0)))
        grad_covered = [(lab, c) for lab, c in grads if covers(lab)]
        if grads and (dev.items is None or grad_covered):
            got = _grad_alts(dev, run, ctx, conv)
            if got is None:
                return None
            theirs, ref = ({}, {}) if got == "skip" else got
            for lab, c in grads if got != "skip" else ():
                name = lab[1:]
                if not covers(lab):
                    if not c.ok:
                        return False, math.inf, compared
                    continue
                err = _errors(theirs[name], ref[name], len(c.heads))
                if not np.all(err <= c.tolerance):
                    return False, float(np.max(err)), [lab]
                compared.append(lab)
                worst = max(worst, float(np.max(err, initial=0.0)))
    except Exception:
        return None
    if not compared or not any(not c.ok for lab, c in items if lab in compared):
        return None          # it explains nothing that failed
    return True, worst, compared


def match_deviations(runs: list, conv, catalogue=None) -> list:
    """The deviations the kernel matches on every failing run where they apply (and at
    least the first): ``[(Deviation, matched, tried, worst error, labels)]``."""
    found = []
    for dev in DEVIATIONS if catalogue is None else catalogue:
        results = [match_one(dev, run, conv) for run in runs]
        if results[0] is None or not results[0][0]:
            continue
        applied = [r for r in results if r is not None]
        if all(r[0] for r in applied):
            labels = sorted({lab for r in applied for lab in r[2]},
                            key=lambda s: (s != "out", s))
            found.append((dev, len(applied), len(runs), max(r[1] for r in applied), labels))
    return found


# -- which dimensions matter -------------------------------------------------------------
def _variations(case, conv, dtypes) -> list:
    """``[(dimension, description, case)]``: each dimension of ``case`` varied once or twice."""
    out = [("seed", f"seed {case.seed + d}", replace(case, seed=case.seed + d)) for d in (1, 2)]
    mags = [m for m in (1.0, 3.0, 0.05) if m != case.magnitude][:2]
    out += [("magnitude", f"magnitude {m:g}", replace(case, magnitude=m)) for m in mags]
    out += [("dtype", dt, replace(case, dtype=dt)) for dt in dtypes if dt != case.dtype][:2]
    if case.n != case.s:
        m = max(case.n, case.s)
        out.append(("n != s", f"n = s = {m}", replace(case, n=m, s=m)))
        if not conv.equal_lengths:
            out.append(("n/s", f"n = {case.s}, s = {case.n}", replace(case, n=case.s,
                                                                      s=case.n)))
    elif not conv.equal_lengths:
        out.append(("n == s", f"n = {case.n}, s = {case.n + 3}",
                    replace(case, s=case.n + 3)))
    out.append(("size", f"n = {2 * case.n + 3}, s = {2 * case.s + 3}",
                replace(case, n=2 * case.n + 3, s=2 * case.s + 3)))
    if case.hq != case.hkv:
        out.append(("grouped heads", f"h = kv heads = {case.hkv}",
                    replace(case, hq=case.hkv)))
    for key, val in case.active().items():
        out.append((f"{key}={val}", f"{key} off", case.with_options(**{key: None})))
    return [(dim, text, conv.normalize(c)) for dim, text, c in out if conv.normalize(c) != case]


def dimensions(fn, conv, case, dtypes) -> tuple:
    """``(sentence, failing runs of the variations)``: under which variations of ``case``
    the failure persists (each dimension varied once or twice), e.g. ``fails for every
    seed, magnitude and dtype tried; needs causal=True and n != s``."""
    runs, by_dim = [], {}
    for dim, text, cand in _variations(case, conv, dtypes):
        run = run_case(fn, conv, cand)
        if run is None:
            continue
        fails = not run.verdict.ok
        by_dim.setdefault(dim, []).append((text, fails))
        if fails and run.verdict.error is None:
            runs.append(run)
    every, persists, needs, partly = [], [], [], []
    for dim, got in by_dim.items():
        passing = [t for t, f in got if not f]
        if dim == "n/s":
            dim = "n < s" if case.n < case.s else "n > s"
        if not passing:
            if dim in ("seed", "magnitude", "dtype", "size"):
                every.append(dim if dim != "size" else "larger size")
            else:
                persists.append(got[0][0])
        elif len(passing) == len(got):
            needs.append({"size": f"the size (passes at {got[0][0]})",
                          "seed": f"seed {case.seed}",
                          "magnitude": f"magnitude {case.magnitude:g}",
                          "dtype": case.dtype}.get(dim, dim))
        else:
            partly.append(f"{dim} (passes with {', '.join(passing)})")
    if "n != s" in needs and ("n < s" in needs or "n > s" in needs):
        needs.remove("n != s")
    parts = []
    if every:
        parts.append("fails for every " + _and(every) + " tried")
    if persists:
        parts.append("persists with " + _and(persists))
    if needs:
        parts.append("needs " + _and(needs))
    if partly:
        parts.append("depends on " + _and(partly))
    return ("; ".join(parts) or "no variation ran"), runs


def _and(words: list) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


# -- the result --------------------------------------------------------------------------
@dataclass
class Explanation:
    """What :func:`explain` found: ``likely`` (the line on the named deviation),
    ``matches`` (``[(Deviation, matched, tried, worst error, labels)]``), ``dims`` (the
    line on the dimensions)."""

    likely: str
    dims: str
    matches: list

    @property
    def names(self) -> list:
        return [m[0].name for m in self.matches]

    def lines(self) -> list:
        return [self.likely, f"dimensions: {self.dims}"]


def _likely(matches: list, tried: int) -> str:
    if not matches:
        return (f"no named deviation matches ({len(DEVIATIONS)} tried on {tried} failing "
                f"case{'s' if tried != 1 else ''})")
    dev, ok, total, err, labels = matches[0]
    verb = "equals" if len(labels) == 1 else "equal"
    line = (f"likely: {dev.sentence} -- {', '.join(labels)} {verb} that reference to "
            f"{err:.2g} on {ok} of {total} failing case{'s' if total != 1 else ''}")
    if len(matches) > 1:
        line += "; also matches: " + "; ".join(m[0].sentence for m in matches[1:])
    return line


def explain(fn, conv, case, dtypes=("float32",), *, others: int = 3) -> Explanation | None:
    """The named deviation and the dimensions of the failing ``case`` (None when the case
    does not fail again, or the kernel raised)."""
    first = run_case(fn, conv, case)
    if first is None or first.verdict.ok or first.verdict.error is not None:
        return None
    dims, failing = dimensions(fn, conv, case, tuple(dtypes))
    # the other failing cases: prefer the ones that differ most from the smallest
    order = sorted(failing, key=lambda r: -(r.case.n + r.case.s + (r.case.seed != case.seed)))
    runs = [first] + order[:others]
    matches = match_deviations(runs, conv)
    return Explanation(_likely(matches, len(runs)), dims, matches)
