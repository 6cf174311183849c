"""The ``arrayattn`` command line (also ``python -m arrayattn``)."""
from __future__ import annotations

import argparse
import sys


def _report(args) -> int:
    from .report import Workload, format_table, run_report

    w = Workload(batch=args.batch, heads=args.heads, n=args.n, d=args.d, dtype=args.dtype,
                 seed=args.seed)
    names = None if not args.variants else args.variants.split(",")
    print(f"arrayattn report: batch={w.batch} heads={w.heads} n={w.n} d={w.d} "
          f"dtype={w.dtype} seed={w.seed} backend=numpy", file=sys.stderr)
    print(format_table(run_report(w, names)))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="arrayattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="run every registered variant on a default workload")
    rep.add_argument("--n", type=int, default=1024)
    rep.add_argument("--d", type=int, default=64)
    rep.add_argument("--heads", type=int, default=4)
    rep.add_argument("--batch", type=int, default=1)
    rep.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    rep.add_argument("--seed", type=int, default=0)
    rep.add_argument("--variants", default="", help="comma-separated registry names")
    rep.set_defaults(func=_report)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
