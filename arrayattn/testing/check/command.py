"""The ``arrayattn check`` subcommand: its parser and its runner (registered by
:mod:`arrayattn.cli`).  Exit 0: nothing found within the budget; 1: a discrepancy (the
smallest failing case printed, the repro written; also a FLAKY finding, which passed on
re-run); 2: usage."""
from __future__ import annotations

import importlib
import json
import os
import sys

__all__ = ["add_parser", "run_check", "check_writable", "load_kernel"]


def check_writable(label: str, path: str, opener=open) -> None:
    """ValueError unless ``path`` can be written (checked before a run that may take
    minutes): not a directory, its directory exists, and opening it (``opener``) for
    appending works (a file created by the check is removed again)."""
    if os.path.isdir(path):
        raise ValueError(f"{label} {path} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{label} {path}: the directory {parent} does not exist")
    existed = os.path.lexists(path)
    try:
        with opener(path, "a"):
            pass
    except OSError as exc:
        raise ValueError(f"{label} {path}: cannot write there ({exc.strerror or exc}); "
                         "give a writable file name") from None
    if not existed:
        os.remove(path)


def load_kernel(spec: str, what: str = "kernel"):
    """``MODULE:NAME`` (dotted attributes allowed) -> the object; ValueError otherwise.
    ``MODULE`` is looked up in the current directory first."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{what} must be MODULE:NAME (e.g. torch.nn.functional:"
                         f"scaled_dot_product_attention); got {spec!r}")
    # the current directory first, as `python -m` and pytest do (the console script's
    # sys.path starts at its own bin directory)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module)
    except Exception as exc:
        raise ValueError(f"cannot import {module!r}: {type(exc).__name__}: {exc}") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module!r} has no attribute {name!r}")
        obj = getattr(obj, part)
    return obj


def add_parser(sub):
    """Register ``check`` on the subparsers ``sub``."""
    from .conventions import CONVENTIONS

    p = sub.add_parser(
        "check", help="search for a case where a kernel disagrees with the reference",
        description="Run the kernel MODULE:FUNCTION under a calling convention on a fixed "
        "catalogue of edge cases, then random cases (Hypothesis), judge each output, lse, "
        "final state and gradient with the referee of 'validate', and shrink any finding "
        "to the smallest failing case. Exit 0: nothing found within the budget; 1: a "
        "discrepancy or a kernel that raised (the repro file is written; 'arrayattn "
        "validate FILE' judges it alone), FLAKY when the failing case passes on re-run; "
        "2: usage.")
    p.add_argument("kernel", metavar="MODULE:FUNCTION")
    p.add_argument("--convention", required=True, help="one of "
                   f"{', '.join(sorted(CONVENTIONS))}, or MODULE:ADAPTER (a custom adapter)")
    p.add_argument("--budget", type=float, default=60.0, help="seconds (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", action="append", default=None, metavar="D",
                   help="repeatable; default float32 then the half precisions accepted")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-grads", action="store_true", help="judge the forward only")
    p.add_argument("--skip", default="", metavar="OPTION,...", help="options never drawn")
    p.add_argument("--repro", default="check_repro.npz", metavar="FILE.npz",
                   help="where a finding's repro goes (default check_repro.npz)")
    p.add_argument("--max-size", type=int, default=2 ** 24, metavar="ELEMENTS",
                   help="elements of a case's largest tensor (default 2**24; 0: small "
                   "cases only)")
    p.add_argument("--json", default=None, metavar="FILE")
    p.set_defaults(func=run_check)
    return p


def _setup(args):
    from .conventions import CONVENTIONS, get_convention
    from .search import require_hypothesis

    require_hypothesis()
    fn = load_kernel(args.kernel)
    if not callable(fn):
        raise ValueError(f"{args.kernel} is a {type(fn).__name__}, not callable")
    conv = args.convention
    if conv not in CONVENTIONS:
        conv = load_kernel(conv, "--convention") if ":" in conv else conv
    conv = get_convention(conv, args.device)
    if args.max_size < 0:
        raise ValueError(f"--max-size must be >= 0; got {args.max_size}")
    if args.budget <= 0:
        raise ValueError(f"--budget must be > 0; got {args.budget}")
    for dt in args.dtype or ():
        if dt not in ("float64", "float32", "float16", "bfloat16"):
            raise ValueError(f"--dtype {dt!r}: one of float64, float32, float16, bfloat16")
    for label, path in (("--repro", args.repro), ("--json", args.json)):
        if path:
            check_writable(label, path)
    return fn, conv


def run_check(args) -> int:
    """The ``check`` command's runner; its exit code."""
    from .api import check_kernel

    try:
        fn, conv = _setup(args)
    except (ValueError, TypeError, ImportError) as exc:
        print(f"arrayattn check: error: {exc}", file=sys.stderr)
        return 2
    skip = tuple(s.strip() for s in args.skip.split(",") if s.strip())
    res = check_kernel(fn, conv, budget=args.budget, seed=args.seed, dtypes=args.dtype,
                       grads=not args.no_grads, skip=skip, repro=args.repro,
                       max_size=args.max_size,
                       log=lambda text: print(text, file=sys.stderr))
    print(res.summary())
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(_as_json(res), fh, indent=2)
    return 0 if res.ok else 1


def _as_json(res) -> dict:
    from .api import rerun_line

    f = res.failure
    return {"convention": res.convention, "ok": res.ok, "cases": res.cases,
            "seconds": res.seconds, "time_to_finding": res.time_to_finding,
            "dtypes": list(res.dtypes), "unsupported": res.unsupported,
            "worst_ratio": res.worst_ratio,
            "covered": {k: sorted(v) if isinstance(v, set) else v
                        for k, v in res.covered.items()},
            "status": res.status, "flaky": res.flaky,
            "failure": None if f is None else {
                "case": f.case.describe(), "lines": f.verdict.lines(),
                "likely": None if res.explanation is None else res.explanation.likely,
                "deviations": [] if res.explanation is None else res.explanation.names,
                "dimensions": None if res.explanation is None else res.explanation.dims},
            "rerun": None if res.rerun is None or f is None else {
                "fails": not res.flaky,
                "lines": [] if res.rerun.verdict is None else res.rerun.verdict.lines(),
                "text": rerun_line(res.rerun) if res.flaky else "failed again"},
            "repro": res.repro, "validate": res.validate, "notes": list(res.notes)}
