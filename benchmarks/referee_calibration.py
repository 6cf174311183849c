"""Calibration of the referee's tolerance (issue #40): plain, correct float32 evaluations of
exact attention judged by :mod:`arrayattn.testing`, over logits from order 1 to order 400.

For each case and seed it records the ratio error / tolerance of each plain evaluation
(forward: the textbook order in NumPy -- scores, max shift, exp, normalise, matmul --, the
same with the scale folded into q first as FlashAttention's ``attention_ref``, an online
(blockwise) softmax, torch's SDPA; backward: the textbook FlashAttention-2 equations in
NumPy float32, torch autograd through the textbook forward, torch's SDPA backward).  A
ratio above 1 would be a false finding.  It also records, per case, the smallest factor by
which the error of the worst plain evaluation must be multiplied to be caught.

It then calibrates the ensemble of plain evaluations (issue #48) on the forms the
conventions' authors ship (``tests/testing/check/shipped.py``: FlashAttention's
``attention_ref`` both ways, Hugging Face's attention functions, torch SDPA's backends,
fla's naive references): every case of each convention's catalogue, forward and backward,
float32, float16 and bfloat16, and the value classes (far below and above zero, sentinels,
ties, a dominant key), judged with every tolerance in full.  Per convention,
kernel, dtype and output: the worst error / tolerance (the margin is its inverse) and the
factor on the kernel's error from which the referee catches it (tolerance / error: the
median over cases, and the largest -- caught everywhere from there).

    python benchmarks/referee_calibration.py [--seeds 20] [--out referee_calibration]
        [--shipped-seeds 2] [--skip-plain]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import arrayattn  # noqa: F401
from arrayattn.testing import compare_grads, compare_to_reference, rounding

rounding.MEASURE_ALWAYS = True      # every tolerance in full, also where MATCH without it

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _softmax(s):
    """Max-shifted softmax; a row with no visible key is all zeros (no NaN)."""
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    den = p.sum(-1, keepdims=True)
    return p / np.where(den > 0, den, 1)


def textbook(q, k, v, scale, mask):
    s = (q @ np.swapaxes(k, -1, -2)) * np.float32(scale)
    p = _softmax(np.where(mask, s, -np.inf))
    return p @ v, p


def scaled_first(q, k, v, scale, mask):
    s = (q * np.float32(scale)) @ np.swapaxes(k, -1, -2)
    return _softmax(np.where(mask, s, -np.inf)) @ v, None


def online(q, k, v, scale, mask, block=16):
    n, s = q.shape[-2], k.shape[-2]
    m = np.full(q.shape[:-1] + (1,), -np.inf, np.float32)
    l = np.zeros(q.shape[:-1] + (1,), np.float32)
    acc = np.zeros(q.shape[:-1] + (v.shape[-1],), np.float32)
    for j in range(0, s, block):
        sc = (q @ np.swapaxes(k[..., j:j + block, :], -1, -2)) * np.float32(scale)
        sc = np.where(mask[..., j:j + block], sc, -np.inf)
        m_new = np.maximum(m, sc.max(-1, keepdims=True))
        safe = np.where(np.isfinite(m_new), m_new, 0)
        alpha = np.where(np.isfinite(m), np.exp(m - safe), 0).astype(np.float32)
        p = np.exp(sc - safe)
        l = l * alpha + p.sum(-1, keepdims=True)
        acc = acc * alpha + p @ v[..., j:j + block, :]
        m = m_new
    return acc / np.where(l > 0, l, 1), None


def textbook_backward(q, k, v, do, scale, mask):
    o, p = textbook(q, k, v, scale, mask)
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(v, -1, -2)
    dd = (do * o).sum(-1, keepdims=True)
    ds = p * (dp - dd)
    return {"q": (ds @ k) * scale, "k": (np.swapaxes(ds, -1, -2) @ q) * scale, "v": dv}


def torch_impls():
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return {}, {}

    def sdpa(q, k, v, scale, causal):
        t = [torch.from_numpy(x) for x in (q, k, v)]
        return F.scaled_dot_product_attention(*t, is_causal=causal, scale=scale).numpy()

    def sdpa_math(q, k, v, scale, causal):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH):
            return sdpa(q, k, v, scale, causal)

    def sdpa_grads(q, k, v, do, scale, causal):
        t = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
        o = F.scaled_dot_product_attention(*t, is_causal=causal, scale=scale)
        o.backward(torch.from_numpy(do))
        return {name: x.grad.numpy() for name, x in zip("qkv", t)}

    def autograd_textbook(q, k, v, do, scale, causal):
        t = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
        s = (t[0] @ t[1].transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(
                s.shape[-1] - s.shape[-2]), -float("inf"))
        (torch.softmax(s, -1) @ t[2]).backward(torch.from_numpy(do))
        return {name: x.grad.numpy() for name, x in zip("qkv", t)}

    return ({"torch sdpa": sdpa, "torch sdpa math": sdpa_math},
            {"torch sdpa": sdpa_grads, "torch autograd textbook": autograd_textbook})


def case_inputs(case, seed):
    rng = np.random.default_rng(seed)
    b, h, n, s, d = case["shape"]
    sd = case["sd"]
    q = (rng.standard_normal((b, h, n, d)) * sd).astype(np.float32)
    k = (rng.standard_normal((b, h, s, d)) * sd).astype(np.float32)
    v = rng.standard_normal((b, h, s, d)).astype(np.float32)
    do = rng.standard_normal((b, h, n, d)).astype(np.float32)
    return q, k, v, do


CASES = [{"shape": shape, "sd": sd, "causal": causal}
         for shape in ((2, 4, 37, 100, 32), (1, 4, 128, 128, 64), (1, 2, 100, 37, 64))
         for sd in (1.0, 4.0, 8.0, 12.0) for causal in (False, True)]


def run(seeds: int):
    fwd_t, bwd_t = torch_impls()
    rows = []
    for case in CASES:
        worst = {}
        for seed in range(seeds):
            q, k, v, do = case_inputs(case, seed)
            n, s, d = q.shape[-2], k.shape[-2], q.shape[-1]
            scale = 1 / np.sqrt(d)
            mask = np.tril(np.ones((n, s), bool), s - n) if case["causal"] else np.ones(
                (n, s), bool)
            outs = {"numpy textbook": textbook(q, k, v, scale, mask)[0],
                    "numpy scale first": scaled_first(q, k, v, scale, mask)[0],
                    "numpy online": online(q, k, v, scale, mask)[0]}
            outs.update({name: fn(q, k, v, scale, case["causal"] and n == s)
                         for name, fn in fwd_t.items() if not case["causal"] or n == s})
            for name, out in outs.items():
                c = compare_to_reference(out.astype(np.float32), "softmax", q, k, v,
                                         causal=case["causal"])
                r = float(np.max(c.max_abs / c.tolerance))
                worst[("out", name)] = max(worst.get(("out", name), 0.0), r)
            grads = {"numpy textbook": textbook_backward(q, k, v, do, scale, mask)}
            grads.update({name: fn(q, k, v, do, scale, case["causal"])
                          for name, fn in bwd_t.items() if not case["causal"] or n == s})
            for name, g in grads.items():
                gc = compare_grads({key: x.astype(np.float32) for key, x in g.items()},
                                   "softmax", q, k, v, do, causal=case["causal"])
                for key, item in gc.items.items():
                    r = float(np.max(item.max_abs / item.tolerance))
                    worst[(f"d{key}", name)] = max(worst.get((f"d{key}", name), 0.0), r)
        for (what, impl), r in sorted(worst.items()):
            rows.append({"shape": case["shape"], "sd": case["sd"], "causal": case["causal"],
                         "what": what, "impl": impl, "max_ratio": r,
                         "caught_from": (1.0 / r) if r > 0 else float("inf")})
        top = max(worst.values())
        print(f"{case}: worst ratio {top:.3f}", file=sys.stderr)
    return rows


def write(rows, out: str, seeds: int):
    with open(os.path.join(RESULTS, out + ".json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = [f"# Referee calibration: plain float32 evaluations, {seeds} seeds per case", "",
             "Ratio = max over seeds and heads of error / tolerance (above 1: a false "
             "finding); `caught from` = 1 / ratio, the factor on that evaluation's error "
             "from which the referee catches it (in the seed where it is largest).", "",
             "| shape (b, h, n, s, d) | q, k sd | causal | output | implementation | max "
             "ratio | caught from |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {tuple(r['shape'])} | {r['sd']:g} | {r['causal']} | {r['what']} | "
                     f"{r['impl']} | {r['max_ratio']:.3f} | {r['caught_from']:.1f}x |")
    with open(os.path.join(RESULTS, out + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def shipped_kernels():
    """``(convention, name, kernel)`` of the forms the conventions' authors ship."""
    sys.path.insert(0, os.path.join(os.path.dirname(RESULTS), "..", "tests", "testing",
                                    "check"))
    import shipped as sh
    out = [("flash_attn", "attention_ref", sh.attention_ref),
           ("flash_attn", "attention_ref(upcast=False)",
            sh.with_options(sh.attention_ref, upcast=False)),
           ("flash_attn", "attention_ref(upcast=False, reorder_ops=True)",
            sh.with_options(sh.attention_ref, upcast=False, reorder_ops=True)),
           ("flash_attn_varlen", "attention_ref varlen", sh.attention_ref_varlen),
           ("sdpa", "torch sdpa math", sh.sdpa_backend("math")),
           ("sdpa", "torch sdpa cpu flash", sh.sdpa_backend("flash"))]
    try:
        out += [("sdpa", "hf eager", sh.hf_attention("eager")),
                ("sdpa", "hf sdpa", sh.hf_attention("sdpa"))]
    except ImportError:
        pass
    try:
        refs = sh.fla_simple_gla_refs()
        out += [("fla_simple_gla", "fla naive_chunk_simple_gla", refs["chunk16"]),
                ("fla_simple_gla", "fla naive_recurrent_simple_gla", refs["recurrent"]),
                ("fla_gla", "fla naive_recurrent_gla", sh.fla_gla_recurrent())]
    except ImportError:
        pass
    return out


def run_shipped(seeds: int):
    """Rows of the shipped forms over every catalogue case (see the module docstring)."""
    from dataclasses import replace

    from arrayattn.testing.check.cases import catalogue, reach_catalogue
    from arrayattn.testing.check.conventions import get_convention
    from arrayattn.testing.check.search import Search

    rows = []
    for conv_name, name, fn in shipped_kernels():
        conv = get_convention(conv_name)
        stats = {}
        dtypes = ("float32", "float16", "bfloat16")
        # Hugging Face's eager attention overflows in half past |q.k| = 65504 by design
        skip = ("overflow",) if name == "hf eager" else ()
        cases = [replace(c, dtype=dt) for c in catalogue(conv, dtypes, True, skip)
                 for dt in dtypes]
        cases += reach_catalogue(conv, dtypes, True, skip)   # the value classes, poison
        for seed in range(seeds):
            for case in dict.fromkeys(cases):       # every catalogue case in every dtype
                out = Search(fn, conv).evaluate(conv.normalize(replace(case, seed=seed)))
                if out.verdict is None or out.verdict.error is not None:
                    continue
                for label, c in out.verdict.items:
                    key = (case.dtype, label if label.startswith("d") else label)
                    with np.errstate(divide="ignore", invalid="ignore"):
                        ratio = c.max_abs / c.tolerance
                    ratio = ratio[np.isfinite(ratio) & (c.max_abs > 0)]
                    if ratio.size:
                        stats.setdefault(key, []).extend(ratio.tolist())
        for (dtype, label), ratios in sorted(stats.items()):
            r = np.asarray(ratios)
            rows.append({"convention": conv_name, "kernel": name, "dtype": dtype,
                         "what": label, "heads": int(r.size), "max_ratio": float(r.max()),
                         "median_factor": float(np.median(1 / r)),
                         "caught_everywhere_from": float(1 / r.min())})
        print(f"{conv_name} {name}: worst {max(x['max_ratio'] for x in rows[-len(stats):]):.3f}"
              if stats else f"{conv_name} {name}: no case", file=sys.stderr)
    return rows


def write_shipped(rows, out: str, seeds: int):
    with open(os.path.join(RESULTS, out + "_shipped.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = [f"# Referee calibration: the forms the conventions' authors ship ({seeds} "
             "seeds of each convention's catalogue)", "",
             "The tolerance is the ensemble of plain evaluations (`arrayattn.testing.plain`, "
             "issue #48), every term measured.  Per head: ratio = error / tolerance (above "
             "1: a false finding); the factor on that head's error from which it is caught "
             "is 1 / ratio.  `max ratio`: the worst head (margin = 1 / max ratio); "
             "`median factor`: the median head's; `caught everywhere from`: the largest "
             "(every head of every case is caught with its error multiplied by that).  The "
             "half-precision rows use FlashAttention's same-dtype rule (2x the worst plain "
             "half evaluation); `LESS ACCURATE` heads count with their ratio to it.", "",
             "| convention | kernel | dtype | output | heads | max ratio | median factor | "
             "caught everywhere from |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['convention']} | {r['kernel']} | {r['dtype']} | {r['what']} | "
                     f"{r['heads']} | {r['max_ratio']:.3f} | {r['median_factor']:.1f}x | "
                     f"{r['caught_everywhere_from']:.1f}x |")
    with open(os.path.join(RESULTS, out + "_shipped.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--out", default="referee_calibration")
    ap.add_argument("--shipped-seeds", type=int, default=2)
    ap.add_argument("--skip-plain", action="store_true",
                    help="only the shipped forms' calibration")
    args = ap.parse_args(argv)
    if not args.skip_plain:
        write(run(args.seeds), args.out, args.seeds)
    if args.shipped_seeds:
        write_shipped(run_shipped(args.shipped_seeds), args.out, args.shipped_seeds)


if __name__ == "__main__":
    main()
