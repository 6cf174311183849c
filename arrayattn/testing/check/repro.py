"""The repro file of a finding: an ``.npz`` that ``arrayattn validate`` judges on its own
(inputs, options, the kernel's out, lse, final state, do and gradients), and the command
line that judges it."""
from __future__ import annotations

import numpy as np

from ..measures import host64
from .conventions.base import host

__all__ = ["repro_arrays", "write_repro", "validate_command", "judged_as"]


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
    options = []
    for key, value in params.items():
        if key == "enable_gqa" and not value:
            continue
        if "variant" in flags and not hasattr(value, "shape"):
            if value is not None:    # a scalar of the variant: validate's --option
                text = str(value).lower() if isinstance(value, bool) else str(value)
                options.append(f"{key}={text}")
            continue
        arr = host(value) if hasattr(value, "shape") else _scalar(value)
        if arr is not None:
            arrays[key] = arr
    if options:
        flags["option"] = options
    return _keep_dtypes(arrays, results, grads, call), flags


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
    """The ``arrayattn validate`` command line that judges ``path``."""
    words = [f" --{k} {v}" for k, v in flags.items() if k != "option"]
    words += [f" --option {o}" for o in flags.get("option", ())]
    return "arrayattn validate " + path + "".join(words)


def write_repro(path: str, conv, fn, case) -> str:
    """Run ``fn`` on ``case`` again, write its repro file to ``path``; the validate
    command that judges it."""
    call = conv.build(case)
    results, grads = conv.run(fn, call, case, bool(case.opts.get("backward")))
    from .sampling import repro_rows
    sampled = repro_rows(conv, call, case, results, grads)
    if sampled is not None:      # judged on sampled rows: their sub-problem, the rows beside
        arrays, flags, rows = sampled
        np.savez(path, **arrays)
        np.savetxt(path + ".rows.txt", rows, fmt="%d",
                   header=f"the query rows of {case.describe()} judged (of n = {case.n})")
        return validate_command(path, flags)
    arrays, flags = repro_arrays(conv, call, case, results, grads)
    np.savez(path, **arrays)
    return validate_command(path, flags)
