"""A sweep's figures and its self-contained report.html (figures embedded as PNG data).

    figures/rate_consensus.png, rate_direction.png, rate_rotation.png, rate_top2.png
        measured against predicted, one per rate with defined values
    figures/heatmap_M_X_Y.png     the mean of measure M over grid axes X (columns) and Y (rows)
    figures/distributions_M.png   M over the systems, one box per value of each grid axis

``--plot M:X:Y`` chooses the heatmap (default: final_gamma over the first two grid axes
with several values).
"""
from __future__ import annotations

import html
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np
from matplotlib.figure import Figure

from .. import io
from ..analysis import plots
from ..analysis import report_html as page
from .columns import RATES

DEFAULT_MEASURE = "final_gamma"
RATE_LABELS = {"consensus_rate": ("predicted 1/|1+λ1|", "measured rate of μ(X_t)"),
               "direction_rate": ("predicted |1+λ2|/|1+λ1|", "measured rate of tan∠(x̄, S1)"),
               "rotation": ("predicted arg(1+λ1) [rad/step]", "measured rotation [rad/step]"),
               "top2_rate": ("predicted |1+λ3|/|1+λ1|", "measured rate of tan∠(x̄, S1+S2)")}


def axes_of(df, spec) -> List[str]:
    """The grid axes (in the spec's order, a model sweep's ``layer`` first) that have several values."""
    keys = (["layer"] if spec.model is not None else []) + list(spec.grid)
    return [k for k in keys if k in df and df[k].nunique() > 1]


def plot_columns(spec) -> Tuple[List[str], List[str]]:
    """(measures, axes) that ``--plot`` may name: the measured columns and the grid axes."""
    from .columns import MEASURED
    axes = (["layer"] if spec.model is not None else []) + list(spec.grid) + ["replicate"]
    return list(MEASURED), axes


def parse_plot(text: Optional[str], spec, df=None) -> Optional[Tuple[str, str, Optional[str]]]:
    """(measure, x, y) of ``--plot M:X:Y``, or the default (with ``df``: the first two grid axes
    with several values); a ValueError naming the option and the bad part."""
    if text is None:
        axes = axes_of(df, spec) if df is not None else []
        if not axes:
            return None
        return DEFAULT_MEASURE, axes[0], axes[1] if len(axes) > 1 else None
    measures, axes = plot_columns(spec)
    parts = text.split(":")
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"--plot {text!r}: expected MEASURE:X:Y, e.g. final_gamma:heads:beta")
    m, x, y = parts
    if m not in measures:
        raise ValueError(f"--plot {text!r}: unknown measure {m!r}; expected one of {', '.join(measures)}")
    for a in (x, y):
        if a not in axes:
            raise ValueError(f"--plot {text!r}: {a!r} is not a grid axis; expected one of {', '.join(axes)}")
    return m, x, y


def _numeric(s):
    """A column as "float[S]" (booleans 0/1, nulls NaN)."""
    return s.astype("Float64").to_numpy(dtype=np.float64, na_value=np.nan)


def _values(s) -> list:
    """A grid axis' values in the spec's order (the table is in point order)."""
    return list(s.unique())


def plot_heatmap(df, measure: str, x: str, y: Optional[str], path: str) -> str:
    """Mean of ``measure`` per (y, x) cell, annotated."""
    xs = _values(df[x])
    ys = _values(df[y]) if y else [None]
    grid = np.full((len(ys), len(xs)), np.nan)
    vals = _numeric(df[measure])
    for i, yv in enumerate(ys):
        for j, xv in enumerate(xs):
            sel = (df[x] == xv).to_numpy() & ((df[y] == yv).to_numpy() if y else True)
            v = vals[sel]
            grid[i, j] = np.nanmean(v) if np.isfinite(v).any() else np.nan
    fig = Figure(figsize=(1.2 + 0.9 * len(xs), 1.4 + 0.6 * len(ys)))
    ax = fig.subplots()
    im = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
    fig.colorbar(im, ax=ax, label=f"mean {measure}")
    for i in range(len(ys)):
        for j in range(len(xs)):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.3g}", ha="center", va="center", fontsize=8,
                        color="white" if grid[i, j] < np.nanmean(grid) else "black")
    ax.set_xticks(range(len(xs)), [str(v) for v in xs], rotation=30 if len(xs) > 6 else 0)
    ax.set_yticks(range(len(ys)), [str(v) for v in ys] if y else [""])
    ax.set_xlabel(x)
    ax.set_ylabel(y or "")
    ax.set_title(f"{measure} over {x}" + (f" and {y}" if y else ""), fontsize=11)
    fig.tight_layout()
    return plots.save_figure(fig, path)


def plot_distributions(df, measure: str, axes: Sequence[str], path: str) -> str:
    """One panel per grid axis: a box of ``measure`` per value."""
    axes = list(axes)[:6]
    fig = Figure(figsize=(4.2 * len(axes), 3.6))
    vals = _numeric(df[measure])
    for a, ax in zip(axes, np.atleast_1d(fig.subplots(1, len(axes)))):
        levels = _values(df[a])
        data = [vals[(df[a] == v).to_numpy()] for v in levels]
        data = [d[np.isfinite(d)] for d in data]
        ax.boxplot([d if d.size else [np.nan] for d in data], showfliers=True)
        ax.set_xticks(range(1, len(levels) + 1), [str(v) for v in levels], rotation=30 if len(levels) > 5 else 0)
        ax.set_xlabel(a)
        ax.set_ylabel(measure)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{measure} per grid value ({len(df)} systems)", fontsize=11)
    fig.tight_layout()
    return plots.save_figure(fig, path)


def write_figures(folder: str, df, spec, plot: Optional[str] = None) -> List[str]:
    """Every figure of the module docstring that has data; paths relative to ``folder``."""
    choice = parse_plot(plot, spec, df)
    out = []                 # each figure is listed in the folder's ledger before it is written
    for meas, pred in RATES:
        p, m = _numeric(df[pred]), _numeric(df[meas])
        if (np.isfinite(p) & np.isfinite(m)).any():
            xl, yl = RATE_LABELS[meas]
            name = "rate_" + meas.replace("_rate", "") + ".png"
            out.append(plots.plot_scatter_predicted(p, m, io.claim(folder, "figures/" + name), xlabel=xl, ylabel=yl,
                                                    title=f"{meas}: measured against predicted",
                                                    angles=meas == "rotation"))
    if choice is not None:
        m, x, y = choice
        if np.isfinite(_numeric(df[m])).any():
            out.append(plot_heatmap(df, m, x, y, io.claim(folder, f"figures/heatmap_{m}_{x}_{y or 'none'}.png")))
            axes = axes_of(df, spec)
            if axes:
                out.append(plot_distributions(df, m, axes, io.claim(folder, f"figures/distributions_{m}.png")))
    return [os.path.relpath(p, folder) for p in out]


def summary_table(df, spec, measures=("consensus_rate", "consensus_rate_pred", "direction_rate",
                                      "direction_rate_pred", "final_gamma", "final_consensus", "converged")):
    """Mean of the main measures per value of each grid axis: rows of (axis, value, means...)."""
    rows = []
    cols = [m for m in measures if m in df]
    for a in axes_of(df, spec) or [None]:
        groups = df.groupby(a, sort=True, dropna=False) if a else [("all", df)]
        for v, sub in groups:
            rows.append([a or "all", v] + [float(np.nanmean(_numeric(sub[m]))) if np.isfinite(_numeric(sub[m])).any()
                                           else None for m in cols] + [len(sub)])
    return ["axis", "value"] + [f"mean {m}" for m in cols] + ["systems"], rows


def render_html(folder: str, df, spec, info: dict, figures: Sequence[str]) -> str:
    """The report (:mod:`powerlens._src.analysis.report_html`): what was swept, a summary per grid
    value, the figures (embedded), the spec, versions, devices and timing."""
    e = html.escape
    head, rows = summary_table(df, spec)
    axes = ", ".join(f"{k} ({len(v)} values)" for k, v in spec.grid.items())
    what = (f"model {e(spec.model['name'])}, layers {e(str(spec.model['layers']))}, {len(spec.model['prompts'])} "
            f"prompts" if spec.model else f"{spec.replicates} replicates per point")
    return page.page(f"powerlens sweep: {spec.name}", [
        f"<p>{len(df):,} systems over a grid of {e(axes)}; {what}. Every number below is computed from "
        f"<code>results.parquet</code>.</p>",
        "<h2>Summary per grid value</h2>", page.table(head, rows),
        "<h2>Figures</h2>", page.figures(folder, figures),
        "<h2>Spec, versions, devices and timing</h2>", page.json_block(info)])
