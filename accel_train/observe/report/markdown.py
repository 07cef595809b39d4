"""The Markdown of `report.md` and `compare.md` (the plots are drawn in report.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from ...config import greater_is_better_for

CAPTIONS = {
    "loss": "Training loss (logged intervals) and evaluation loss.",
    "learning_rate": "Learning rate as logged, and the schedule the pre-flight check simulated: the two should agree.",
    "lr_schedule": "The schedule simulated before step 0, per distinct parameter group.",
    "grad_norm": "Global gradient norm before clipping; above the dotted line the step was clipped.",
    "throughput": "Throughput, the share of time spent waiting for data, and peak memory.",
    "metrics": "Evaluation metrics.",
    "loss_terms": "Terms the loss function logged beside the loss (per-task losses, weights), interval means.",
    "confusion_matrix": "Confusion matrix of the last evaluation (rows: true class, columns: predicted).",
    "grad_flow": "Gradient RMS per layer (input to output) at recorded steps: a layer far below the others is "
                 "vanishing; one that jumps far above its own past (and its peers) is exploding.",
    "activations": "Activation std and share of exact zeros per module at recorded steps.",
}


def _fmt(value: Any) -> str:
    if value is None:  # a NaN or infinity, written to JSON as null
        return "null"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def _table(rows: list[tuple], header: tuple) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]


def _summary(run) -> list[str]:
    res, info, plan = run.results, run.info, run.info.get("plan", {})
    steps = res.get("train_steps", info.get("final_step", run.records[-1]["step"] if run.records else 0))
    total = plan.get("total_steps")
    if run.crashes:
        crash = run.crashes[0]
        status = f"**crashed** at step {crash.get('step')}: {crash.get('error')}: {_first_line(crash.get('message'))}"
    elif not res:
        status = "no final results: the run was interrupted, diverged or is still running"
    elif total and steps < total:
        status = f"stopped early at step {steps} of {total}"
    else:
        status = "completed"
    rows = [("status", status), ("optimizer steps", f"{steps}" + (f" of {total} planned" if total else ""))]
    _, loss = run.curve("loss")
    if loss:
        rows.append(("training loss", f"{loss[0]:.4g} (first log) -> {loss[-1]:.4g} (last log)"))
    best = _best(run)
    if best:
        rows.append(("best " + best[0], f"{best[1]:.4g} at step {best[2]}"))
    if "train_runtime" in res:
        rows.append(("training time", f"{res['train_runtime']:.1f} s, {res.get('train_samples_per_second', 0):.1f} "
                                      "samples/s"))
    if "wall_seconds" in info:
        rows.append(("wall time (incl. evaluation, checkpoints)", f"{info['wall_seconds']:.1f} s"))
    return _table(rows, ("", ""))


def _best(run):
    cfg = run.config
    name = cfg.get("metric_for_best_model") or "eval_loss"
    name = name if name.startswith("eval_") else f"eval_{name}"
    greater = cfg.get("greater_is_better")
    greater = greater_is_better_for(name) if greater is None else greater
    steps, values = run.curve(name)
    if not values:
        return None
    i = max(range(len(values)), key=lambda k: values[k] if greater else -values[k])
    return name, values[i], steps[i]


def _first_line(text: Any, most: int = 300) -> str:
    line = str(text or "").strip().splitlines()[0] if str(text or "").strip() else ""
    return line if len(line) <= most else line[:most] + " ..."


def _crash(run) -> list[str]:
    """Why the run stopped: each rank's error and the end of its traceback (crash_rank<R>.json)."""
    lines = []
    for crash in run.crashes:
        tail = str(crash.get("traceback", "")).rstrip().splitlines()[-25:]
        lines += [f"Rank {crash.get('rank')} stopped at step {crash.get('step')} ({crash.get('time')}) with "
                  f"`{crash.get('error')}`: {crash.get('message')}", "", "```", *tail, "```", ""]
    return lines


def _preflight(run) -> list[str]:
    findings = run.preflight.get("findings")
    if not findings:
        return ["The pre-flight check did not run (--no_preflight, or a report rebuilt without it)."]
    lines = [f"{len(findings)} findings in {run.preflight.get('seconds', 0):.2f} s. Errors refuse to start the run, "
             "so a report only ever shows warnings and passed checks.", ""]
    for f in sorted(findings, key=lambda f: f["level"] != "warning"):
        mark = "WARNING" if f["level"] == "warning" else "ok"
        lines.append(f"- **{mark}** `{f['check']}`: {f['message']}" + (f" *Fix:* {f['fix']}" if f["fix"] and
                                                                        f["level"] != "ok" else ""))
    return lines


def _flags(records: list[dict]) -> list[str]:
    first: dict[tuple[str, str], int] = {}
    for record in records:
        for kind, layers in record.get("flags", {}).items():
            for layer in layers:
                first.setdefault((kind, layer), record["step"])
    return [f"- {kind.replace('_', ' ')}: `{layer}` (first at step {step})" for (kind, layer), step in first.items()]


def _diagnostics(run, plots: dict[str, str]) -> list[str]:
    lines: list[str] = []
    flow, acts = run.jsonl("diagnostics/grad_flow.jsonl"), run.jsonl("diagnostics/activations.jsonl")
    if flow:
        flagged = _flags(flow)
        lines += [f"**Gradient flow**: {len(flow)} recorded step(s), {len(flow[-1]['norms'])} layers; per-layer "
                  "norms in `diagnostics/grad_flow.jsonl`. " + ("Flagged layers:" if flagged else "No layer flagged."),
                  *flagged, ""]
    if acts:
        flagged = _flags(acts)
        lines += [f"**Activations**: {len(acts)} recorded step(s); `diagnostics/activations.jsonl`. "
                  + ("Flagged modules:" if flagged else "No module dead (>= 99% zeros) or non-finite."), *flagged, ""]
    for trace in sorted((run.path / "profiler").glob("*.pt.trace.json*")):
        lines.append(f"- profiler trace `{trace.relative_to(run.path)}` (open in ui.perfetto.dev or chrome://tracing, "
                     f"or `tensorboard --logdir {run.path / 'profiler'}` with torch-tb-profiler)")
    for table in sorted((run.path / "profiler").glob("key_averages_rank*.txt"))[:1]:
        lines += ["", f"Top operators (`{table.relative_to(run.path)}`):", "", "```",
                  *table.read_text().splitlines()[:16], "```", ""]
    for snapshot in sorted((run.path / "diagnostics").glob("memory_step*.json")):
        data = json.loads(snapshot.read_text())
        parts = ", ".join(f"{k.removesuffix('_mb')} {v} MiB" for k, v in data.items() if k.endswith("_mb"))
        lines.append(f"- memory snapshot `{snapshot.relative_to(run.path)}`: {parts}"
                     + (f"; CUDA allocator history `{data['cuda_snapshot']}` (pytorch.org/memory_viz)"
                        if "cuda_snapshot" in data else ""))
    for report in sorted(run.path.glob("nonfinite_step*_rank*.json")):
        lines.append(f"- non-finite report `{report.name}`: {_nonfinite_summary(report)}")
    return lines


def _nonfinite_summary(path: Path) -> str:
    data = json.loads(path.read_text())
    return (f"step {data.get('step')}, first non-finite output {data.get('first_nonfinite_output')}, "
            f"gradient {data.get('first_nonfinite_gradient')}")


def _setup(run) -> list[str]:
    info = run.info
    if not info:
        return ["(no report/run_info.json: the run predates run reports)"]
    hw, plan = info.get("hardware", {}), info.get("plan", {})
    gpus = f", {len(hw['gpus'])} x {hw['gpus'][0]} ({hw.get('gpu_memory_gb')} GB)" if hw.get("gpus") else ""
    rows = [("world size", f"{info['world_size']} process(es), {info['distributed_type']}"),
            ("device", hw.get("device")), ("precision", info.get("precision")),
            ("hardware", f"{hw.get('cpu_count')} CPU cores{gpus}, {hw.get('platform')}"),
            ("software", ", ".join(f"{k} {v}" for k, v in info.get("versions", {}).items())),
            ("model", f"{info['model']['class']}: {info['model']['parameters']:,} parameters, "
                      f"{info['model']['trainable']:,} trainable"),
            ("training samples", info.get("num_train_samples")),
            ("global batch", plan.get("global_batch_size") or "varies (--max_tokens_per_batch)"),
            ("steps", f"{plan.get('steps_per_epoch')} per epoch, {plan.get('total_steps')} planned, "
                      f"{plan.get('warmup_steps')} warmup"),
            ("started / finished", f"{info.get('started_at')} / {info.get('finished_at', '-')}"),
            ("pre-flight check", f"{info.get('preflight_seconds')} s")]
    if info.get("resumed_from_step"):
        rows.append(("resumed", f"from step {info['resumed_from_step']}"))
    return _table(rows, ("", ""))


def render(run, plots: dict[str, str]) -> str:
    """report.md for one run; `plots` maps a plot name to its path relative to the run directory."""
    out = [f"# Run report: {run.name}", "", f"Run directory `{run.path}`.", "", *_summary(run), ""]
    if "overfit_passed" in run.results:
        verdict = "passed" if run.results["overfit_passed"] else "FAILED"
        out += ["## Overfit check", "", f"**{verdict}**: loss {run.results['overfit_initial_loss']:.4g} -> "
                f"{run.results['overfit_final_loss']:.4g} in {run.results['overfit_steps']} steps on "
                f"{run.config.get('overfit_batches')} fixed batch(es) (target: 5% of the first loss).", ""]
    if run.crashes:
        out += ["## Crash", "", *_crash(run)]
    warnings = [r for r in run.records if isinstance(r.get("warning"), str)]
    if warnings:
        out += ["## Warnings", "", *[f"- step {r.get('step')}: {r['warning']}" for r in warnings], ""]
    if run.results:
        out += ["## Results", "", *_table(sorted(run.results.items()), ("metric", "value")), ""]
    out += ["## Pre-flight check", "", *_preflight(run), "", "## Curves", ""]
    for name in ("loss", "loss_terms", "learning_rate", "lr_schedule", "grad_norm", "throughput", "metrics",
                 "confusion_matrix"):
        if name in plots:
            out += [f"![{name}]({plots[name]})", "", f"*{CAPTIONS[name]}*", ""]
    recipe_plots = sorted(name for name in plots if name.startswith("recipe:"))
    if recipe_plots:
        out += ["## Recipe plots", ""]
        for name in recipe_plots:
            out += [f"![{name.removeprefix('recipe:')}]({plots[name]})", ""]
    diagnostics = _diagnostics(run, plots)
    if diagnostics or "grad_flow" in plots or "activations" in plots:
        out += ["## Diagnostics", ""]
        for name in ("grad_flow", "activations"):
            if name in plots:
                out += [f"![{name}]({plots[name]})", "", f"*{CAPTIONS[name]}*", ""]
        out += [*diagnostics, ""]
    out += ["## Run setup and timings", "", *_setup(run), "", "## Resolved config", "", "```yaml",
            yaml.safe_dump(run.config, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(out)


def render_compare(runs, names: list[str], plots: dict[str, str], xlabel: str = "optimizer step") -> str:
    """compare.md: the overlaid plots (x: `xlabel`), final results side by side, the setup (world size, global
    batch, precision) of each run, and the config keys that differ, world size and global batch included."""
    out = ["# Run comparison", "", *[f"- **{n}**: `{r.path}`" for r, n in zip(runs, names, strict=True)], "",
           f"Curves by {xlabel}.", ""]
    for name, file in plots.items():
        out += [f"![{name}]({file})", ""]
    keys = sorted({k for r in runs for k in r.results})
    if keys:
        out += ["## Results", "", *_table([(k, *(r.results.get(k, "-") for r in runs)) for k in keys],
                                          ("metric", *names)), ""]
    setups = [r.setup() for r in runs]
    out += ["## Setup", "", *_table([(k, *(_fmt(s.get(k)) if s.get(k) is not None else "-" for s in setups))
                                     for k in setups[0]], ("", *names)), ""]
    # world size and global batch are not in config.yaml, yet change what a step means: compared with the config
    configs = [{**r.config, **{k: v for k, v in s.items() if k != "precision"}} for r, s in zip(runs, setups,
                                                                                               strict=True)]
    differing = sorted(k for k in {k for c in configs for k in c}
                       if len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1)
    out += ["## Config differences", ""]
    if differing:
        out += _table([(k, *(json.dumps(c.get(k)) for c in configs)) for k in differing], ("key", *names))
    else:
        out.append("The runs have the same config.")
    return "\n".join(out) + "\n"
