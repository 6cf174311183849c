"""The repro file of a finding: an ``.npz`` that ``arrayattn validate FILE`` judges on its
own (inputs, options, the kernel's out, lse, final state, do and gradients; the profile or
variant, layout and scalar options in its ``__meta__``), and the command line that judges
it.  A kernel that raised gets a file of its inputs, options and the error text."""
from __future__ import annotations

import json
import shlex

import numpy as np

from ..measures import host64
from .conventions.base import host

__all__ = ["repro_arrays", "write_repro", "validate_command", "judged_as", "META",
           "repro_meta", "input_arrays", "option_text"]

#: The name of the repro file's metadata: a 0-d string array holding JSON (``format``,
#: ``convention``, ``case``, ``variant``, ``profile``, ``layout``, ``options`` as
#: ``--option`` texts, ``error`` of a kernel that raised, ``flaky``); ``arrayattn validate``
#: reads it when no flag says otherwise.
META = "__meta__"


def _scalar(value):
    """An option as an array of the file (None: left out)."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return np.asarray(value, dtype=np.int64)
    return np.asarray(value)


def _flex_params(call, case) -> dict:
    """flex_attention's callables as arrayattn options on the grid: the mask_mod as a
    boolean ``mask (n, s)``, ALiBi as a ``bias (h, n, s)``, the softcap as ``softcap``."""
    mods = call.tensors["mods"]
    i, j = np.arange(case.n)[:, None], np.arange(case.s)[None, :]
    params = {"scale": case.opts.get("scale")}
    if mods.mask_kind:
        params["mask"] = np.broadcast_to(mods.mask_mod(0, 0, i, j), (case.n, case.s)).copy()
    if mods.score_kind == "softcap":
        params["softcap"] = mods.cap
    elif mods.score_kind == "alibi":
        h = np.arange(case.hq)[:, None, None]
        params["bias"] = mods.score_mod(np.zeros((case.hq, case.n, case.s)), 0, h, i, j)
    return params


def judged_as(call, case) -> tuple[dict, dict]:
    """``(flags of validate, the options as they go into the file)``."""
    if call.profile == "flex_attention":
        return {"variant": "softmax"}, _flex_params(call, case)
    if call.profile is not None:
        return {"profile": call.profile}, dict(call.params)
    flags = {"variant": call.variant}
    if call.layout != "bhnd":
        flags["layout"] = call.layout
    return flags, dict(call.params)


def option_text(key: str, value) -> str:
    """One ``--option`` of validate: ``causal=true``, ``scale=0.3``, ``window=3,0``."""
    if isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, (tuple, list)):
        text = ",".join("none" if x is None else str(x) for x in value)
    else:
        text = str(value)
    return f"{key}={text}"


def _options_into(arrays: dict, flags: dict, params: dict) -> None:
    """The call's options: arrays (and a profile's scalars, as 0-d arrays) into ``arrays``,
    a variant's scalars as ``--option`` texts into ``flags["option"]``."""
    options = []
    for key, value in params.items():
        if key == "enable_gqa" and not value:
            continue
        if "variant" in flags and not hasattr(value, "shape"):
            if value is not None:    # a scalar of the variant: validate's --option
                options.append(option_text(key, value))
            continue
        arr = host(value) if hasattr(value, "shape") else _scalar(value)
        if arr is not None:
            arrays[key] = arr
    if options:
        flags["option"] = options


def repro_arrays(conv, call, case, results: dict, grads: dict) -> tuple[dict, dict]:
    """``(arrays of the file, validate's flags)`` of one judged call."""
    from .judge import judge_inputs

    flags, params = judged_as(call, case)
    x = judge_inputs(call)
    arrays = {name: x[name] for name in ("q", "k", "v")}
    arrays["out"] = host64(conv.to_judge("out", results["out"]))
    for name in ("lse", "final_state"):
        if results.get(name) is not None:
            arrays[name] = host64(conv.to_judge(name, results[name]))
    if grads:
        arrays["do"] = x["do"]
        for name, g in grads.items():
            arrays["d" + call.rename.get(name, name)] = host64(conv.to_judge(name, g))
    _options_into(arrays, flags, params)
    return _keep_dtypes(arrays, results, grads, call), flags


def input_arrays(call, case) -> tuple[dict, dict]:
    """``(arrays, validate's flags)`` of a call the kernel raised on: q, k, v, do (in the
    case's dtype) and the options, no result."""
    from .judge import judge_inputs

    flags, params = judged_as(call, case)
    x = judge_inputs(call)
    arrays = {name: x[name] for name in ("q", "k", "v", "do")}
    _options_into(arrays, flags, params)
    return _keep_dtypes(arrays, {}, {}, call), flags


def repro_meta(conv, case, flags: dict, *, error=None, flaky=False) -> dict:
    """The ``__meta__`` of a repro file: what ``validate FILE`` needs besides the arrays."""
    return {"format": 1, "convention": conv.name, "case": case.describe(),
            "variant": flags.get("variant"), "profile": flags.get("profile"),
            "layout": flags.get("layout"), "options": list(flags.get("option", ())),
            "error": error, "flaky": bool(flaky)}


def _keep_dtypes(arrays: dict, results: dict, grads: dict, call) -> dict:
    """The kernel's results in the dtype it gave (float16 kept; bfloat16, which NumPy
    lacks, as float32 holding the same values) and the inputs in the case's."""
    def np_dtype(x):
        name = str(x.dtype).split(".")[-1]
        return np.float32 if name == "bfloat16" else np.dtype(name)

    out = dict(arrays)
    dt = np_dtype(call.tensors["q"])
    for name in ("q", "k", "v", "do"):
        if name in out:
            out[name] = out[name].astype(dt)
    for name, r in results.items():
        if name in out and r is not None:
            out[name] = out[name].astype(np_dtype(r))
    for name, g in grads.items():
        key = "d" + call.rename.get(name, name)
        out[key] = out[key].astype(np_dtype(g))
    return out


def validate_command(path: str, flags: dict) -> str:
    """The ``arrayattn validate`` command line that judges ``path`` (each word quoted for a
    POSIX shell; the flags repeat what the file's ``__meta__`` says)."""
    words = [f" --{k} {shlex.quote(str(v))}" for k, v in flags.items() if k != "option"]
    words += [f" --option {shlex.quote(o)}" for o in flags.get("option", ())]
    return "arrayattn validate " + shlex.quote(path) + "".join(words)


def write_repro(path: str, conv, fn, case, *, outcome=None, flaky: bool = False) -> str:
    """Write the repro file of ``case`` to ``path``; the validate command that judges it.

    ``outcome`` (the failing :class:`~arrayattn.testing.check.search.Outcome`): its call
    and results are written as they were, the kernel is not run again; without it the
    kernel runs again on ``case``.  When the kernel raised (then, or again now) the file
    holds its inputs, options and the error text (``validate`` exits 1 on it), nothing
    is re-raised; so does a result the referee could not judge (a wrong shape ...)."""
    from .search import raised

    call, results, grads, error = None, None, None, None
    if outcome is not None:
        call, results, grads = outcome.call, outcome.results, outcome.grads
        if outcome.verdict is not None and outcome.verdict.error is not None:
            error, results = outcome.verdict.error, None   # raised, or a result unjudgeable
    if call is None:
        call = conv.build(case)
    if results is None and error is None:
        try:
            results, grads = conv.run(fn, call, case, bool(case.opts.get("backward")))
        except Exception as exc:
            error = raised("the kernel", exc)
    arrays = None
    if results is not None and error is None:
        from .sampled import repro_rows, write_columns
        sampled = repro_rows(conv, call, case, results, grads or {})
        if sampled is not None:  # judged on sampled rows: their sub-problem, rows beside
            arrays, flags, rows = sampled
            meta = repro_meta(conv, case, flags, error=None, flaky=flaky)
            arrays[META] = np.asarray(json.dumps(meta))
            np.savez(path, **arrays)
            np.savetxt(path + ".rows.txt", rows, fmt="%d", header=f"the query rows of "
                       f"{case.describe()} judged (of n = {case.n})")
            cols = write_columns(path, conv, call, case, grads or {}, meta)
            return validate_command(path, flags) + (
                "" if cols is None else "; " + validate_command(path + ".cols.npz", cols))
    if results is not None:
        try:
            arrays, flags = repro_arrays(conv, call, case, results, grads or {})
        except Exception as exc:  # a result the referee cannot read (a wrong shape ...)
            error = raised("writing its result", exc)
    if arrays is None:
        arrays, flags = input_arrays(call, case)
    arrays[META] = np.asarray(json.dumps(repro_meta(conv, case, flags, error=error,
                                                    flaky=flaky)))
    np.savez(path, **arrays)
    return validate_command(path, flags)
