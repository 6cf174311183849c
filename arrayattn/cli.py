"""The ``arrayattn`` command line (also ``python -m arrayattn``).

``arrayattn report``   every registered variant on a default workload, one row each;
``arrayattn validate`` compare another implementation's output (an ``.npz`` file) with
                       the float64 reference, per head.
``arrayattn check``    search for a case where a kernel disagrees with the reference
                       (a catalogue of edge cases, random cases, shrinking).
``arrayattn conformance`` the checker on every attention kernel here: a Markdown table.

Exit codes of ``validate``: 0 match, 1 mismatch, 2 usage error or malformed file.
"""
from __future__ import annotations

import argparse
import math
import sys
import zipfile

__all__ = ["UsageError", "parse_option", "load_npz", "run_validate", "main", "read_meta"]

# the file's options, repro metadata and printed lines (kept importable from here)
from .testing.validate_io import (MAX_OPTION, META, UsageError, key_columns,  # noqa: E402,F401
                                  parse_option,
                                  print_output_verdict, print_raised, read_meta,
                                  shown_value, with_meta)

REQUIRED = ("q", "k", "v", "out")
#: Largest array an .npz file may claim (its header is read before the array).
MAX_BYTES = 2**33


_SAVE = "save with numpy.savez(path, q=q, k=k, v=v, out=out)"
#: File arrays that must hold integers (offsets, page indices, lengths) or booleans; every
#: array keeps its dtype (an integer array is never converted to floating).
KINDS = {"cu_seqlens_q": "iu", "cu_seqlens_k": "iu", "block_table": "iu",
         "cache_seqlens": "iu", "dropout_mask": "b"}
#: Options that are arrays: they come from the file, never from ``--option``.
ARRAY_OPTIONS = ("key_mask", "mask", "bias", "query_mask", "omega", "e", "f",
                 "alibi_slopes", *KINDS)


def _read_npz(path: str) -> dict:
    """Every array of the ``.npz`` file ``path``, as saved; UsageError if it is none."""
    import numpy as np

    try:
        with open(path, "rb") as fh:
            magic = fh.read(6)
    except OSError as exc:
        raise UsageError(f"{path}: cannot open ({exc.strerror or exc})") from None
    if magic == b"\x93NUMPY":
        raise UsageError(f"{path} is a single .npy array, not an .npz archive; {_SAVE}")
    if not magic.startswith(b"PK"):
        raise UsageError(f"{path} is not an .npz file (no zip signature at its start); {_SAVE}")
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise UsageError(f"{path} is not a readable .npz file ({type(exc).__name__}: "
                         f"{exc})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise UsageError(f"{path} is a single .npy array, not an .npz archive; {_SAVE}")
    try:
        for name in data.files:     # sizes from the headers, before anything is loaded
            with data.zip.open(name + ".npy") as member:
                version = np.lib.format.read_magic(member)
                read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                        else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read(member)
            size = math.prod(shape) * dtype.itemsize
            if size > MAX_BYTES:
                raise UsageError(f"{path}: {name} claims shape {shape} of {dtype} "
                                 f"({size / 2**30:.3g} GiB), more than the {MAX_BYTES / 2**30:.0f} "
                                 "GiB a validation here may load")
        return {name: data[name] for name in data.files}
    except MemoryError:
        raise UsageError(f"{path}: its arrays do not fit in memory") from None
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise UsageError(f"{path}: an array cannot be read ({type(exc).__name__}: "
                         f"{exc})") from None
    finally:
        data.close()


def load_npz(path: str) -> dict:
    """The arrays of ``path`` (an ``.npz`` with at least q, k, v, out), each in its saved
    dtype; UsageError if not, or if an array named in :data:`KINDS` has another kind."""
    return _check_arrays(path, _read_npz(path))


def _check_arrays(path: str, arrays: dict) -> dict:
    """``arrays`` if they hold q, k, v, out of the right kinds; UsageError otherwise."""
    required = REQUIRED[:3] if "do" in arrays else REQUIRED   # gradients alone: no out
    missing = [name for name in required if name not in arrays]
    if missing:
        raise UsageError(f"{path} lacks array(s) {', '.join(missing)}; it holds "
                         f"{', '.join(sorted(arrays)) or 'nothing'} (required: "
                         f"{', '.join(REQUIRED)}; out may be left out beside do)")
    for name in required:
        a = arrays[name]
        if a.dtype.kind != "f":
            raise UsageError(f"{path}: {name} must be a floating array; got dtype {a.dtype}")
        if a.ndim < 2:
            raise UsageError(f"{path}: {name} must have shape (..., tokens, features); got "
                             f"{a.shape}")
    for name in sorted(set(KINDS) & set(arrays)):
        if arrays[name].dtype.kind not in KINDS[name]:
            what = "a boolean" if KINDS[name] == "b" else "an integer"
            raise UsageError(f"{path}: {name} must be {what} array; got dtype "
                             f"{arrays[name].dtype}")
    return arrays


def _check_flags(variant, profile, options, rtol, factor, path=None, meta=None) -> tuple:
    """``(the registry record or None, the --option values)``; UsageError on bad flags."""
    from .registry import get_variant

    if variant is None and profile is None:
        raise UsageError("give --variant, or --profile (which names the variant)"
                         + (f"; {path} holds no {META} naming them (arrayattn check's "
                            "repro files do)" if path is not None and not meta else ""))
    for flag, value in (("--rtol", rtol), ("--factor", factor)):
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise UsageError(f"{flag} must be a finite number >= 0; got {value}")
    rec = None if variant is None else get_variant(variant)
    params = dict(parse_option(o) for o in options)
    for key in ARRAY_OPTIONS:
        if params.get(key) is not None:
            raise UsageError(f"--option {key}=... gives a {type(params[key]).__name__}; "
                             f"{key} is an array: store it in the .npz file instead")
    for key, val in params.items():
        if isinstance(val, (int, float)) and not isinstance(val, bool) \
                and abs(val) > MAX_OPTION:
            raise UsageError(f"--option {key}={val} is larger than any attention "
                             f"computation here could use (limit {MAX_OPTION:.0e})")
    return rec, params


def _read_problem(path, rec, profile, params, err, arrays=None) -> tuple[dict, dict, dict]:
    """``(q, k, v, out; do, gradients, lse; the options)`` of the file (or of its
    ``arrays`` already read), other arrays joined to ``params``; UsageError if it does not
    fit the flags (``do, lse, d<x>`` judged apart)."""
    arrays = load_npz(path) if arrays is None else _check_arrays(path, arrays)
    training = {key: arrays.pop(key) for key in list(arrays) if key in (
        "do", "lse", "final_state") or (key.startswith("d") and key[1:] in arrays)}
    grads = [key for key in training if key not in ("do", "lse", "final_state")]
    if grads and "do" not in training:
        raise UsageError(f"{path} holds gradient(s) {', '.join(grads)} but no 'do' (the "
                         "output cotangent they were computed with)")
    extra = {name: int(a) if a.ndim == 0 and a.dtype.kind in "iu" else a   # np.savez(seed=3)
             for name, a in arrays.items() if name not in REQUIRED}   # 0-d int: the int
    clash = sorted(set(extra) & set(params))
    if clash:
        raise UsageError(f"option(s) {', '.join(clash)} given both in {path} and with "
                         "--option")
    if rec is not None and rec.random and not extra and profile is None:
        print(f"note: {rec.name} is random and {path} holds no random matrix; the "
              "reference draws its own from the seed option", file=err)
    return arrays, training, {**params, **extra}


def _compare(path, rec, arrays, params, rtol, layout, profile):
    """The output's :class:`~arrayattn.testing.Comparison`; UsageError when the reference
    cannot run on the file (shapes, dtypes, options it rejects, or anything it raised)."""
    from .testing import compare_to_reference
    from .testing.hints import layout_hint

    try:
        return compare_to_reference(arrays["out"], rec, arrays["q"], arrays["k"],
                                    arrays["v"], rtol=rtol, layout=layout, profile=profile,
                                    **params)
    except (ValueError, TypeError) as exc:  # shapes, dtypes, options the variant rejects
        hint = layout_hint(rec, arrays, params, rtol, layout, profile)
        raise UsageError(f"{path}: {exc}" + (f"\n{hint}" if hint else "")) from None
    except Exception as exc:  # anything else the reference raised on these inputs
        name = rec.name if rec is not None else f"of profile {profile}"
        raise UsageError(f"{path}: the reference {name} raised "
                         f"{type(exc).__name__}: {exc}") from None


def run_validate(path: str, variant, options=(), *, rtol=None, out=None,
                 err=None, layout=None, profile=None, rule=None, factor=2.0) -> int:
    """The ``validate`` command: print the per-head table and the verdict; exit code."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    try:
        arrays = _read_npz(path)
        meta = read_meta(path, arrays)
        variant, profile, layout, options = with_meta(meta, variant, profile, layout,
                                                      options)
        rec, params = _check_flags(variant, profile, options, rtol, factor, path, meta)
        if meta.get("error") is not None and "out" not in arrays:
            return print_raised(path, meta, arrays, params, variant, profile, out)
        arrays, training, params = _read_problem(path, rec, profile, params, err, arrays)
        c = _compare(path, rec, arrays, params, rtol, layout, profile) \
            if "out" in arrays else None
    except (UsageError, ValueError) as exc:  # ValueError: an unknown variant or profile
        print(f"arrayattn validate: error: {exc}", file=err)
        return 2
    if c is not None:
        print_output_verdict(path, c, rec, arrays, params, rtol=rtol, layout=layout,
                             profile=profile, out=out, err=err)
    try:
        ok = _judge_training(training, rec, arrays, params, rtol=rtol, layout=layout,
                             profile=profile, rule=rule, factor=factor, out=out,
                             select=key_columns(meta, training)) and (c is None or c.ok)
    except (ValueError, TypeError) as exc:
        print(f"arrayattn validate: error: {path}: {exc}", file=err)
        return 2
    return 0 if ok else 1


def _judge_training(training, rec, arrays, params, *, rtol, layout, profile, rule, factor,
                    out, select=None) -> bool:
    """The gradient verdicts (``do`` and ``d<name>`` in the file), the ``lse`` and the
    ``final_state`` verdicts; True when every one matches (or there is nothing to judge)."""
    from .testing import compare_grads, compare_lse
    from .testing.check.judge import compare_port_grads, compare_state

    ok = True
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    grads = {key[1:]: a for key, a in training.items() if key not in ("do", "lse",
                                                                       "final_state")}
    if grads:
        gc = (compare_grads if profile is None else compare_port_grads)(
            grads, rec if profile is None else profile, q, k, v, training["do"], rtol=rtol,
            layout=layout, rule=rule, factor=factor, **({"select": select} if select else {}),
            **params)
        print(gc.table(), file=out)
        print(gc.verdict(), file=out)
        ok = ok and gc.ok
    if "lse" in training:
        lc = compare_lse(training["lse"], rec, q, k, v, rtol=rtol, layout=layout,
                         profile=profile, **params)
        print("lse:\n" + lc.table(), file=out)
        print("LSE " + lc.verdict(), file=out)
        ok = ok and lc.ok
    if "final_state" in training:
        sc = compare_state(training["final_state"], rec, {"q": q, "k": k, "v": v}, params)
        print("final_state:\n" + sc.table() + "\nFINAL STATE " + sc.verdict(), file=out)
        ok = ok and sc.ok
    return ok


def _validate(args) -> int:
    return run_validate(args.file, args.variant, args.option, rtol=args.rtol,
                        layout=args.layout, profile=args.profile, rule=args.rule,
                        factor=args.factor)


def _check_writable(label: str, path: str) -> None:
    from .testing.check.command import check_writable
    check_writable(label, path, opener=open)     # this module's open (tests replace it)


def _report(args) -> int:
    from .report.backends import BackendUnavailable, get_array_backend
    from .registry import get_variant
    from .report.run import (CASES, Progress, Workload, format_table, plot_report, run_report,
                             run_sweeps, sweep_steps, write_json)

    w = Workload(batch=args.batch, heads=args.heads, n=args.n, d=args.d, dtype=args.dtype,
                 seed=args.seed, repeats=args.repeats, backend=args.backend)
    names = None if not args.variants else [x.strip() for x in args.variants.split(",")
                                            if x.strip()]
    try:
        if args.variants and not names:
            raise ValueError(f"--variants {args.variants!r} names no variant")
        if args.seed < 0:
            raise ValueError(f"--seed must be a non-negative integer; got {args.seed}")
        for label, path in (("--json", args.json), ("--plot", args.plot)):
            if path:
                _check_writable(label, path)
        for name in names or ():
            get_variant(name)
        for label, value in (("--n", w.n), ("--d", w.d), ("--heads", w.heads),
                             ("--batch", w.batch), ("--repeats", w.repeats)):
            if value < 1:
                raise ValueError(f"{label} must be a positive integer; got {value}")
        be = get_array_backend(w.backend, w.dtype)
        if args.plot:
            import importlib
            try:
                importlib.import_module("matplotlib")
            except ImportError:
                raise ValueError('--plot needs matplotlib (pip install "arrayattn[plot]")') \
                    from None
    except (ValueError, BackendUnavailable) as exc:
        print(f"arrayattn report: error: {exc}", file=sys.stderr)
        return 2
    from .registry import variants
    count = len(names) if names else len(variants())
    print(f"arrayattn report: {count} variant(s); batch={w.batch} heads={w.heads} n=s={w.n} "
          f"d=dv={w.d} dtype={w.dtype} seed={w.seed} backend={w.backend} ({be.device}); "
          f"cases: {', '.join(CASES)}", file=sys.stderr)
    total = len(CASES) * count + (sweep_steps(w, names) if args.plot else 0)
    prog = Progress(total, enabled=not args.quiet)
    rows = run_report(w, names, progress=prog)
    sweeps = run_sweeps(w, names, progress=prog) if args.plot else None
    print(format_table(rows))
    if args.json:
        write_json(args.json, w, rows, sweeps)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot_report(rows, sweeps, args.plot, w)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _report_parser(sub):
    rep = sub.add_parser(
        "report", help="run every registered variant on a default workload",
        description="Run every registered variant on a built-in workload (q, k, v of shape "
        "(batch, heads, n, d), in a 'gaussian' case, a 'sharp' case: q, k rows of norm 8, "
        "each query aligned with one key, and a 'real' case: 36 heads of all-MiniLM-L6-v2 "
        "on 256 tokens) and print one row per variant and case: relative error of the "
        "output vs exact float64 attention, max row L1 error of the implied matrix (first "
        "head, n <= 2048), worst row-sum deviation, median time, peak memory, "
        "approximation parameter.")
    from .report.backends import BACKENDS, DTYPES
    rep.add_argument("--backend", default="numpy", choices=BACKENDS)
    rep.add_argument("--n", type=int, default=1024, help="tokens (n = s); default 1024")
    rep.add_argument("--d", type=int, default=64, help="head dimension (d = dv); default 64")
    rep.add_argument("--heads", type=int, default=2, help="default 2")
    rep.add_argument("--batch", type=int, default=1, help="default 1")
    rep.add_argument("--dtype", default="float32", choices=DTYPES)
    rep.add_argument("--seed", type=int, default=0)
    rep.add_argument("--repeats", type=int, default=3, help="timed calls per variant")
    rep.add_argument("--variants", default="", help="comma-separated registry names "
                     "(default: all registered)")
    rep.add_argument("--json", metavar="FILE", help="write the raw numbers as JSON")
    rep.add_argument("--plot", metavar="FILE.png", help="also sweep each variant's "
                     "approximation parameter and n, and draw error vs approximation size "
                     "and time vs n (needs matplotlib)")
    rep.add_argument("--quiet", action="store_true", help="no progress bar")
    rep.set_defaults(func=_report)
    return rep


def _validate_parser(sub):
    from .testing import LAYOUTS, PROFILES

    val = sub.add_parser(
        "validate", help="compare another implementation's output with the reference",
        description="Compare the array 'out' of FILE.npz with arrayattn's float64 reference "
        "of VARIANT on the file's q, k, v, per head. When the file holds 'do' (the output "
        "cotangent) and any of dq, dk, dv or d<name> of another of its arrays, the "
        "gradients are judged too (arrayattn.vjp), and 'lse' (the log-sum-exp, shape "
        "(..., heads, n); FlashAttention's (b, h, n)) when present. Other arrays in the "
        "file (random matrices such as omega, e, f; masks; alibi_slopes; dropout_mask, the "
        "boolean keep-mask; the integer cu_seqlens_q, cu_seqlens_k of packed sequences) "
        "are passed as options of the same name. A file with the integer arrays "
        "block_table (b, max_blocks) and cache_seqlens (b,) is a paged KV cache, judged "
        "against arrayattn.paged_attention: its k and v are then the caches (num_blocks, "
        "page, h_kv, d), whatever --layout says of q and out. "
        "A repro file of 'arrayattn check' names its profile or variant, layout and "
        "options itself (its __meta__): 'arrayattn validate FILE' alone judges it; flags "
        "still override. A repro of a kernel that raised holds its inputs and the error "
        "(exit 1). "
        "Exit 0 match, 1 mismatch, 2 usage error or malformed file.")
    val.add_argument("file", metavar="FILE.npz")
    val.add_argument("--variant", default=None, help="registry name (arrayattn report "
                     "lists them); optional with --profile")
    val.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                     help="a scalar option of the variant (int, float, true/false, none, "
                     "a pair such as window=3,0 or 'window=(3, 0)', or a string); repeat "
                     "for several; overrides the file's option of the same name")
    val.add_argument("--rtol", type=float, default=None,
                     help="override the derived tolerance: max-abs error per head "
                     "relative to the head's largest reference entry")
    val.add_argument("--layout", choices=LAYOUTS, default=None,
                     help="axis order of q, k, v, out: bhnd (..., heads, tokens, dim; "
                     "default) or bnhd (batch, tokens, heads, dim: fla, flash-attn)")
    val.add_argument("--profile", choices=sorted(PROFILES), default=None,
                     help="a port's conventions (docs/validating.rst): flash_attn "
                     "(FlashAttention's option names and defaults, layout bnhd), "
                     "flex_attention, sdpa, ...; --option then takes the port's own options")
    val.add_argument("--rule", choices=("float64", "same-dtype"), default=None,
                     help="tolerance rule of the gradients: float64 (8x arrayattn's own "
                     "float32 error; the default for float32/float64 files) or same-dtype "
                     "(FlashAttention's: at most --factor times the error of the reference "
                     "computed at the inputs' precision; the default for half precision)")
    val.add_argument("--factor", type=float, default=2.0,
                     help="the multiple of the same-dtype rule (default 2)")
    val.set_defaults(func=_validate)
    return val


def _parse(parser, subs: dict, argv):
    """The parsed arguments.  A mistyped flag after the subcommand is reported with that
    subcommand's usage (plain parse_args would print the top-level one, which lists no
    flag of the subcommand)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        words = list(sys.argv[1:] if argv is None else argv)
        before = words[:words.index(args.command)] if args.command in words else []
        owner = parser if set(unknown) & set(before) else subs[args.command]
        owner.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv=None) -> int:
    """The ``arrayattn`` command: parse ``argv`` and run the subcommand; its exit code."""
    parser = argparse.ArgumentParser(
        prog="arrayattn", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)
    from .testing.check.command import add_parser
    from .testing.check.conformance import add_parser as add_conformance
    subs = {"report": _report_parser(sub), "validate": _validate_parser(sub),
            "check": add_parser(sub), "conformance": add_conformance(sub)}
    args = _parse(parser, subs, argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
