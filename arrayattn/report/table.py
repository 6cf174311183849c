"""The report's table: a verdict per row, rows ranked within each kind, a conclusion per
case (what ``arrayattn report`` prints).

Verdicts, from the case's own rows:

``exact``                      an exact variant (its error is rounding);
``exact here (...)``           an approximation whose error is within 10x the exact rows'
                               own rounding error on this case -- a sparse pattern that
                               covers every pair at this n (strided and fixed at small n);
``beats the mean of v by Nx``  an approximation of softmax whose error is N times below
                               the baseline's (uniform attention: the mean of v for every
                               query, which scores ~0.8 on real heads);
``no better than the mean of v``  one whose error is at or above the baseline's: worse
                               than uniform attention;
``own architecture``           a variant trained as an architecture of its own (Linformer,
                               Luna, Poolingformer, the gated family): its distance from
                               softmax is not an error.
"""
from __future__ import annotations

__all__ = ["verdict", "ranked", "conclusions", "format_table"]

#: Order of the kinds in the table.
_KIND_ORDER = {"baseline": 0, "exact": 1, "approximates softmax": 2, "own architecture": 3}


def _case_rows(rows, case):
    return [r for r in rows if r.case == case and not r.error]


def _rounding(rows, case) -> float | None:
    """The exact rows' largest error on ``case`` (their rounding), or ``None``."""
    errs = [r.rel_error for r in _case_rows(rows, case)
            if r.kind == "exact" and r.rel_error is not None]
    return max(errs) if errs else None


def _baseline(rows, case) -> float | None:
    return next((r.rel_error for r in _case_rows(rows, case) if r.kind == "baseline"), None)


def verdict(row, rows) -> str:
    """The verdict of ``row`` among the rows of its case (see the module docstring)."""
    if row.error or row.kind in ("baseline", "exact", "own architecture"):
        return "" if row.error or row.kind == "baseline" else row.kind
    err, base, rounding = row.rel_error, _baseline(rows, row.case), _rounding(rows, row.case)
    if err is None:
        return ""
    if rounding is not None and err <= 10 * rounding:
        why = ("its pattern covers every pair at this n" if row.family == "sparse"
               else "as accurate as exact attention on this case")
        return f"exact here ({why})"
    if base is None:
        return ""
    if err < base:
        return f"beats the mean of v by {base / err:.1f}x"
    return "no better than the mean of v"


def ranked(rows) -> list:
    """Rows grouped by case (first-seen order), then by kind (baseline, exact,
    approximations, own architectures), each kind ranked by error (errors last)."""
    cases = list(dict.fromkeys(r.case for r in rows))

    def key(r):
        return (cases.index(r.case), _KIND_ORDER.get(r.kind, 9), bool(r.error),
                r.rel_error if r.rel_error is not None else float("inf"))
    return sorted(rows, key=key)


def conclusions(rows) -> list[str]:
    """One line per case: the most accurate approximation of softmax, and the fastest one
    that beats the baseline."""
    lines = []
    for case in dict.fromkeys(r.case for r in rows):
        approx = [r for r in _case_rows(rows, case) if r.kind == "approximates softmax"
                  and r.rel_error is not None]
        if not approx:
            continue
        best = min(approx, key=lambda r: r.rel_error)
        base = _baseline(rows, case)
        useful = [r for r in approx if base is not None and r.rel_error < base
                  and r.min_ms is not None]
        line = (f"{case}: most accurate approximation of softmax: {best.variant} "
                f"(rel. error {best.rel_error:.2e}, {verdict(best, rows)})")
        if useful:
            fast = min(useful, key=lambda r: r.min_ms)
            line += (f"; fastest that beats the mean of v: {fast.variant} "
                     f"({fast.min_ms:.1f} ms, error {fast.rel_error:.2e})")
        else:
            line += "; none beats the mean of v"
        lines.append(line)
    return lines


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def format_table(rows) -> str:
    """The report table (plain text, aligned columns), ranked, with the verdict column
    and the per-case conclusions below it."""
    head = ["variant", "case", "parameter", "rel. error", "matrix err", "row-sum dev",
            "min ms", "median ms", "peak MiB", "kind", "verdict"]
    body = []
    for r in ranked(rows):
        if r.error:
            body.append([r.variant, r.case, r.parameter, "error: " + r.error])
            continue
        body.append([r.variant, r.case, r.parameter, _fmt(r.rel_error, ".2e"),
                     _fmt(r.matrix_error, ".2e"), _fmt(r.row_sum_dev, ".1e"),
                     _fmt(r.min_ms, ".1f"), _fmt(r.median_ms, ".1f"),
                     _fmt(r.peak_mib, ".1f"), r.kind, verdict(r, rows)])
    widths = [max(len(row[i]) for row in [head] + [b for b in body if len(b) == len(head)])
              for i in range(len(head))]
    lines = ["  ".join(h.ljust(wd) for h, wd in zip(head, widths)).rstrip(),
             "  ".join("-" * wd for wd in widths)]
    for row in body:
        lines.append("  ".join(c.ljust(wd) for c, wd in zip(row, widths)).rstrip())
    return "\n".join(lines + [""] + conclusions(rows))
