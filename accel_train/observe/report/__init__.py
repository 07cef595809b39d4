"""Run reports: `report.md` with PNG plots, built from the files of a run directory (build.py), rendered as
Markdown (markdown.py), drawn with matplotlib's object API (plots.py)."""

from .build import compare_runs, load_run, plot_schedule, write_report

__all__ = ["write_report", "compare_runs", "load_run", "plot_schedule"]
