"""The report's plot: small multiples of error against each family's approximation
parameter, one row per case, and time against n, one panel per family.

Every panel holds at most :data:`MAX_LINES` lines, each with its own colour and marker;
legends stand outside the axes, so they never cover a curve; the mean-of-v baseline is
the dotted black line of every error panel.
"""
from __future__ import annotations

import numpy as np

from ..registry import get_variant
from .kinds import kind_of

__all__ = ["plot_report", "error_panels", "time_panels", "MAX_LINES"]

#: At most this many curves in one panel (a family with more is split over panels).
MAX_LINES = 8
_MARKERS = "osD^v<>P"


def _approximates(rec) -> bool:
    return kind_of(rec) == "approximates softmax"


def _chunks(names, title):
    """``[(title, names)]`` with at most MAX_LINES names each (numbered when split)."""
    groups = [names[i:i + MAX_LINES] for i in range(0, len(names), MAX_LINES)]
    return [(title if len(groups) == 1 else f"{title} ({g + 1}/{len(groups)})", group)
            for g, group in enumerate(groups)]


def error_panels(names) -> list[tuple[str, str, list]]:
    """``(title, parameter, members)`` of the variants that approximate softmax and have
    an approximation parameter: one panel per (family, parameter) (num_features,
    num_landmarks, window, stride and num_hashes never share an axis), at most
    MAX_LINES members."""
    keys: dict = {}
    for name in names:
        rec = get_variant(name)
        if _approximates(rec) and rec.parameter is not None:
            keys.setdefault((rec.family, rec.parameter), []).append(name)
    return [(title, parameter, group) for (family, parameter), members in keys.items()
            for title, group in _chunks(members, f"{family}: {parameter}")]


def time_panels(names) -> list[tuple[str, list]]:
    """``(family, members)``: time against n, one panel per family (split past
    MAX_LINES)."""
    fams: dict = {}
    for name in names:
        fams.setdefault(get_variant(name).family, []).append(name)
    return [chunk for family, members in fams.items() for chunk in _chunks(members, family)]


def _style(i):
    import matplotlib.pyplot as plt
    return {"color": plt.get_cmap("tab10")(i % 10), "marker": _MARKERS[i % len(_MARKERS)],
            "ms": 4}


def _legend_outside(ax):
    ax.legend(fontsize=6, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _error_panel(ax, members, sweeps, case, base):
    for i, name in enumerate(members):
        pts = [p for p in sweeps["errors"] if p["variant"] == name and p["case"] == case
               and "rel_error" in p]
        if pts:
            ax.plot([p["value"] for p in pts], [max(p["rel_error"], 1e-17) for p in pts],
                    "-", label=name, **_style(i))
    if base is not None:
        ax.axhline(base, color="black", ls=":", lw=1.5, label="baseline (mean of v)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ys = [y for line in ax.get_lines() for y in np.atleast_1d(line.get_ydata())]
    if ys:      # at least a decade, up to O(1): never a zoom on two close lines
        ax.set_ylim(min(min(ys) / 3, max(ys) / 10), max(1.0, max(ys) * 3))
    ax.grid(True, which="both", alpha=0.3)
    ax.tick_params(labelsize=7)
    _legend_outside(ax)


def _time_panel(ax, family, members, sweeps, w):
    for i, name in enumerate(members):
        pts = [p for p in sweeps["scaling"] if p["variant"] == name and "best_ms" in p]
        if pts:
            ax.plot([p["n"] for p in pts], [p["best_ms"] for p in pts],
                    "--" if get_variant(name).exact else "-", label=name, **_style(i))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"{family}: time vs n", fontsize=9)
    ax.set_xlabel("n (= s)", fontsize=8)
    ax.set_ylabel(f"best of {max(1, w.repeats)} [ms]", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.tick_params(labelsize=7)
    _legend_outside(ax)


def plot_report(rows, sweeps, path, w) -> None:
    """Write the plot of a report run (``rows``, ``sweeps``) to ``path`` (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.variant for r in rows if r.kind != "baseline"))
    panels, times = error_panels(names), time_panels(names)
    cases = list(dict.fromkeys(r.case for r in rows))
    ncol = max(1, len(panels), -(-len(times) // 2))
    nrow = len(cases) + -(-len(times) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.4 * ncol, 2.9 * nrow), squeeze=False)
    for i, case in enumerate(cases):
        base = next((r.rel_error for r in rows if r.case == case and r.kind == "baseline"),
                    None)
        for j in range(ncol):
            ax = axes[i][j]
            if j >= len(panels):
                ax.set_axis_off()
                continue
            title, parameter, members = panels[j]
            _error_panel(ax, members, sweeps, case, base)
            ax.set_title(f"{case}: {title}", fontsize=9)
            ax.set_xlabel(parameter, fontsize=8)
            ax.set_ylabel("rel. error vs exact", fontsize=8)
    for t in range(len(cases) * ncol, nrow * ncol):
        ax, k = axes[t // ncol][t % ncol], t - len(cases) * ncol
        if k < len(times):
            _time_panel(ax, *times[k], sweeps, w)
        else:
            ax.set_axis_off()
    fig.suptitle(f"arrayattn report ({w.backend}, {w.dtype}; gaussian and sharp: n={w.n}, "
                 f"d={w.d}; real: 36 heads of all-MiniLM-L6-v2, n=256, d=32)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))      # room for the title above the panels
    fig.savefig(path, dpi=100)
    plt.close(fig)
