"""Run reports: `report.md` with PNG plots, built from the files of a run directory, so the same report comes
at the end of a run and on demand (`accel-train report RUN_DIR`); `accel-train compare` overlays several runs.

A report reads config.yaml, metrics.jsonl, all_results.json, report/run_info.json and report/preflight.json
(written by the run), diagnostics/ when diagnostics were on, and a confusion matrix (report/confusion_matrix.json,
or a recipe's confusion_matrix.png). Whatever is missing is left out, so a run stopped early still gets one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ...errors import UserError
from ...rundir.layout import (
    CONFIG,
    CONFUSION_MATRIX_PLOT,
    CRASH_GLOB,
    HISTORY,
    KEPT_BEGIN,
    KEPT_END,
    REPORT,
    REPORT_DIR,
    RESULTS,
)
from .markdown import render, render_compare
from .plots import Panel, Series, line_plot, matrix_plot

NOT_METRICS = ("loss", "samples", "runtime", "items")  # eval_* entries that are not quality metrics
# What the loop itself logs in a training record; anything else there is a term the loss function logged.
TRAIN_KEYS = ("step", "loss", "learning_rate", "epoch", "grad_norm", "samples_per_second", "tokens_per_second",
              "data_wait_fraction", "mfu", "model_tflops", "cpu_peak_rss_mb", "gpu_peak_memory_mb", "skipped_steps",
              "nonfinite_skips", "num_items", "train_seconds")


@dataclass
class RunData:
    """What a report needs from one run directory."""

    path: Path
    config: dict = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    results: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    preflight: dict = field(default_factory=dict)
    crashes: list[dict] = field(default_factory=list)  # crash_rank<R>.json: why the run stopped with an error

    @property
    def name(self) -> str:
        return self.config.get("run_name") or self.path.name

    def curve(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of `key` during training; the final evaluation (marked "final") is in the results."""
        points = [(r["step"], r[key]) for r in self.records
                  if isinstance(r.get(key), (int, float)) and not r.get("final")]
        return [s for s, _ in points], [v for _, v in points]

    @property
    def global_batch_size(self) -> int | None:
        """Samples per optimizer step (per-device batch x processes x accumulation), from report/run_info.json."""
        size = (self.info.get("plan") or {}).get("global_batch_size")
        return int(size) if size else None

    def setup(self) -> dict:
        """What the config file does not say but a comparison needs: world size, global batch, precision."""
        return {"world_size": self.info.get("world_size"), "global_batch_size": self.global_batch_size,
                "precision": self.info.get("precision")}

    def loss_terms(self) -> list[str]:
        """Scalars a loss function logged beside the loss ("log": per-task losses, weights, ...)."""
        keys = {k for r in self.records if "loss" in r for k, v in r.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return sorted(k for k in keys if k not in TRAIN_KEYS)

    def eval_metrics(self) -> list[str]:
        keys = {k for r in self.records for k in r if k.startswith("eval_") and isinstance(r[k], (int, float))}
        return sorted(k for k in keys if k.removeprefix("eval_") not in NOT_METRICS)

    def jsonl(self, relative: str) -> list[dict]:
        path = self.path / relative
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory; `UserError` when it holds no run."""
    path = Path(run_dir)
    if not (path / HISTORY).exists() and not (path / CONFIG).exists():
        raise UserError(f"{path} is not a run directory (no metrics.jsonl or config.yaml). Give the --output_dir "
                        "of a run.")
    config = yaml.safe_load((path / CONFIG).read_text()) if (path / CONFIG).exists() else {}
    metrics = path / HISTORY
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() \
        else []
    crashes = [_json(p) for p in sorted(path.glob(CRASH_GLOB))]
    return RunData(path, config or {}, records, _json(path / RESULTS),
                   _json(path / REPORT_DIR / "run_info.json"), _json(path / REPORT_DIR / "preflight.json"), crashes)


# ------------------------------------------------------------------------------------------------ one run's plots


def plot_schedule(schedule: dict, path: Path, name: str = "") -> Path:
    """The pre-flight's simulated schedule: the learning rate of each distinct param group by optimizer step."""
    curves, series = [], []
    for i, lrs in enumerate(schedule["lr"]):
        if lrs not in curves and len(curves) < 8:
            curves.append(lrs)
            series.append(Series(f"group {i}", schedule["steps"], lrs))
    marks = {"end of warmup": schedule["warmup_steps"]} if schedule.get("warmup_steps") else {}
    return line_plot(path, [Panel("learning rate", series, vlines=marks)],
                     f"learning-rate schedule {name} (simulated before step 0)".replace("  ", " "))


def _plot_training(run: RunData, out: Path) -> dict[str, Path]:
    plots: dict[str, Path] = {}
    steps, loss = run.curve("loss")
    eval_steps, eval_loss = run.curve("eval_loss")
    if loss or eval_loss:
        series = [Series("train loss", steps, loss)]
        if eval_loss:
            series.append(Series("eval loss", eval_steps, eval_loss, "o--"))
        plots["loss"] = line_plot(out / "loss.png", [Panel("loss", series)], f"loss: {run.name}")
    lr_steps, lr = run.curve("learning_rate")
    if lr:
        series = [Series("learning rate (logged)", lr_steps, lr)]
        simulated = (run.preflight.get("schedule") or {})
        if simulated:
            series.append(Series("schedule simulated before step 0 (group 0)", simulated["steps"], simulated["lr"][0],
                                 "--"))
        plots["learning_rate"] = line_plot(out / "learning_rate.png", [Panel("learning rate", series)],
                                           f"learning rate: {run.name}")
    terms = run.loss_terms()
    if terms:
        plots["loss_terms"] = line_plot(out / "loss_terms.png", [Panel(t, [Series(t, *run.curve(t))]) for t in terms],
                                        f"terms the loss function logged: {run.name}")
    gn_steps, grad_norm = run.curve("grad_norm")
    if grad_norm:
        # what_ran's clipping is the one that ran (a DeepSpeed JSON may set its own); older runs record only the flag
        ran = (run.config.get("what_ran") or {}).get("clipping") or {"max_grad_norm": run.config.get("max_grad_norm")}
        clip = ran.get("max_grad_norm") or 0
        plots["grad_norm"] = line_plot(out / "grad_norm.png", [Panel(
            "gradient norm (before clipping)", [Series("grad norm", gn_steps, grad_norm)], log_y=True,
            hlines={f"clipping threshold {clip:g}": clip} if clip > 0 else {})], f"gradient norm: {run.name}")
    panels = []
    for keys, label in ((("samples_per_second", "tokens_per_second"), "samples, tokens per second"),
                        (("data_wait_fraction",), "share of time waiting for data"),
                        (("cpu_peak_rss_mb", "gpu_peak_memory_mb"), "peak memory (MiB)")):
        series = [Series(k.replace("_", " "), *run.curve(k)) for k in keys if run.curve(k)[1]]
        if series:
            label = series[0].label if len(series) == 1 and len(keys) > 1 and "memory" not in label else label
            panels.append(Panel(label, series, log_y=len(series) > 1 and "second" in label))
    if panels:
        plots["throughput"] = line_plot(out / "throughput.png", panels, f"throughput and resources: {run.name}")
    metrics = run.eval_metrics()
    if metrics:
        # Metrics on different scales (a recall and a median rank) in one panel would flatten the small ones:
        # many metrics share a panel only when every value is a fraction; the others get a panel each.
        fractions = [m for m in metrics if all(v is None or 0 <= v <= 1 for v in run.curve(m)[1])]
        shared = fractions if len(fractions) > 4 else []
        panels = [Panel("evaluation metrics (0-1)", [Series(m, *run.curve(m), "o-") for m in shared])] if shared else []
        panels += [Panel(m, [Series(m, *run.curve(m), "o-")]) for m in metrics if m not in shared]
        plots["metrics"] = line_plot(out / "metrics.png", panels, f"evaluation metrics: {run.name}")
    return plots


def _plot_diagnostics(run: RunData, out: Path) -> dict[str, Path]:
    plots: dict[str, Path] = {}
    confusion = _json(run.path / REPORT_DIR / "confusion_matrix.json")
    if confusion:
        plots["confusion_matrix"] = matrix_plot(out / CONFUSION_MATRIX_PLOT, confusion["matrix"], confusion["labels"],
                                                f"confusion matrix, last evaluation: {run.name}")
    flow = run.jsonl("diagnostics/grad_flow.jsonl")
    if flow:
        layers = list(flow[-1]["norms"])
        series = []
        for record in _spread(flow):
            rms = [_rms(record["norms"].get(n), record["sizes"].get(n)) for n in layers]
            series.append(Series(f"step {record['step']}", list(range(len(layers))), rms, "o-"))
        plots["grad_flow"] = line_plot(out / "grad_flow.png", [Panel("gradient RMS per value", series, log_y=True,
                                                                    xticklabels=layers)],
                                       f"gradient flow (input -> output): {run.name}", xlabel="layer")
    acts = run.jsonl("diagnostics/activations.jsonl")
    if acts:
        modules = list(acts[-1]["stats"])
        panels = []
        for stat, label, log in (("std", "activation std", True), ("zero_fraction", "share of zeros", False)):
            series = [Series(f"step {r['step']}", list(range(len(modules))),
                             [r["stats"].get(m, {}).get(stat) for m in modules], "o-") for r in _spread(acts)]
            panels.append(Panel(label, series, log_y=log, xticklabels=modules))
        plots["activations"] = line_plot(out / "activations.png", panels, f"activation statistics: {run.name}",
                                         xlabel="module (forward order)")
    return plots


def _spread(records: list[dict], most: int = 6) -> list[dict]:
    """At most `most` records, evenly spread, the last always included."""
    if len(records) <= most:
        return records
    stride = len(records) / most
    return [records[int(i * stride)] for i in range(most - 1)] + [records[-1]]


def _rms(norm: float | None, size: int | None) -> float | None:
    return None if norm is None or not size else norm / size ** 0.5


# ------------------------------------------------------------------------------------------------ report.md


def write_report(run_dir: str | Path, results: dict | None = None) -> Path:
    """Write `report.md` and its plots (under report/) for the run in `run_dir`; return the report's path.
    `results` replaces all_results.json (the loop passes the final metrics before writing that file)."""
    run = load_run(run_dir)
    if results is not None:
        run.results = dict(results)
    out = run.path / REPORT_DIR
    plots = {**_plot_training(run, out), **_plot_diagnostics(run, out)}
    if (out / "lr_schedule.png").exists():
        plots["lr_schedule"] = out / "lr_schedule.png"
    if "confusion_matrix" not in plots and (run.path / CONFUSION_MATRIX_PLOT).exists():
        plots["confusion_matrix"] = run.path / CONFUSION_MATRIX_PLOT  # a recipe's own (image_classification.py)
    drawn = {p.resolve() for p in plots.values()}
    for extra in sorted(out.glob("*.png")):  # what a recipe wrote into report/ itself
        if extra.resolve() not in drawn:
            plots[f"recipe:{extra.stem}"] = extra
    path = run.path / REPORT
    text = render(run, {k: p.relative_to(run.path).as_posix() for k, p in plots.items()})
    kept = kept_sections(path.read_text()) if path.is_file() else []
    path.write_text("\n\n".join([text.rstrip("\n"), *kept]) + "\n" if kept else text)
    return path


def kept_sections(text: str) -> list[str]:
    """The sections another command put into a report (between KEPT_BEGIN and KEPT_END, markers included: verify's
    certificate), which writing the report again keeps."""
    sections, start = [], text.find(KEPT_BEGIN)
    while start >= 0:
        stop = text.find(KEPT_END, start)
        if stop < 0:  # a section cut short: nothing to keep whole
            break
        sections.append(text[start:stop + len(KEPT_END)])
        start = text.find(KEPT_BEGIN, stop)
    return sections


# ------------------------------------------------------------------------------------------------ compare


X_AXES = {"step": "optimizer step", "samples": "samples seen"}


def compare_runs(run_dirs: list[str | Path], output_dir: str | Path, x: str = "step") -> Path:
    """Overlay the curves of several runs in `output_dir` (PNGs and compare.md with results, world size, global
    batch and config differences side by side); return the path of compare.md. `x="samples"` puts the runs on
    samples seen (step x global batch) instead of optimizer steps: runs with different batch sizes line up."""
    if x not in X_AXES:
        raise UserError(f"--x {x}: choose step or samples.")
    runs = [load_run(d) for d in run_dirs]
    names = _unique_names(runs)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    along = _x_axis(runs, x)

    def curve(run: RunData, key: str) -> tuple[list, list]:
        steps, values = run.curve(key)
        return along(run, steps), values

    plots: dict[str, Path] = {}
    loss = []
    for run, name in zip(runs, names, strict=True):
        loss.append(Series(f"{name} train", *curve(run, "loss")))
        if run.curve("eval_loss")[1]:
            loss.append(Series(f"{name} eval", *curve(run, "eval_loss"), "o--"))
    plots["loss"] = line_plot(out / "loss.png", [Panel("loss", loss)], "loss", X_AXES[x])
    for key, label, log in (("learning_rate", "learning rate", False), ("grad_norm", "gradient norm", True),
                            ("samples_per_second", "samples per second", False)):
        series = [Series(name, *curve(run, key)) for run, name in zip(runs, names, strict=True) if run.curve(key)[1]]
        if series:
            plots[key] = line_plot(out / f"{key}.png", [Panel(label, series, log_y=log)], label, X_AXES[x])
    metrics = sorted({m for run in runs for m in run.eval_metrics()})[:6]
    if metrics:
        panels = [Panel(m, [Series(name, *curve(run, m), "o-") for run, name in zip(runs, names, strict=True)
                            if run.curve(m)[1]]) for m in metrics]
        plots["metrics"] = line_plot(out / "metrics.png", panels, "evaluation metrics", X_AXES[x])
    path = out / "compare.md"
    path.write_text(render_compare(runs, names, {k: p.name for k, p in plots.items()}, X_AXES[x]))
    return path


def _x_axis(runs: list[RunData], x: str):
    """steps -> the x values of the comparison: the steps themselves, or the samples seen by then."""
    if x == "step":
        return lambda run, steps: steps
    missing = [str(run.path) for run in runs if run.global_batch_size is None]
    if missing:
        raise UserError(f"--x samples needs each run's global batch (report/run_info.json), missing in: "
                        f"{', '.join(missing)}. Compare by --x step instead.")
    return lambda run, steps: [s * run.global_batch_size for s in steps]


def _unique_names(runs: list[RunData]) -> list[str]:
    names = [run.name for run in runs]
    if len(set(names)) == len(names):
        return names
    return [f"{run.path.parent.name}/{run.path.name}" if names.count(run.name) > 1 else run.name for run in runs]
