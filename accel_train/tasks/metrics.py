"""Metric loading with `evaluate`, offline: the metric modules accel_train ships load by path.

`load_metric("f1")` loads the shipped scikit-learn module (one template for accuracy, f1, precision, recall,
matthews_correlation and top_k_accuracy); a name with its own folder under metric_modules/ loads that module;
any other name or path is passed to `evaluate.load` unchanged (which may need the Hub).
"""

from __future__ import annotations

from pathlib import Path

METRIC_MODULES = Path(__file__).parent / "metric_modules"
SKLEARN_TEMPLATE = METRIC_MODULES / "sklearn_metric" / "sklearn_metric.py"
SKLEARN_METRICS = ("accuracy", "f1", "matthews_correlation", "precision", "recall", "top_k_accuracy")


def shipped_metrics() -> list[str]:
    """The metric names `load_metric` resolves offline."""
    own = [p.name for p in METRIC_MODULES.iterdir() if (p / f"{p.name}.py").is_file() and p.name != "sklearn_metric"]
    return sorted([*SKLEARN_METRICS, *own])


def load_metric(name: str, **kwargs):
    """`evaluate.load` for a metric shipped with accel_train (offline) or any other name/path (may need the Hub)."""
    import evaluate

    if name in SKLEARN_METRICS:
        return evaluate.load(str(SKLEARN_TEMPLATE), config_name=name, **kwargs)
    local = METRIC_MODULES / name / f"{name}.py"
    return evaluate.load(str(local) if local.is_file() else name, **kwargs)
