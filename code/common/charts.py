"""A figure as data: a Chart of Series, drawn with matplotlib through a page (`page.figure`), and the
project's pyplot style.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, with this project's style."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"axes.grid": True, "grid.alpha": 0.3, "axes.titlesize": 10, "legend.fontsize": 8,
                         "figure.dpi": 120})
    return plt


# ----------------------------------------------------------------------------- a figure as data
REFERENCE = {"color": "gray", "ls": ":", "lw": 1}   # how a reference line (chance, a floor) is drawn


@dataclass
class Series:
    """One series of a chart: y over x, its legend label (None: not in the legend), how it is drawn ("line",
    where a y of None leaves a gap; "step": held until the next x, as a trace or a CDF; "bar": side by side
    with the chart's other bar series at category positions x; "barh": one horizontal bar per label x, the
    first on top, each value written at its bar's end with `fmt` when it has one; "scatter") and
    matplotlib's style keywords (color, ls, marker, ...)."""
    x: Any
    y: Any
    label: str | None = None
    kind: str = "line"
    style: dict = field(default_factory=dict)
    fmt: str | None = None


@dataclass(kw_only=True)
class Chart:
    """One panel described by data: its series, axis labels and scales, the handout's range as a grey band
    (lo, hi, label), reference lines across it (hlines at y, vlines at x: (value, style) pairs, the style
    holding the legend's label), the grid's ticks ("major" or "both"), the legend's keywords (None: no
    legend) and any further `ax.set` settings (ylim, xticks, ...)."""
    series: list
    xlabel: str = ""
    ylabel: str = ""
    title: str = ""
    xscale: str = "linear"
    yscale: str = "linear"
    band: tuple | None = None
    hlines: list = field(default_factory=list)
    vlines: list = field(default_factory=list)
    grid: str = "major"
    legend: dict | None = field(default_factory=dict)
    minor_ticks: bool = True
    axes: dict = field(default_factory=dict)


def draw_series(ax, s: Series, bars: list) -> None:
    """Draw one Series on matplotlib axes (`bars`: the chart's "bar" series, which share each category)."""
    if s.kind == "bar":
        i, w = bars.index(s), 0.8 / len(bars)
        ax.bar([x + (i - (len(bars) - 1) / 2) * w for x in s.x], s.y, w, label=s.label, **s.style)
    elif s.kind == "barh":
        ax.barh(s.x, s.y, label=s.label, **s.style)
        for y, v in enumerate(s.y if s.fmt else []):
            ax.text(v, y, s.fmt.format(v), va="center", fontsize=8)
        ax.invert_yaxis()
    elif s.kind == "step":
        ax.step(s.x, s.y, where="post", label=s.label, **s.style)
    elif s.kind == "scatter":
        ax.scatter(s.x, s.y, label=s.label, **s.style)
    else:
        ax.plot(s.x, [math.nan if v is None else v for v in s.y], label=s.label, **s.style)


def draw_chart(ax, c: Chart) -> None:
    """Draw one Chart on matplotlib axes: its series, band and reference lines, then its axes and legend."""
    for s in c.series:
        draw_series(ax, s, [b for b in c.series if b.kind == "bar"])
    if c.band:
        ax.axhspan(c.band[0], c.band[1], color="0.85", label=c.band[2], zorder=0)
    for y, style in c.hlines:
        ax.axhline(y, **style)
    for x, style in c.vlines:
        ax.axvline(x, **style)
    named = dict(xscale=c.xscale, yscale=c.yscale, xlabel=c.xlabel, ylabel=c.ylabel, title=c.title)
    ax.set(**{k: v for k, v in named.items() if v not in ("", "linear")}, **c.axes)  # a linear scale is the default
    ax.grid(alpha=0.3, which=c.grid)
    if not c.minor_ticks:
        ax.minorticks_off()
    if c.legend is not None:
        ax.legend(**c.legend)


def chart_figure(page, name: str, charts: Chart | list[Chart], title: str = "", ncols: int | None = None,
                 **kw) -> None:
    """A figure of one or more Charts, `ncols` panels a row (default: all in one row), drawn and saved through
    `page.figure` (kw: its figsize, sharex, ...); nothing is drawn with plotting off."""
    charts = charts if isinstance(charts, list) else [charts]
    ncols = ncols or len(charts)
    nrows = -(-len(charts) // ncols)
    with page.figure(name, title, nrows=nrows, ncols=ncols, squeeze=False, **kw) as (fig, axes):
        if axes is not None:
            for i, c in enumerate(charts):
                draw_chart(axes[i // ncols][i % ncols], c)


def cdf(values) -> tuple[list, list]:
    """The points of an empirical CDF: the values sorted, and the share of values at or below each."""
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def segment_bars(page, name: str, bars: dict, colors: dict, xlabel: str, title: str, figsize=(7, 4.5),
                 legend: dict | None = None) -> None:
    """Horizontal bars laid end to end from segments: bars is name -> [(length, text written inside, kind)],
    each segment colored by its kind (colors: kind -> color, one legend entry each)."""
    with page.figure(name, figsize=figsize) as (fig, ax):
        if ax is None:
            return
        from matplotlib.patches import Patch
        for y, segments in enumerate(bars.values()):
            left = 0.0
            for length, text, kind in segments:
                ax.barh(y, length, left=left, color=colors[kind], edgecolor="white")
                ax.text(left + length / 2, y, text, ha="center", va="center", fontsize=6, color="white")
                left += length
        ax.set(yticks=range(len(bars)), yticklabels=list(bars), xlabel=xlabel)
        ax.set_title(title, fontsize=9)
        ax.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], **(legend or {}))
