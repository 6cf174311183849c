"""``jax.jit`` compile time and run time of every registered variant (issue #26).

    python benchmarks/jit_compile.py [--variants gla,ssd] [--sizes 1024,4096,16384]
                                     [--heads 8] [--d 64] [--timeout 300] [--repeats 3]

Per variant and ``n``: the uniform call ``rec(q, k, v)`` (``causal=True`` where the
record supports it -- that is where the chunked and recurrent loops are) on
``(1, heads, n, d)`` float32 inputs on the CPU, under ``jax.jit`` as
:class:`arrayattn.jit_uniform` compiles it (the gates the gated records draw are
arguments, as in a training step, not constants of the program): lowering seconds,
XLA compile seconds (wall, and CPU seconds of the process: XLA compiles
on one thread mostly, so on a loaded machine the CPU seconds are near what an idle one
takes), the run time (median of ``--repeats`` calls after the first), the
lowered program's operation count and the number of XLA "constant folding" alarms.
Each configuration runs in a fresh subprocess (compile caches and peak memory are its
own; ``--timeout`` bounds it).  A reference configuration, dense softmax at the first
size, is measured too: on a shared machine the compile times scale with the load, and
``compile / ref`` is the load-free figure.

Writes ``benchmarks/results/jit_compile.{json,md}`` (``--out`` for another path stem;
a bare name goes to ``benchmarks/results/``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

_ALARM = re.compile(r"constant folding", re.IGNORECASE)


def op_count(text: str) -> int:
    """Operations of a lowered (StableHLO) program: the lines that define or run one."""
    return sum(1 for line in text.splitlines()
               if re.search(r"= (stablehlo|chlo|mhlo|func)\.|^\s*(stablehlo|func)\.", line))


def measure_one(name: str, n: int, heads: int, d: int, repeats: int,
                compile_repeats: int = 2) -> dict:
    """One configuration, in this process: the fastest of ``compile_repeats`` compiles
    (a busy machine only ever slows one down)."""
    import resource
    import statistics

    import numpy as np
    import jax

    import arrayattn as aa

    rec = aa.get_variant(name)
    opts = {"causal": True} if rec.causal else {}
    rng = np.random.default_rng(0)
    q, k, v = (jax.numpy.asarray(0.3 * rng.standard_normal((1, heads, n, d)), jax.numpy.float32)
               for _ in range(3))
    best = None
    for _ in range(compile_repeats):      # a fresh jax.jit each time: no cache hit
        fn = aa.jit_uniform(rec, jax.jit, **opts)
        t0 = time.perf_counter()
        lowered = fn.lower(q, k, v)
        t1, c1 = time.perf_counter(), time.process_time()
        compiled = lowered.compile()
        t2, c2 = time.perf_counter(), time.process_time()
        if best is None or t2 - t1 < best[1]:
            best = (t1 - t0, t2 - t1, c2 - c1)
    args = (q, k, v, fn.drawn(q))
    compiled(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        compiled(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return {"variant": name, "n": n, "causal": bool(opts), "lower_s": best[0],
            "compile_s": best[1], "compile_cpu_s": best[2],
            "run_ms": 1e3 * statistics.median(times), "ops": op_count(lowered.as_text()),
            "loops": compiled.as_text().count(" while("),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_config(name: str, n: int, args) -> dict:
    """One configuration in a subprocess; stderr scanned for constant-folding alarms."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name, str(n),
           "--heads", str(args.heads), "--d", str(args.d), "--repeats", str(args.repeats),
           "--compile-repeats", str(args.compile_repeats)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    t = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env=env)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return {"variant": name, "n": n, "error": f"timeout after {args.timeout} s",
                "alarms": len(_ALARM.findall(err)) // 2}
    alarms = len(_ALARM.findall(done.stderr)) // 2   # each alarm is logged twice
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1][:200]
        return {"variant": name, "n": n, "error": f"exit {done.returncode}: {tail}",
                "alarms": alarms}
    row = json.loads(lines[-1])
    row.update(alarms=alarms, wall_s=time.perf_counter() - t)
    return row


def _cell(row: dict | None, ref: float | None) -> str:
    if row is None:
        return ""
    if "error" in row:
        return row["error"]
    cell = (f"{row['compile_s']:.2f} s ({row['compile_cpu_s']:.2f} cpu), "
            f"{row['run_ms']:.3g} ms")
    if ref:
        cell += f" ({row['compile_s'] / ref:.1f}x)"
    return cell + (f", {row['alarms']} alarms" if row.get("alarms") else "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="", help="comma-separated names (default: all)")
    ap.add_argument("--sizes", default="1024,4096,16384")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile-repeats", type=int, default=2,
                    help="compiles per configuration, the fastest kept")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "jit_compile"))
    ap.add_argument("--one", nargs=2, metavar=("VARIANT", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one[0], int(args.one[1]), args.heads, args.d,
                                     args.repeats, args.compile_repeats)))
        return
    import arrayattn as aa
    from _measure import machine

    names = [v for v in args.variants.split(",") if v] or [r.name for r in aa.variants()]
    sizes = [int(x) for x in args.sizes.split(",")]
    ref = run_config("softmax", sizes[0], args)
    ref_s = ref.get("compile_s")
    print(f"reference: softmax n={sizes[0]} compile {ref_s} s", flush=True)
    rows = []
    for name in names:
        for n in sizes:
            row = run_config(name, n, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"machine": machine(), "workload": f"(1, {args.heads}, n, {args.d}) float32, "
            "CPU, uniform call, causal=True where supported", "sizes": sizes,
            "reference_compile_s": ref_s, "compile_repeats": args.compile_repeats,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(write_tables(args.out, meta, ref, rows, names))


def write_tables(out: str, meta: dict, ref: dict, rows: list, names: list) -> str:
    """``<out>.json`` and ``<out>.md`` (a bare name goes to ``benchmarks/results/``);
    the Markdown table."""
    if not os.path.dirname(out):
        out = os.path.join(HERE, "results", out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as fh:
        json.dump({"meta": meta, "reference": ref, "rows": rows}, fh, indent=2)
    sizes, ref_s = meta["sizes"], meta["reference_compile_s"]
    by = {(r["variant"], r["n"]): r for r in rows}
    lines = [f"Machine: {meta['machine'].get('cpu', '?')}, {meta['machine'].get('cpus')} "
             f"cores, load average {tuple(round(x, 1) for x in meta['machine'].get('load_average', ()))}; jax.jit on the "
             f"CPU, {meta['workload']}.  Reference: dense softmax at n = {sizes[0]} "
             + (f"compiles in {ref_s:.2f} s here; (Nx) = compile time / that." if ref_s
                else f"did not compile here ({ref.get('error', '?')[:80]})."), "",
             "Each cell: XLA compile seconds (wall, and CPU seconds; the fastest of "
             f"{meta['compile_repeats']} compiles), run milliseconds (median), (wall compile / "
             "reference), constant-folding alarms if any.  ops: operations of the lowered "
             "program; loops: while loops XLA keeps in the compiled one (it inlines a "
             "loop that runs once).", "",
             "| variant | ops | loops | " + " | ".join(f"n={n}" for n in sizes) + " | "
             f"compile n={sizes[-1]} / n={sizes[0]} |",
             "|---|---|---|" + "---|" * len(sizes) + "---|"]
    for name in names:
        cells = [_cell(by.get((name, n)), ref_s) for n in sizes]
        first, last = by.get((name, sizes[0]), {}), by.get((name, sizes[-1]), {})
        ratio = (f"{last['compile_s'] / first['compile_s']:.2f}"
                 if "compile_s" in first and "compile_s" in last else "")
        ops = "/".join(str(by.get((name, n), {}).get("ops", "-")) for n in sizes)
        loops = "/".join(str(by.get((name, n), {}).get("loops", "-")) for n in sizes)
        lines.append(f"| {name} | {ops} | {loops} | " + " | ".join(cells) + f" | {ratio} |")
    with open(out + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
