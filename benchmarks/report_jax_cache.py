"""What ``arrayattn report --backend jax`` costs without its compiles (issue #26, point 3).

    python benchmarks/report_jax_cache.py [--rounds 2] [--variants gla,lsh]

Runs the CLI's default JAX report in fresh processes, in rounds of three:

* ``cold``: as a user runs it (JAX's persistent compilation cache off);
* ``fills the cache``: the same with JAX's persistent compilation cache on, in a new
  directory, every program written to it (``JAX_COMPILATION_CACHE_DIR`` and
  ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0``: by default JAX keeps only programs
  that took a second or more to compile);
* ``from the cache``: again on that directory: every program is read back, none is
  compiled.  Its time is everything the report does but XLA's compiles (start-up, tracing
  and lowering, which make the cache's key, the calls, the host's float64 references):
  no change to how the programs compile can bring the report below it on this machine.

Per run: wall seconds, CPU seconds and peak resident memory of the process, and whether
its error columns (relative error, matrix error, row-sum deviation) equal the first
cold run's.  Writes ``benchmarks/results/report_jax_cache.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

CACHE_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
ERRORS = ("rel_error", "matrix_error", "row_sum_dev")


def run_report(cache: str | None, json_path: str, variants: str | None = None) -> dict:
    """One ``arrayattn report --backend jax`` process: wall s, CPU s, peak RSS, rows."""
    env = {key: val for key, val in os.environ.items() if key not in CACHE_ENV}
    if cache is not None:
        env.update(zip(CACHE_ENV, (cache, "0")))
    cmd = [sys.executable, "-m", "arrayattn", "report", "--backend", "jax", "--quiet",
           "--json", json_path] + (["--variants", variants] if variants else [])
    with tempfile.TemporaryFile("w+") as log:      # a file: a pipe could fill and block
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
        _, status, usage = os.wait4(proc.pid, 0)   # this child's own usage
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)   # reaped here, not by Popen
        if proc.returncode != 0:
            log.seek(0)
            raise RuntimeError(f"report failed: {log.read()[-2000:]}")
    with open(json_path) as fh:
        rows = json.load(fh)["rows"]
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_gb": usage.ru_maxrss * 1024 / 1e9,
            "errors": {(r["variant"], r["case"]): tuple(r.get(e) for e in ERRORS)
                       for r in rows}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default=None,
                   help="comma-separated registry names (default: the whole report)")
    p.add_argument("--out", default="report_jax_cache")
    args = p.parse_args(argv)

    import jax

    from _measure import machine, write_results

    rows, first = [], None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        for r in range(args.rounds):
            cache = os.path.join(tmp, f"cache{r}")
            for run, where in (("cold", None), ("fills the cache", cache),
                               ("from the cache", cache)):
                res = run_report(where, out, args.variants)
                first = first or res["errors"]
                row = {"round": r + 1, "run": run, "wall_s": res["wall_s"],
                       "cpu_s": res["cpu_s"], "peak_gb": res["peak_gb"],
                       "cache_entries": len(os.listdir(cache)) if where else "",
                       "errors_identical": res["errors"] == first}
                rows.append(row)
                print(f"round {r + 1} {run:16s} {row['wall_s']:6.1f} s wall "
                      f"{row['cpu_s']:6.1f} s CPU {row['peak_gb']:.2f} GB "
                      f"identical={row['errors_identical']}", flush=True)
    meta = {"machine": machine(), "jax": jax.__version__,
            "command": "python -m arrayattn report --backend jax --quiet --json FILE"
                       + (f" --variants {args.variants}" if args.variants else ""),
            "cache_env": dict(zip(CACHE_ENV, ("<a new directory per round>", "0")))}
    columns = [("round", "round"), ("run", "run"), ("wall_s", "wall s"),
               ("cpu_s", "CPU s"), ("peak_gb", "peak GB"),
               ("cache_entries", "cache entries"),
               ("errors_identical", "errors identical to the first run")]
    print(write_results(args.out, rows, columns, meta))


if __name__ == "__main__":
    main()
