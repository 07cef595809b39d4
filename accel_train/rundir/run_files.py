"""Which entries of output_dir the runs of this package wrote: output_dir/run_files.json, kept by the main process.

    {"written": ["all_results.json", "checkpoints", "config.yaml", "metrics.jsonl", "model.safetensors"],
     "foreign": ["README.md", "config.json", "tokenizer.json"], "open": false,
     "finished": {"step": 24, "total_steps": 24}}

`foreign` is what was in output_dir when a run first started there (a base model, the user's notes) and whatever
appeared later that is not a run's: no run deletes it, and a run that would write over it is refused before
training. `written` is everything else at the top of output_dir, recorded when an attempt ends (its finish, an error,
SIGTERM) by comparing the directory with `foreign`, so that whatever a run put there counts, whoever wrote it: the
loop, a hook, a recipe's finish step, a tracker, the report, the export. --overwrite_output_dir and the fresh start
of `--resume_from_checkpoint auto` delete `written`, nothing else. A file you add to output_dir while a run writes
there is taken for the run's.

What no attempt recorded (it was killed, or the entry appeared after it ended) is classified at the next start by
name (`survey`): this package's own layout names (config.yaml, checkpoints/, export/, ...) are a run's; the generic
names of a saved model (config.json, *.safetensors, tokenizer files, README.md) are a run's only after an attempt
that never recorded its end; anything else is foreign. A directory without run_files.json written by a version
before it is recognised by config.yaml and metrics.jsonl: its layout names are a run's, everything else foreign.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from ..errors import ConfigError
from .layout import ASIDE_FILES, CONFIG, HISTORY, MODEL_FILES, PACKAGE_NAMES, RUN_MANIFEST, aside

WRITE_PROBE = ".write-test-"  # the prefix of the probe files the output-dir check writes and removes
_TMP = aside(RUN_MANIFEST)


@dataclass(frozen=True)
class RunFiles:
    """The top-level entries of a run directory, classified (module docstring)."""

    written: frozenset[str] = frozenset()
    foreign: frozenset[str] = frozenset()
    open: bool = False  # an attempt started and has not recorded its end (it runs now, or it was killed)
    finished: dict | None = None  # {"step", "total_steps"} of the attempt that finished; None after any other end
    recorded: bool = False  # False: no run_files.json (a new directory, or one written before it existed)


def entries(output_dir: str | Path) -> set[str]:
    """The names at the top of output_dir, without the record itself, the probes of the output-dir check and the
    asides a kill left of the run's own files (ASIDE_FILES: neither the user's nor worth keeping)."""
    try:
        names = set(os.listdir(output_dir))
    except (FileNotFoundError, NotADirectoryError):  # nothing there yet (or no directory: refused as unwritable)
        return set()
    return {n for n in names if n != RUN_MANIFEST and n not in ASIDE_FILES and not n.startswith(WRITE_PROBE)}


def matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch(name, pattern) for pattern in patterns)


def read(output_dir: str | Path) -> RunFiles | None:
    """run_files.json as it is, or None when there is none. A file that is not one is refused, not guessed at."""
    path = Path(output_dir) / RUN_MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return RunFiles(frozenset(data["written"]), frozenset(data["foreign"]), bool(data["open"]),
                        data.get("finished"), recorded=True)
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{path} is not a record of the files runs wrote there ({err}). It is how "
                          "--overwrite_output_dir tells a run's files from yours: restore it, or move what you want "
                          "to keep out of the directory, delete it, and start again.") from None


def survey(output_dir: str | Path) -> RunFiles:
    """The entries now at the top of output_dir, each a run's (`written`) or not (`foreign`); reads only."""
    present = entries(output_dir)
    record = read(output_dir)
    if record is None:
        older_run = CONFIG in present and HISTORY in present  # a run of a version that kept no run_files.json
        written = {n for n in present if older_run and matches(n, PACKAGE_NAMES)}
        return RunFiles(frozenset(written), frozenset(present - written))
    unknown = present - record.written - record.foreign
    claimed = {n for n in unknown if matches(n, PACKAGE_NAMES) or (record.open and matches(n, MODEL_FILES))}
    return dataclasses.replace(record, written=frozenset((record.written | claimed) & present),
                               foreign=frozenset((record.foreign | (unknown - claimed)) & present))


def write(output_dir: str | Path, files: RunFiles) -> None:
    """Replace run_files.json at once (a crash leaves the old record or the new one, never half of one)."""
    out = Path(output_dir)
    data = {"written": sorted(files.written), "foreign": sorted(files.foreign), "open": files.open,
            "finished": files.finished}
    (out / _TMP).write_text(json.dumps(data, indent=1))
    os.replace(out / _TMP, out / RUN_MANIFEST)


def begin_attempt(output_dir: str | Path, replace: bool) -> tuple[list[str], list[str]]:
    """Main process, before an attempt writes anything: record what is there (`foreign` fixed for a new directory)
    and that an attempt is open; with `replace` (a run replaced), delete what the runs wrote first. The asides a
    killed attempt left (.metrics.jsonl.tmp: killed between the write and the rename) go: the files they were written
    for are whole. Returns (deleted, kept foreign) names."""
    files = survey(output_dir)
    for name in ASIDE_FILES:
        (Path(output_dir) / name).unlink(missing_ok=True)
    deleted = sorted(files.written) if replace else []
    for name in deleted:
        target = Path(output_dir) / name
        shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink(missing_ok=True)
    written = frozenset() if replace else files.written
    write(output_dir, RunFiles(written, files.foreign, open=True, finished=None, recorded=True))
    return deleted, sorted(files.foreign)


def end_attempt(output_dir: str | Path, finished: dict | None = None) -> None:
    """Main process, when an attempt ends (finished, or stopped by an error or SIGTERM): everything at the top of
    output_dir that is not foreign is the runs'. Nothing when no attempt began here."""
    record = read(output_dir)
    if record is None:
        return
    written = record.written | (entries(output_dir) - record.foreign)
    write(output_dir, dataclasses.replace(record, written=frozenset(written), open=False, finished=finished))


def collisions(files: RunFiles, patterns: Iterable[str]) -> list[str]:
    """The foreign entries a run would write over: those matching `patterns`, the names the run writes."""
    patterns = tuple(patterns)
    return sorted(name for name in files.foreign if matches(name, patterns))
