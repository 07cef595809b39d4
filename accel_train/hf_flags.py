"""The spellings of the Hugging Face example scripts (`run_glue_no_trainer.py`) and the `Trainer`, read as
accel_train's flags, so a command copied from there runs or says exactly what to change.

    --fp16 / --bf16                      --mixed_precision fp16 / bf16
    --max_train_steps N                  --max_steps N
    --num_warmup_steps N                 --warmup_steps N
    --max_length N                       --max_seq_length N (where the script has it)
    --evaluation_strategy S              --eval_strategy S (the Trainer's name before transformers 4.46)
    --checkpointing_steps N | epoch      --save_strategy steps --save_steps N | --save_strategy epoch
    --with_tracking                      trackers are on by default (--report_to tensorboard)
    --resume_from_checkpoint true        --resume_from_checkpoint latest
    --do_train / --do_eval / --do_predict   what a run always does / does with a validation / a test split

`translate(argv, known)` rewrites an argv; a flag whose meaning has no equivalent is a ConfigError that says
what to do instead. Unknown flags are answered with the closest known ones (`did_you_mean`).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

from .errors import ConfigError

TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")
# alias -> the flag it stands for, value unchanged
RENAMED = {"--max_train_steps": "--max_steps", "--num_warmup_steps": "--warmup_steps",
           "--max_length": "--max_seq_length", "--evaluation_strategy": "--eval_strategy"}
# flags that take an optional true/false, as the Trainer's booleans do
BOOLEAN = ("--fp16", "--bf16", "--with_tracking", "--do_train", "--do_eval", "--do_predict")
ALIASES = (*RENAMED, *BOOLEAN, "--checkpointing_steps")
# the launcher's flags (and the Trainer's device switches), which a script cannot act on once it runs
LAUNCHER_FLAGS = ("--cpu", "--use_cpu", "--no_cuda", "--num_processes", "--multi_gpu", "--num_machines")


def _bool_value(argv: list[str], i: int) -> tuple[bool, int]:
    """(value, arguments consumed) of a boolean flag at argv[i], bare or followed by true/false."""
    flag, _, inline = argv[i].partition("=")
    if inline:
        return inline.lower() in TRUE, 1
    if i + 1 < len(argv) and argv[i + 1].lower() in TRUE + FALSE:
        return argv[i + 1].lower() in TRUE, 2
    return True, 1


def translate(argv: Sequence[str], known: Iterable[str]) -> tuple[list[str], list[str]]:
    """(argv in accel_train's spelling, notes saying what was read how). `known`: the parser's flag names
    (`--learning_rate`, ...); a rename whose target the script does not have is left alone (then reported as
    unknown, with a suggestion)."""
    argv, known = list(argv), set(known)
    out: list[str] = []
    notes: list[str] = []
    flags = {"train": False, "eval": False, "predict": False}
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, inline = arg.partition("=")
        if flag in RENAMED and RENAMED[flag] in known and flag not in known:
            out += [RENAMED[flag] + eq + inline]
            notes.append(f"{flag} read as {RENAMED[flag]}")
        elif flag == "--resume_from_checkpoint" and (inline or (argv[i + 1] if i + 1 < len(argv) else "")).lower() \
                in TRUE + FALSE:
            value = (inline or argv[i + 1]).lower()
            if value in TRUE:
                out += ["--resume_from_checkpoint", "latest"]
                notes.append("--resume_from_checkpoint true read as --resume_from_checkpoint latest (the newest "
                             "complete checkpoint in --output_dir)")
            i += 1 if inline else 2
            continue
        elif flag == "--checkpointing_steps" and flag not in known:
            value = inline or (argv[i + 1] if i + 1 < len(argv) else "")
            if value.isdigit():
                out += ["--save_strategy", "steps", "--save_steps", value]
            elif value == "epoch":
                out += ["--save_strategy", "epoch"]
            else:
                raise ConfigError(f"--checkpointing_steps {value!r}: give a number of steps or 'epoch' (read as "
                                  "--save_strategy steps --save_steps N, or --save_strategy epoch).")
            read = "--save_strategy epoch" if value == "epoch" else f"--save_strategy steps --save_steps {value}"
            notes.append(f"--checkpointing_steps {value} read as {read}")
            i += 1 if inline else 2
            continue
        elif flag in LAUNCHER_FLAGS and flag not in known:
            raise ConfigError(f"{flag} is a flag of the launcher, not of the training script: give it to `accelerate "
                              f"launch {flag} ... SCRIPT`, before the script's name (on CPU: `accelerate launch --cpu "
                              "SCRIPT`, or ACCELERATE_USE_CPU=1 in the environment; a machine without GPUs trains "
                              "on its CPU already).")
        elif flag in BOOLEAN and flag not in known:
            value, used = _bool_value(argv, i)
            i += used
            if flag in ("--fp16", "--bf16"):
                if value:
                    out += ["--mixed_precision", flag[2:]]
                    notes.append(f"{flag} read as --mixed_precision {flag[2:]}")
            elif flag == "--with_tracking":
                if value:
                    notes.append("--with_tracking: trackers are on by default (--report_to tensorboard; "
                                 "--report_to all for every installed one)")
            else:
                flags[flag.removeprefix("--do_")] = value
            continue
        else:
            out.append(arg)
        i += 1
    notes += _do_flags(flags)
    return out, notes


def _do_flags(flags: dict[str, bool]) -> list[str]:
    """--do_train / --do_eval / --do_predict: a run always trains, evaluates on its validation split and predicts
    on a --test_file; evaluation or prediction alone is not a training run."""
    if not any(flags.values()):
        return []
    if not flags["train"]:
        asked = " / ".join(f"--do_{k}" for k, v in flags.items() if v)
        raise ConfigError(f"{asked} without --do_train: an accel_train run always trains (and evaluates, and "
                          "predicts for a --test_file). To only evaluate or predict, load a trained output_dir or "
                          "checkpoint folder with from_pretrained; to train as well, add --do_train.")
    notes = ["--do_train: a run always trains"]
    if flags["eval"]:
        notes.append("--do_eval: evaluation runs on the validation split at --eval_strategy (epoch by default)")
    if flags["predict"]:
        notes.append("--do_predict: predictions are written for --test_file (predict_results.jsonl) where the "
                     "script has one")
    return notes


def did_you_mean(unknown: Sequence[str], known: Iterable[str]) -> str:
    """' Did you mean --x (for --y)?' for the unknown flags that resemble a known one; '' when none does."""
    known = sorted(set(known))
    flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("--")]
    hints = []
    for flag in flags:
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        if close:
            hints.append(f"{close[0]} (for {flag})" if len(flags) > 1 else close[0])
    return f" Did you mean {', '.join(hints)}?" if hints else ""
