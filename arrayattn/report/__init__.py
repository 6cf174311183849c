"""``arrayattn report``: every registered variant on a default workload, one row each.

- :mod:`.run` -- the workload, the cases and the rows (``run_report``, ``run_sweeps``);
- :mod:`.calls` -- how a variant is called on a backend (compiled once under JAX);
- :mod:`.backends` -- the array libraries, host NumPy data in;
- :mod:`.kinds` -- exact, approximation or own architecture;
- :mod:`.table`, :mod:`.plot`, :mod:`.json_file` -- the table, the plot and the JSON.
"""
from .run import (BASELINE, Progress, Row, Workload, baseline_row, format_table, kind_of,
                  machine_info, make_inputs, parameter_default, plot_report, reference,
                  rows_as_dicts, run_report, run_sweeps, sweep_steps, sweep_values, write_json)

__all__ = ["BASELINE", "Workload", "Row", "Progress", "kind_of", "baseline_row", "make_inputs",
           "reference", "run_report", "format_table", "rows_as_dicts", "parameter_default",
           "sweep_values", "run_sweeps", "sweep_steps", "plot_report", "machine_info",
           "write_json"]
