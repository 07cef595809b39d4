"""accel_train/compat.py: the other libraries' internals the package leans on, the versions each was checked with, a
version outside them said at start-up (or refused by the test-only shim); CI installs what the suite last passed with
(.ci/constraints.txt), and the README's test command is .ci/run's."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import CI, ROOT, run_toy

from accel_train import compat
from accel_train.core import stream


def _pins() -> dict[str, str]:
    pins = {}
    for line in (CI / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_every_reliance_names_a_file_that_exists_and_versions_in_major_minor_form():
    for reliance in compat.RELIANCES:
        path = reliance.where.split(" ")[0]
        assert (ROOT / "accel_train" / path).is_file() or (ROOT / path).is_file(), reliance
        assert all(re.fullmatch(r"\d+\.\d+", v) for v in reliance.checked), reliance


def test_the_constraints_ci_installs_are_versions_every_reliance_was_checked_with():
    pins = _pins()
    assert {"accelerate", "transformers", "datasets", "deepspeed"} <= set(pins)
    assert "torch" not in pins  # the command pins it (the CPU wheel), a constraint would fight the GPU build
    for reliance in compat.RELIANCES:
        version = pins.get(reliance.library) or torch.__version__
        assert compat.minor(version) in reliance.checked, (reliance.library, version, reliance.checked)


def test_readme_test_command_is_the_one_ci_runs_with_the_constraints():
    readme = (ROOT / "README.md").read_text()
    ci = (CI / "run").read_text()
    command = next(line for line in ci.splitlines() if line.startswith("python3 -m venv .venv"))
    assert "-c .ci/constraints.txt" in command
    assert command in readme


def test_a_version_outside_the_checked_ones_is_said_and_the_shim_refuses_it(monkeypatch):
    real = compat.installed_version
    monkeypatch.setattr(compat, "installed_version",
                        lambda name: "9.1.0" if name == "accelerate" else real(name))
    notes = compat.unchecked_notes()
    assert len(notes) == 1 and notes[0].startswith("accelerate 9.1.0 is not among the versions accel_train was "
                                                   "checked with (1.15, 1.16)")
    assert "a stream resumed at its saved position (core/stream.py)" in notes[0]
    assert "sharded" not in notes[0]  # the tests' shim is no user's concern
    with pytest.raises(SystemExit, match=r"relies on PartialState._prepare_backend and set_device, .* of accelerate, "
                                         r"checked with 1.15, 1.16; found 9.1.0"):
        compat.require_checked("tests/scripts/sharded_cpu.py")


def test_the_startup_report_says_which_library_was_not_checked(tmp_path, capsys, monkeypatch):
    real = compat.installed_version
    monkeypatch.setattr(compat, "installed_version", lambda name: "5.99.0" if name == "transformers" else real(name))
    out = run_toy(capsys, ["--output_dir", str(tmp_path), "--max_steps", "1", "--report_to", "none"]).out
    assert "note             transformers 5.99.0 is not among the versions accel_train was checked with (5.24)" in out


def test_on_checked_versions_the_startup_report_says_nothing(tmp_path, capsys):
    assert compat.unchecked_notes() == [], "the installed versions are outside accel_train/compat.py's"
    out = run_toy(capsys, ["--output_dir", str(tmp_path), "--max_steps", "1", "--report_to", "none"]).out
    assert "is not among the versions" not in out


def test_a_datasets_stream_whose_shuffle_buffer_cannot_be_read_resumes_by_re_reading():
    class IterableDataset(torch.utils.data.IterableDataset):  # a datasets stream whose internals moved
        __module__ = "datasets.iterable_dataset"

        def __iter__(self):
            yield {"x": torch.zeros(1)}

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    loader = torch.utils.data.DataLoader(IterableDataset())
    assert stream.shuffle_buffer(loader.dataset) is None

    class Config:
        save_strategy = "steps"

    # it may be shuffled: a saved position could lose the buffer, re-reading cannot
    assert stream.StreamPosition.of(loader, Config(), 1) is None


def test_unwrapping_asks_for_deepspeed_only_once_it_is_imported(monkeypatch):
    """Accelerate's unwrap imported DeepSpeed wherever it is installed (2.4 s of every run's start-up); after a
    run's build_accelerator it asks only once deepspeed is imported, as it is when DeepSpeed is the engine."""
    import importlib.machinery
    import sys
    import types

    import accelerate.utils.other as other
    from accelerate.utils import is_deepspeed_available

    from accel_train.core.accelerator import defer_deepspeed_probe

    defer_deepspeed_probe()
    defer_deepspeed_probe()  # once: not wrapped twice
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    assert other.is_deepspeed_available() is False
    model = torch.nn.Linear(2, 2)
    assert other.extract_model_from_parallel(model) is model and "deepspeed" not in sys.modules
    imported = types.ModuleType("deepspeed")  # what `import deepspeed` leaves, without its 2.4 s
    imported.__spec__ = importlib.machinery.ModuleSpec("deepspeed", None)
    monkeypatch.setitem(sys.modules, "deepspeed", imported)
    assert other.is_deepspeed_available() == is_deepspeed_available()
