"""PNG plots for run reports, drawn with matplotlib's object API on the Agg canvas: no display, no pyplot state
shared with the user's code, safe in a training process.

Every figure carries the numbers it shows in a PNG text chunk (`SERIES_KEY`, JSON), so a plot can be checked
or re-plotted without the run's files: `read_series(path)` returns them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

SERIES_KEY = "accel_train_series"
MAX_POINTS = 4000  # per series kept in the PNG text chunk (a long run is thinned evenly, the last point kept)


@dataclass
class Series:
    label: str
    x: list[float]
    y: list[float | None]
    style: str = "-"  # a matplotlib format string: "-", "--", "o-", ...


@dataclass
class Panel:
    ylabel: str
    series: list[Series]
    log_y: bool = False
    hlines: dict[str, float] = field(default_factory=dict)  # label -> y (e.g. the clipping threshold)
    vlines: dict[str, float] = field(default_factory=dict)  # label -> x (e.g. the end of warmup)
    xticklabels: list[str] | None = None  # categorical x axis (layers): one label per x = 0, 1, ...


def _clean(values: Sequence) -> list[float | None]:
    out = []
    for v in values:
        v = None if v is None else float(v)
        out.append(v if v is not None and math.isfinite(v) else None)
    return out


def _thin(series: Series) -> dict:
    n = len(series.x)
    keep = range(n) if n <= MAX_POINTS else sorted(set(range(0, n, math.ceil(n / MAX_POINTS))) | {n - 1})
    return {"label": series.label, "x": [series.x[i] for i in keep], "y": _clean(series.y[i] for i in keep),
            "style": _style(series)}


def _figure(rows: int, width: float = 8.0, height: float = 3.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, 0.6 + height * rows))
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path, meta: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={SERIES_KEY: json.dumps(meta)})
    return path


MARKERS = "o.sxd^v*+"


def _style(series: Series) -> str:
    """A series with one drawable point gets a marker: a line through one point draws nothing."""
    points = sum(v is not None for v in _clean(series.y))
    return series.style if points != 1 or any(m in series.style for m in MARKERS) else "o" + series.style


def _near_constant_limits(panel: Panel) -> tuple[float, float] | None:
    """y limits for a panel whose values barely move (peak memory: 512.3 .. 512.4 MiB): +-5% around them, instead of
    matplotlib's full height for a 0.1 MiB wiggle under a '+5.123e2' offset. None when the values do move."""
    values = [v for s in panel.series for v in _clean(s.y) if v is not None]
    if not values or panel.log_y or panel.xticklabels:
        return None
    low, high = min(values), max(values)
    scale = max(abs(low), abs(high))
    if high - low > 0.01 * scale:
        return None
    pad = 0.05 * scale if scale else 1.0
    return low - pad, high + pad


def _integer_x(panels: Sequence[Panel]) -> bool:
    xs = [x for p in panels for s in p.series for x in s.x]
    return bool(xs) and not any(p.xticklabels for p in panels) and all(float(x).is_integer() for x in xs)


def line_plot(path: str | Path, panels: Sequence[Panel], title: str, xlabel: str = "optimizer step") -> Path:
    """One figure of stacked panels sharing the x axis; returns the path written. Steps (integer x) get integer
    ticks, a series of one point a marker, a near-constant panel a y range around its values."""
    from matplotlib.ticker import MaxNLocator

    categorical = any(p.xticklabels for p in panels)  # long rotated layer names need room below each panel
    fig = _figure(len(panels), width=10.0 if categorical else 8.0, height=5.0 if categorical else 3.0)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    limits = [_near_constant_limits(p) for p in panels]
    for ax, panel, ylim in zip(axes, panels, limits, strict=True):
        for s in panel.series:
            y = [math.nan if v is None else v for v in _clean(s.y)]
            ax.plot(s.x, y, _style(s), label=s.label, markersize=4, linewidth=1.3)
        if ylim is not None:
            ax.set_ylim(*ylim)
        if not panel.log_y:
            ax.ticklabel_format(axis="y", useOffset=False)
        for label, y in panel.hlines.items():
            ax.axhline(y, color="grey", linestyle=":", linewidth=1, label=label)
        for label, x in panel.vlines.items():
            ax.axvline(x, color="grey", linestyle="--", linewidth=1, label=label)
        if panel.log_y and any(v and v > 0 for s in panel.series for v in _clean(s.y)):
            ax.set_yscale("log")
        if panel.xticklabels:
            step = max(1, math.ceil(len(panel.xticklabels) / 40))  # at most ~40 readable labels
            ax.set_xticks(range(0, len(panel.xticklabels), step))
            ax.set_xticklabels(panel.xticklabels[::step], rotation=90, fontsize=6)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        if len(panel.series) + len(panel.hlines) + len(panel.vlines) > 1:
            ax.legend(fontsize=7, loc="best", ncol=2 if len(panel.series) > 6 else 1)
    if _integer_x(panels):  # steps and samples are counts: no tick at step 2.5
        axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel(xlabel)
    fig.suptitle(title)
    low, high = axes[-1].get_xlim()
    meta = {"title": title, "xlabel": xlabel,
            "xticks": [float(t) for t in axes[-1].get_xticks() if low <= t <= high],
            "panels": [{"ylabel": p.ylabel, "ylim": list(ax.get_ylim()), "series": [_thin(s) for s in p.series],
                        "hlines": dict(p.hlines)} for p, ax in zip(panels, axes, strict=True)]}
    return _save(fig, Path(path), meta)


def read_series(path: str | Path) -> dict:
    """The numbers stored in a plot written here: {"title", "panels": [{"ylabel", "series": [{label, x, y}]}]}
    (or {"title", "matrix", "labels"} for a matrix plot)."""
    from PIL import Image

    with Image.open(path) as image:
        image.load()
        return json.loads(image.text[SERIES_KEY])


def series_by_label(path: str | Path) -> dict[str, dict]:
    """{label: {"x": [...], "y": [...]}} over every panel of a plot written by `line_plot`."""
    return {s["label"]: s for panel in read_series(path)["panels"] for s in panel["series"]}


def matrix_plot(path: str | Path, matrix: Sequence[Sequence[float]], labels: Sequence[str], title: str,
                xlabel: str = "predicted", ylabel: str = "true") -> Path:
    """A heat map with the counts written in the cells (up to 30 rows), e.g. a confusion matrix."""
    n = len(labels)
    side = min(4.0 + 0.45 * n, 30.0)
    fig = _figure(1, width=side, height=side - 0.6)
    ax = fig.subplots()
    image = ax.imshow(matrix, cmap="Blues")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xticklabels(labels, rotation=90, fontsize=8)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if n <= 30:
        top = max((max(row) for row in matrix), default=0)
        for i, row in enumerate(matrix):
            for j, value in enumerate(row):
                ax.text(j, i, f"{value:g}", ha="center", va="center", fontsize=7,
                        color="white" if value > top / 2 else "black")
    ax.set_title(title)
    return _save(fig, Path(path), {"title": title, "labels": list(labels), "matrix": [list(r) for r in matrix]})
