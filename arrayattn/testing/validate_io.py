"""What ``arrayattn validate`` reads from and prints about a file: its options
(``--option key=value``), the ``__meta__`` of a repro file written by ``arrayattn check``
(the variant or profile, layout and options that judge it alone), and the lines it prints
(options by value, the verdict with its table and hints, a kernel that raised)."""
from __future__ import annotations


__all__ = ["UsageError", "parse_option", "META", "read_meta", "with_meta", "print_raised",
           "key_columns",
           "shown_value", "print_output_verdict", "MAX_OPTION"]

#: Integer options beyond this (num_features, num_landmarks ...) cannot be meant.
MAX_OPTION = 10**7


class UsageError(Exception):
    """A bad command line or a malformed input file (exit code 2)."""


def parse_option(text: str):
    """``"key=value"`` -> ``(key, value)``, value parsed as bool, None, int, float, a tuple
    of numbers (``3,0``, ``(3, 0)``, ``[3, 0]``, ``(none, 0)``: windows) or str.

    >>> parse_option("num_features=64"), parse_option("causal=true")
    (('num_features', 64), ('causal', True))
    >>> parse_option("scale=0.125"), parse_option("kind=positive"), parse_option("x=none")
    (('scale', 0.125), ('kind', 'positive'), ('x', None))
    >>> parse_option("window=(3, 0)"), parse_option("window_size=-1,0")
    (('window', (3, 0)), ('window_size', (-1, 0)))
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise UsageError(f"--option expects key=value with a Python identifier as key; "
                         f"got {text!r}")
    raw = raw.strip()
    value = _scalar_text(raw)
    if value is _TEXT and ("," in raw or raw[:1] in "([" and raw[-1:] in ")]"):
        inner = raw[1:-1] if raw[:1] in "([" and raw[-1:] in ")]" else raw
        parts = [_scalar_text(p.strip()) for p in inner.split(",")] if inner.strip() else []
        if all(p is None or (isinstance(p, (int, float)) and not isinstance(p, bool))
               for p in parts):
            return key, tuple(parts)
    return key, raw if value is _TEXT else value


_TEXT = object()


def _scalar_text(raw: str):
    """bool, None, int or float of one word; ``_TEXT`` for anything else."""
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    return _TEXT


#: The metadata array of a repro file written by ``arrayattn check``.
META = "__meta__"


def read_meta(path: str, arrays: dict) -> dict:
    """The repro file's ``__meta__`` (JSON in a 0-d string array), removed from
    ``arrays``; ``{}`` when the file has none; UsageError when it is not readable JSON."""
    import json

    if META not in arrays:
        return {}
    raw = arrays.pop(META)
    try:
        meta = json.loads(str(raw.item() if hasattr(raw, "item") else raw))
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{path}: its {META} is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise UsageError(f"{path}: its {META} is not a JSON object")
    return meta


def key_columns(meta: dict, training: dict) -> dict | None:
    """The ``select`` of :func:`~arrayattn.testing.compare_grads` for a repro file of key
    columns (``__meta__`` ``"key_columns": m``, written by the sampled judge: the file's
    keys are the ``m`` columns judged, then the sink key, its values one dimension wider;
    :mod:`arrayattn.testing.check.sampled_grads`): ``dk`` and ``dv`` of the first ``m``
    keys, ``dv``'s features as the file's ``dv`` holds them.  ``None`` for other files."""
    m = meta.get("key_columns")
    if m is None:
        return None
    dv = training.get("dv")
    return {"k": (Ellipsis, slice(0, int(m)), slice(None)),
            "v": (Ellipsis, slice(0, int(m)), slice(0, None if dv is None else
                                                      dv.shape[-1]))}


def with_meta(meta: dict, variant, profile, layout, options) -> tuple:
    """``(variant, profile, layout, options)``: the flags, completed by the file's
    ``__meta__``.  The file's variant or profile (with its layout and options) is used when
    neither ``--variant`` nor ``--profile`` is given, or when they name the same; an
    ``--option`` overrides the file's option of the same name."""
    if not meta:
        return variant, profile, layout, list(options)
    same = (variant is None and profile is None) or (
        variant == meta.get("variant") and profile == meta.get("profile"))
    if not same:
        return variant, profile, layout, list(options)
    given = {parse_option(o)[0] for o in options}
    kept = [o for o in meta.get("options") or () if parse_option(o)[0] not in given]
    return (meta.get("variant") if variant is None and profile is None else variant,
            meta.get("profile") if variant is None and profile is None else profile,
            layout if layout is not None else meta.get("layout"), kept + list(options))


def print_raised(path, meta, arrays, params, variant, profile, out) -> int:
    """A repro file of a kernel that raised (no ``out``): its problem, the error; exit 1."""
    for name in ("q", "k", "v"):
        if name not in arrays:
            raise UsageError(f"{path} lacks array {name}")
    shown = {key: shown_value(val) for key, val in params.items()}
    shown.update({key: shown_value(val) for key, val in arrays.items()
                  if key not in ("q", "k", "v", "do")})
    what = variant or "softmax"
    print(f"{path}: {what}" + (f" (profile {profile})" if profile else "")
          + f", q {arrays['q'].shape}, k {arrays['k'].shape}, v {arrays['v'].shape}"
          + (f", options {shown}" if shown else ""), file=out)
    if meta.get("case"):
        print(f"case: {meta['case']}", file=out)
    print(f"no output to judge: {meta['error']}", file=out)
    print("KERNEL RAISED", file=out)
    return 1



def shown_value(value, limit: int = 8):
    """An option as printed: scalars and arrays of at most ``limit`` entries by value
    (a 0-d array as its scalar, a small one as a tuple), larger arrays by shape.

    >>> import numpy as np
    >>> shown_value(np.asarray(True)), shown_value(np.array([2, 0])), shown_value(0.5)
    (True, (2, 0), 0.5)
    >>> shown_value(np.zeros((2, 3, 48)))
    'array(2, 3, 48)'
    """
    if not hasattr(value, "shape") or not hasattr(value, "tolist"):
        return value
    if value.ndim == 0:
        return value.tolist()
    if value.ndim == 1 and value.size <= limit:
        return tuple(value.tolist())
    return f"array{tuple(value.shape)}"


def print_output_verdict(path, c, rec, arrays, params, *, rtol, layout, profile, out, err):
    """The problem line, the per-head table, the notes, a hint on a mismatch, the verdict."""
    from .hints import layout_hint, top_left_hint

    shown = {key: shown_value(val) for key, val in params.items()}
    print(f"{path}: {c.variant}"
          + (f" (profile {c.profile})" if c.profile else "")
          + (f", layout {layout}" if layout else "")
          + f", q {arrays['q'].shape}, k {arrays['k'].shape}, "
          f"v {arrays['v'].shape}, out {arrays['out'].shape} {c.dtype}"
          + (f", options {shown}" if shown else ""), file=out)
    print(c.table(), file=out)
    for note in c.notes:
        print(f"note: {note}", file=err)
    if not c.ok:
        hint = (top_left_hint(c, arrays, params, rtol, layout, profile)
                or layout_hint(rec, arrays, params, rtol, layout, profile))
        if hint:
            print(hint, file=out)
    print(c.verdict(), file=out)
