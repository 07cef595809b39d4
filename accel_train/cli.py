"""`accel-train`: the command-line companion of the package.

    accel-train launch [--preset NAME] [accelerate launch flags] SCRIPT [script flags]
    accel-train report RUN_DIR                      rebuild RUN_DIR/report.md and its plots
    accel-train compare RUN_DIR RUN_DIR ... [-o DIR] [--x step|samples]
                                                    overlay the curves of several runs (default DIR: compare)
    accel-train export RUN_DIR_OR_CHECKPOINT --format torchscript|exported_program|onnx [--output DIR]
                                                    export the trained model for inference, verified against it
    accel-train sweep --space SPACE.yaml [--trials N] [--metric NAME] [--study_dir DIR] -- SCRIPT [script flags]
                                                    a hyperparameter search with Optuna (a SQLite study, resumable)
    accel-train verify [--checks determinism,resume,accumulation] [--steps N] [--output_dir DIR] -- SCRIPT [flags]
                                                    check the script's own run is deterministic, resumes bitwise and
                                                    accumulates exactly; writes DIR/verify.json (docs/verify.md)

`launch` is `accelerate launch` without the CPU traps: `--cpu --num_processes N` (N > 1) starts N processes
joined in one gloo group (plain `accelerate launch --cpu` starts one), and every process is told how many
processes were requested so that a run that comes up with fewer fails at start. `--preset NAME` names one of
the shipped presets (accelerate_configs/NAME.yaml: cpu, cpu_multiprocess, single_gpu_bf16, ...) from any
working directory.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from .errors import LaunchError, UserError

_ENGINE_FLAGS = ("--multi_gpu", "--use_fsdp", "--use_deepspeed", "--use_megatron_lm", "--tpu")
# The shipped presets, in the source checkout beside the package (pip install -e .).
PRESETS_DIR = Path(__file__).resolve().parent.parent / "accelerate_configs"
LAUNCH_HELP = """usage: accel-train launch [--preset NAME] [accelerate launch flags] SCRIPT [script flags]

`accelerate launch` without the CPU traps:
  --cpu --num_processes N   N > 1 starts N processes joined in one gloo group (`accelerate launch --cpu` runs one)
  --preset NAME             a shipped preset by name, from any directory: {presets}
  --config_file FILE        an `accelerate config` file (what --preset names)
Every process is told how many processes were requested, so a run that comes up with fewer fails at start.
Every other `accelerate launch` flag is passed on (`accelerate launch --help` lists them); the script's own
flags follow the script (`python SCRIPT --help` lists them).

  accel-train launch --cpu --num_processes 2 recipes/nlp_finetune.py
  accel-train launch --preset single_gpu_bf16 recipes/nlp_finetune.py --num_train_epochs 3
"""


def presets() -> list[str]:
    """The names of the shipped presets (accelerate_configs/*.yaml)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def resolve_preset(name: str) -> Path:
    """The config file of preset `name`. A DeepSpeed JSON it names relative to the checkout is made absolute in a
    copy, so the preset works from any directory."""
    path = PRESETS_DIR / f"{Path(name).stem}.yaml"
    if not path.is_file():
        raise LaunchError(f"--preset {name}: no such preset; choose one of {', '.join(presets()) or '(none found)'} "
                          f"(looked in {PRESETS_DIR}), or give an `accelerate config` file with --config_file.")
    config = yaml.safe_load(path.read_text()) or {}
    deepspeed = config.get("deepspeed_config") or {}
    json_file = deepspeed.get("deepspeed_config_file")
    if json_file and not Path(json_file).is_absolute():
        found = next((p for p in (PRESETS_DIR / json_file, PRESETS_DIR.parent / json_file) if p.is_file()), None)
        if found is not None:
            import tempfile

            deepspeed["deepspeed_config_file"] = str(found)
            copy = Path(tempfile.mkdtemp(prefix="accel-train-preset-")) / path.name
            copy.write_text(yaml.safe_dump(config, sort_keys=False))
            return copy
    return path


def split_launch_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(launcher flags, [script, script flags]): the script is the first argument ending in .py."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg.endswith(".py") and not (i and argv[i - 1] in ("--config_file", "--config-file")):
            return argv[:i], argv[i:]
        if arg in ("-m", "--module") and i + 1 < len(argv):
            return argv[: i + 1], argv[i + 1:]
    raise LaunchError("accel-train launch: no script given (e.g. accel-train launch --cpu recipes/nlp_finetune.py).")


def _flag_value(args: list[str], *names: str) -> str | None:
    value = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                value = args[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def _take_preset(launcher: list[str]) -> list[str]:
    """--preset NAME (or --preset=NAME) replaced by --config_file PATH."""
    out, i = [], 0
    while i < len(launcher):
        arg = launcher[i]
        if arg == "--preset" or arg.startswith("--preset="):
            name = arg.split("=", 1)[1] if "=" in arg else (launcher[i + 1] if i + 1 < len(launcher) else "")
            if not name:
                raise LaunchError(f"--preset needs a name: {', '.join(presets())}.")
            out += ["--config_file", str(resolve_preset(name))]
            i += 1 if "=" in arg else 2
            continue
        out.append(arg)
        i += 1
    return out


def plan_launch(argv: Sequence[str], has_gpu: bool) -> tuple[list[str], dict[str, str]]:
    """The `accelerate launch` argv and the extra environment for an `accel-train launch` argv."""
    launcher, script = split_launch_args(argv)
    launcher = _take_preset(launcher)
    config_file = _flag_value(launcher, "--config_file", "--config-file")
    file_cfg: dict = {}
    if config_file:
        if not Path(config_file).is_file():
            hint = (f" From another directory, name the preset: --preset {Path(config_file).stem}."
                    if Path(config_file).stem in presets() else f" Shipped presets: --preset {', '.join(presets())}.")
            raise LaunchError(f"--config_file {config_file}: no such file.{hint}")
        file_cfg = yaml.safe_load(Path(config_file).read_text()) or {}
    num = _flag_value(launcher, "--num_processes", "--num-processes")
    num_processes = int(num) if num else int(file_cfg.get("num_processes", 1))
    wants_cpu = "--cpu" in launcher or bool(file_cfg.get("use_cpu")) or not has_gpu
    env = {"ACCEL_TRAIN_EXPECTED_WORLD_SIZE": str(num_processes)}
    if wants_cpu and num_processes > 1:
        if file_cfg.get("use_cpu"):
            raise LaunchError(
                f"{config_file} sets use_cpu: true, with which `accelerate launch` starts a single process. "
                "Use accelerate_configs/cpu_multiprocess.yaml (distributed_type: MULTI_GPU, use_cpu: false)."
            )
        launcher = [a for a in launcher if a != "--cpu"]
        if not any(flag in launcher for flag in _ENGINE_FLAGS) and file_cfg.get("distributed_type") in (None, "NO"):
            launcher.insert(0, "--multi_gpu")
        env["ACCELERATE_USE_CPU"] = "1"  # the processes join a gloo group instead of running unconnected
    return ["launch", *launcher, *script], env


def _launch(argv: Sequence[str]) -> int:
    if _wants_help(argv):
        print(LAUNCH_HELP.format(presets=", ".join(presets()) or "(none found)"))
        return 0
    import torch
    from accelerate.commands.accelerate_cli import main as accelerate_main

    args, env = plan_launch(argv, has_gpu=torch.cuda.is_available())
    os.environ.update(env)
    print(f"accel-train: accelerate {' '.join(args)}  ({', '.join(f'{k}={v}' for k, v in env.items())})",
          file=sys.stderr, flush=True)
    sys.argv = ["accelerate", *args]
    accelerate_main()
    return 0


def _wants_help(argv: Sequence[str]) -> bool:
    """No arguments, or -h / --help before the script (after it, the flag is the script's)."""
    try:
        launcher, _ = split_launch_args(argv)
    except LaunchError:
        launcher = list(argv)
    return not argv or any(a in ("-h", "--help") for a in launcher)


def _report(argv: Sequence[str]) -> int:
    from .observe.report import write_report

    parser = argparse.ArgumentParser(prog="accel-train report", description="Rebuild report.md and its plots.")
    parser.add_argument("run_dir", help="the --output_dir of a run")
    path = write_report(parser.parse_args(argv).run_dir)
    print(f"accel-train: wrote {path}")
    return 0


def _compare(argv: Sequence[str]) -> int:
    from .observe.report import compare_runs

    parser = argparse.ArgumentParser(prog="accel-train compare", description="Overlay the curves of several runs.")
    parser.add_argument("run_dirs", nargs="+", help="the --output_dir of each run")
    parser.add_argument("-o", "--output_dir", default="compare", help="where to write compare.md and the plots")
    parser.add_argument("--x", default="step", choices=("step", "samples"),
                        help="x axis: optimizer steps, or samples seen (runs with different global batches line up)")
    args = parser.parse_args(argv)
    path = compare_runs(args.run_dirs, args.output_dir, x=args.x)
    print(f"accel-train: wrote {path}")
    return 0


def _export(argv: Sequence[str]) -> int:
    from .deploy import DEFAULT_TOLERANCE, FORMATS, ModelFactory, export_run

    parser = argparse.ArgumentParser(prog="accel-train export", description=(
        "Export a trained model as TorchScript, a torch.export ExportedProgram or ONNX, load it back and compare it "
        "with the model on held-out inputs at other shapes. Writes the artifact and export.json (docs/deploy.md)."))
    parser.add_argument("source", help="a run's --output_dir, or one of its checkpoints/step-N directories")
    parser.add_argument("--format", required=True, choices=FORMATS, help="the artifact's format")
    parser.add_argument("--output", default=None, help="directory to write into (default: RUN_DIR/export/FORMAT)")
    parser.add_argument("--inputs", default=None, help="example inputs: a .safetensors of input tensors (rows "
                        "first) or a text file, one text per line (default: what the run kept, else made up)")
    parser.add_argument("--factory", default=None, help="module:callable that builds the untrained model, for a "
                        "plain nn.Module whose run recorded no model_factory.json")
    parser.add_argument("--factory_kwargs", default=None, help="JSON keyword arguments for --factory")
    parser.add_argument("--trust_factory", action="store_true", help="build the run's model_factory.json even when "
                        "it names a builder other than accel_train's own models: that runs its code, so only for a "
                        "run directory you made or trust")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help="largest |artifact - model| accepted (default %(default)g)")
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the exporter's)")
    args = parser.parse_args(argv)
    factory = ModelFactory.parse(args.factory, args.factory_kwargs) if args.factory else None
    export_run(args.source, args.format, args.output, factory=factory, inputs=args.inputs, tolerance=args.tolerance,
               opset=args.opset, trust_factory=args.trust_factory)
    return 0


def _sweep(argv: Sequence[str]) -> int:
    from .sweep import main as sweep_main

    return sweep_main(argv)


def _verify(argv: Sequence[str]) -> int:
    from .verify import main as verify_main

    return verify_main(argv)


COMMANDS = {"launch": _launch, "report": _report, "compare": _compare, "export": _export, "sweep": _sweep,
            "verify": _verify}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="accel-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=list(COMMANDS), help="what to do")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    parser.parse_args([command])
    try:
        return COMMANDS[command](rest)
    except UserError as err:
        print(f"accel-train {err.kind}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
