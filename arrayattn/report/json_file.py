"""The report's raw numbers as a JSON file: the workload, the machine, one dict per row
and the sweeps (``arrayattn report --json``)."""
from __future__ import annotations

import json
import math
import platform
from dataclasses import asdict

import numpy as np

__all__ = ["rows_as_dicts", "machine_info", "write_json"]


def rows_as_dicts(rows):
    return [asdict(r) for r in rows]


def machine_info(backend: str) -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "numpy": np.__version__}
    try:
        import os
        info["cpu_count"] = os.cpu_count()
    except Exception:  # pragma: no cover
        pass
    if backend != "numpy":
        try:
            mod = __import__(backend)
            info[backend] = getattr(mod, "__version__", "?")
        except Exception:  # pragma: no cover
            pass
    return info


def write_json(path, w, rows, sweeps=None) -> None:
    """The raw numbers: workload, machine, one dict per row, sweeps if any."""
    data = {"workload": asdict(w), "machine": machine_info(w.backend),
            "rows": rows_as_dicts(rows)}
    if sweeps is not None:
        data["sweeps"] = sweeps
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1, default=lambda x: None if x is None or (
            isinstance(x, float) and math.isnan(x)) else str(x))
