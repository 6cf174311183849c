"""Speed-regression A/B: every registered variant's NumPy forward on two revisions, same run.

    python benchmarks/regress.py                          # e6332e9 against the work tree
    python benchmarks/regress.py --base e6332e9 --head HEAD --sizes 4096 --rounds 4
    python benchmarks/regress.py --names '^(linear|performer)' --sizes 1024 --rounds 2

asv (``benchmarks/asv.conf.json``) benchmarks one revision after the other, minutes apart;
on a shared 2-core machine whose speed drifts by tens of percent within minutes, that
compares the machine's moods as much as the code.  This script measures both sides in one
run, interleaved case by case: for each variant and size, a fresh process on the base
revision and a fresh process on the head, then the other order in the next round
(base/head, head/base, ...), ``--rounds`` times.  Each process times the plain call
``rec(q, k, v)`` and, where the record has ``causal=True``, ``rec(q, k, v, causal=True)``
(the registry record's default options), inputs ``(1, --heads, n, 64)`` float32 standard
normal, seed 0: one warm-up call, then up to ``--calls`` timed calls within ``--budget``
seconds (a case whose warm-up alone takes longer than ``--budget`` is timed by that one
call).  Per side, the best over all calls and rounds; the ratio head/base; a flag where it
exceeds ``--factor`` (1.05, as ``asv continuous -f 1.05``).  Then each flagged case is
measured again, ``--confirm`` more interleaved rounds of up to ``--confirm-calls`` calls a
process (long processes: the first calls' page faults and a drifting machine weigh less),
and stays flagged only where that rerun's best-of ratio exceeds the factor too: on a
machine whose speed moves by 10-40 % within minutes, a one-pass flag was as often noise
as a regression (2026-11-26/27: 11 of 106 rows flagged in one pass, each different from
the previous pass's, all but one within on a long-process rerun).  ``--steady-malloc``
runs both sides with glibc's malloc keeping freed memory (most of that noise was page
faults: a call's temporaries freed back to the system and faulted in again per 4 KiB on
the next call).

Revisions other than the work tree are checked out with ``git worktree add
/tmp/regress_<sha> <sha>`` (removed at the end unless ``--keep``; an existing checkout
of the same commit there is reused and kept; ``--checkouts`` names another folder than
``/tmp``) and imported through ``PYTHONPATH``; each
child checks that ``arrayattn`` came from its checkout.

Writes ``<out>/regress.md`` and ``<out>/regress.json`` (``--out``, default
``benchmarks/results``).  Exit status 1 where a case is flagged, 0 otherwise (2 on an
error of the script itself).  Uses only public API present in both revisions
(``arrayattn.variants()``, ``get_variant``, the record's call and ``.causal``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_BASE = "e6332e9"

_LIST = r"""
import json, os, sys
import arrayattn
print(json.dumps({"file": os.path.realpath(arrayattn.__file__),
                  "causal": {r.name: bool(r.causal) for r in arrayattn.variants()}}))
"""

_CHILD = r"""
import json, os, sys, time
spec = json.loads(sys.argv[1])
import numpy as np
import arrayattn
names = {r.name for r in arrayattn.variants()}
out = {"file": os.path.realpath(arrayattn.__file__), "numpy": np.__version__, "cases": {}}
for name, n, causal in spec["cases"]:
    key = f"{name}|{n}|{int(causal)}"
    if name not in names:
        out["cases"][key] = {"skip": "not registered"}
        continue
    rec = arrayattn.get_variant(name)
    if causal and not rec.causal:
        out["cases"][key] = {"skip": "no causal form"}
        continue
    rng = np.random.default_rng(spec["seed"])
    q, k, v = (rng.standard_normal((1, spec["heads"], n, 64), dtype=np.float32)
               for _ in range(3))
    opts = {"causal": True} if causal else {}
    try:
        start = time.perf_counter()
        rec(q, k, v, **opts)
        first = time.perf_counter() - start
        if first >= spec["budget"]:
            times = [first]
        else:
            times = []
            while not times or (len(times) < spec["calls"]
                                and time.perf_counter() - start < spec["budget"]):
                t0 = time.perf_counter()
                rec(q, k, v, **opts)
                times.append(time.perf_counter() - t0)
        out["cases"][key] = {"seconds": times, "malloc": os.environ.get("GLIBC_TUNABLES", "")}
    except Exception as exc:  # reported per case; the other cases go on
        out["cases"][key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    del q, k, v
print("REGRESS_RESULT " + json.dumps(out))
"""


#: glibc's malloc told to keep freed memory (allocations up to 32 MiB from the heap, no
#: trim below 256 MiB): a call's temporaries are then the previous call's pages, not fresh
#: ones that fault in per 4 KiB (see docs/conventions.rst, *Memory between calls*).
STEADY_MALLOC = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456"

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def _git(*args: str, cwd: str = ROOT) -> str:
    return subprocess.run(["git", "-C", cwd, *args], capture_output=True, text=True,
                          check=True).stdout.strip()


class Checkout:
    """A revision on disk: the work tree itself, or ``/tmp/regress_<sha>``."""

    def __init__(self, rev: str | None, keep: bool = False, parent: str = "/tmp"):
        self.rev = rev
        self.created = False
        self.keep = keep
        if rev is None:
            self.path = ROOT
            self.sha = _git("rev-parse", "HEAD")
            dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
            self.label = f"work tree at {self.sha[:9]}" + (" + uncommitted changes" if dirty
                                                            else "")
            return
        self.sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
        self.path = os.path.join(parent, f"regress_{self.sha[:7]}")
        self.label = f"{self.sha[:9]} ({_git('log', '-1', '--format=%s', self.sha)[:60]})"
        if os.path.isdir(self.path):
            try:
                there = _git("rev-parse", "HEAD", cwd=self.path)
            except subprocess.CalledProcessError:
                there = None
            if there != self.sha:
                raise SystemExit(f"{self.path} exists and is not a checkout of {self.sha}; "
                                 "remove it (git worktree remove --force PATH)")
            return  # reused, and left in place
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", self.path,
                        self.sha], check=True)
        self.created = True

    def close(self):
        if self.created and not self.keep:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", self.path],
                           check=False)
            self.created = False

    def python(self, code: str, *args: str, timeout: float | None = None,
               threads: int | None = None, steady_malloc: bool = False):
        env = dict(os.environ, PYTHONPATH=self.path)
        if threads:
            for var in _THREAD_VARS:
                env[var] = str(threads)
        if steady_malloc:
            env["GLIBC_TUNABLES"] = STEADY_MALLOC
        res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                             text=True, cwd=self.path, env=env, timeout=timeout)
        return res

    def check_file(self, path: str):
        if not path.startswith(os.path.realpath(self.path) + os.sep):
            raise SystemExit(f"arrayattn came from {path}, not from {self.path}: "
                             "something on sys.path shadows PYTHONPATH")


def _listing(side: Checkout) -> dict:
    res = side.python(_LIST)
    if res.returncode:
        raise SystemExit(f"importing arrayattn from {side.path} failed:\n{res.stderr[-2000:]}")
    data = json.loads(res.stdout.strip().splitlines()[-1])
    side.check_file(data["file"])
    return data["causal"]


def _measure(side: Checkout, cases: list, args, calls: int) -> dict:
    spec = {"cases": cases, "heads": args.heads, "calls": calls,
            "budget": args.budget, "seed": 0}
    try:
        res = side.python(_CHILD, json.dumps(spec), timeout=args.timeout,
                          threads=args.threads, steady_malloc=args.steady_malloc)
    except subprocess.TimeoutExpired:
        return {f"{c[0]}|{c[1]}|{int(c[2])}": {"error": f"timeout after {args.timeout} s"}
                for c in cases}
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("REGRESS_RESULT ")]
    if res.returncode or not lines:
        why = f"child exited {res.returncode}: {res.stderr.strip()[-300:]}"
        return {f"{c[0]}|{c[1]}|{int(c[2])}": {"error": why} for c in cases}
    data = json.loads(lines[-1][len("REGRESS_RESULT "):])
    side.check_file(data["file"])
    return data["cases"]


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}"


def _fmt_ms(x):
    return "n/a" if x is None else f"{x * 1e3:.1f}"


def _fmt_ratio(x):
    return "n/a" if x is None else f"{x:.3f}"


def _rounds(sides: dict, groups: list, rounds: int, calls: int, args, t_start) -> dict:
    """``rounds`` interleaved rounds over the case ``groups``: per group a fresh process
    per side, the sides' order alternating; ``{side: {case key: [result per round]}}``."""
    raw = {"base": {}, "head": {}}
    for r in range(rounds):
        order = ("base", "head") if r % 2 == 0 else ("head", "base")
        for cases in groups:
            for side in order:
                for key, res in _measure(sides[side], cases, args, calls).items():
                    raw[side].setdefault(key, []).append(res)
                    if "error" in res:
                        print(f"  {side} {key}: {res['error']}", file=sys.stderr)
        print(f"round {r + 1}/{rounds} done ({time.perf_counter() - t_start:.0f} s)",
              file=sys.stderr)
    return raw


def _rows(groups: list, raw: dict, factor: float) -> list:
    """Per case: each side's best time over all calls and rounds and its per-round bests,
    the best-of ratio head/base, the median of the per-round ratios (*paired*) and the
    flag (ratio above ``factor``)."""
    rows = []
    for cases in groups:
        for nm, n, causal in cases:
            key = f"{nm}|{n}|{int(causal)}"
            row = {"variant": nm, "n": n, "causal": causal}
            for side in ("base", "head"):
                res = raw[side].get(key, [])
                secs = [t for x in res for t in x.get("seconds", [])]
                row[side] = min(secs) if secs else None
                row[side + "_rounds"] = [min(x["seconds"]) for x in res if x.get("seconds")]
                why = next((x.get("skip") or x.get("error") for x in res
                            if "skip" in x or "error" in x), None)
                if why:
                    row[side + "_note"] = why
            pairs = [h / b for b, h in zip(row["base_rounds"], row["head_rounds"])]
            row["paired"] = sorted(pairs)[len(pairs) // 2] if pairs else None
            row["ratio"] = row["head"] / row["base"] if row["base"] and row["head"] else None
            row["flag"] = row["ratio"] is not None and row["ratio"] > factor
            rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=DEFAULT_BASE,
                    help=f"the old revision (default {DEFAULT_BASE})")
    ap.add_argument("--head", default=None,
                    help="the new revision (default: the work tree, uncommitted changes "
                         "included)")
    ap.add_argument("--sizes", default="4096,16384", help="comma-separated n")
    ap.add_argument("--names", default="", help="regex (re.search) on variant names")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds, each a fresh process per side and case group")
    ap.add_argument("--calls", type=int, default=3, help="timed calls per process at most")
    ap.add_argument("--budget", type=float, default=5.0,
                    help="seconds per case and process after which no further call starts")
    ap.add_argument("--confirm", type=int, default=4,
                    help="rounds of the rerun of each flagged case (0: no rerun)")
    ap.add_argument("--confirm-calls", type=int, default=20,
                    help="timed calls per process at most in the rerun")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--factor", type=float, default=1.05,
                    help="flag head/base above this ratio")
    ap.add_argument("--no-causal", action="store_true", help="plain calls only")
    ap.add_argument("--threads", type=int, default=None,
                    help="set OMP/OPENBLAS/MKL_NUM_THREADS in the children (default: "
                         "inherit; 1 steadies the numbers on a loaded machine, but then a "
                         "change in multi-threaded BLAS use goes unseen)")
    ap.add_argument("--steady-malloc", action="store_true",
                    help="run both sides' children with glibc's malloc keeping freed memory "
                         "(GLIBC_TUNABLES, see STEADY_MALLOC): the page faults of fresh "
                         "temporaries, 20-50 %% of many calls here and most of the noise "
                         "between runs, are left out; a change that allocates more per call "
                         "shows only without it (or in asv's peakmem)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per process")
    ap.add_argument("--out", default=os.path.join(HERE, "results"),
                    help="folder for regress.md and regress.json")
    ap.add_argument("--keep", action="store_true", help="keep the regress_<sha> checkouts")
    ap.add_argument("--checkouts", default="/tmp",
                    help="folder of the regress_<sha> checkouts (default /tmp)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    pattern = re.compile(args.names)

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = os.getloadavg()[0]
    t_start = time.perf_counter()
    sides = {}
    try:
        sides["base"] = Checkout(args.base, args.keep, args.checkouts)
        sides["head"] = Checkout(args.head, args.keep, args.checkouts)
        causal_of = {s: _listing(c) for s, c in sides.items()}
        names = [nm for nm in causal_of["head"] if pattern.search(nm)]
        names += [nm for nm in causal_of["base"] if pattern.search(nm) and nm not in names]
        if not names:
            print(f"no variant matches {args.names!r}", file=sys.stderr)
            return 2
        groups = []  # one process per side, round and (variant, n)
        for nm in names:
            can_causal = causal_of["head"].get(nm, causal_of["base"].get(nm, False))
            for n in sizes:
                groups.append([(nm, n, False)] + ([(nm, n, True)] if can_causal
                                                  and not args.no_causal else []))
        raw = _rounds(sides, groups, args.rounds, args.calls, args, t_start)
        rows = _rows(groups, raw, args.factor)
        flagged_cases = {(r["variant"], r["n"], r["causal"]) for r in rows if r["flag"]}
        again = [[c for c in cases if c in flagged_cases] for cases in groups]
        again = [cases for cases in again if cases]
        confirm_raw = None
        if again and args.confirm > 0:
            print(f"rerun of {sum(map(len, again))} flagged case(s)", file=sys.stderr)
            confirm_raw = _rounds(sides, again, args.confirm, args.confirm_calls, args,
                                  t_start)
            rerun = {(r["variant"], r["n"], r["causal"]): r
                     for r in _rows(again, confirm_raw, args.factor)}
            for row in rows:
                second = rerun.get((row["variant"], row["n"], row["causal"]))
                if second is not None:
                    row["rerun"], row["rerun_paired"] = second["ratio"], second["paired"]
                    row["rerun_base"], row["rerun_head"] = second["base"], second["head"]
                    if second["ratio"] is not None:   # a rerun that failed keeps the flag
                        row["flag"] = second["flag"]
    finally:
        for c in sides.values():
            c.close()

    flagged = [r for r in rows if r["flag"]]
    reruns = any("rerun" in r for r in rows)
    head_label = sides["head"].label
    lines = [
        "# Speed-regression A/B (benchmarks/regress.py)", "",
        f"Base = {sides['base'].label}; head = {head_label}.",
        f"NumPy engine, registry records' default options, inputs (1, {args.heads}, n, 64) "
        "float32 N(0, 1), seed 0.  Per side: best over "
        f"{args.rounds} interleaved rounds (fresh process per side, case group and round, "
        f"order alternating), each a warm-up call plus up to {args.calls} timed calls "
        f"within {args.budget:g} s.  *paired*: the median over rounds of the "
        "ratio of the two sides' back-to-back processes (a check on the best-of ratio when "
        "the machine drifts).  BLAS threads: "
        f"{args.threads or 'inherited'}.  malloc: "
        + ("steady (GLIBC_TUNABLES keeps freed memory: no page faults of fresh "
           "temporaries)" if args.steady_malloc else "glibc's defaults") +
        f".  Flag: head/base > {args.factor:g}.",
        f"Machine: {_machine()}; load average {load_start:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end; {started}, "
        f"{time.perf_counter() - t_start:.0f} s.", "",
        f"**{len(flagged)} of {sum(r['ratio'] is not None for r in rows)} cases flagged**"
        + (f" ({sum('rerun' in r for r in rows)} over {args.factor:g} in the first pass, "
           f"rerun: {args.confirm} rounds of up to {args.confirm_calls} calls a process; "
           "*rerun*: its best-of ratio / paired)." if reruns else "."),
        "", "| variant | n | causal | base ms | head ms | head/base | paired | "
        + ("rerun | " if reruns else "") + "flag |",
        "|---|---:|---|---:|---:|---:|---:|" + ("---:|" if reruns else "") + "---|"]
    for r in rows:
        note = r.get("head_note") or r.get("base_note") or ""
        flag = "**SLOWER**" if r["flag"] else note
        rerun = ""
        if reruns:
            rerun = (f"{_fmt_ratio(r['rerun'])} / {_fmt_ratio(r['rerun_paired'])} | "
                     if "rerun" in r else " | ")
        lines.append(f"| {r['variant']} | {r['n']} | {'yes' if r['causal'] else 'no'} | "
                     f"{_fmt_ms(r['base'])} | {_fmt_ms(r['head'])} | {_fmt_ratio(r['ratio'])} "
                     f"| {_fmt_ratio(r['paired'])} | {rerun}{flag} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "regress.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(args.out, "regress.json"), "w") as fh:
        json.dump({"base": sides["base"].sha, "base_label": sides["base"].label,
                   "head": sides["head"].sha, "head_label": head_label,
                   "factor": args.factor, "rounds": args.rounds, "calls": args.calls,
                   "confirm": args.confirm, "confirm_calls": args.confirm_calls,
                   "confirm_raw": confirm_raw,
                   "budget": args.budget, "heads": args.heads, "sizes": sizes,
                   "threads": args.threads, "steady_malloc": args.steady_malloc,
                   "machine": _machine(), "started": started, "rows": rows,
                   "raw": raw}, fh, indent=1)
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
