"""`accel-train verify`: the seeded bugs (tests/scripts/verify/) each flagged by the check that names its class, their
fixed twins (`--fixed true`) passed, toy_train certified by all three checks; bad input refused with a message; the
cause paragraphs chosen from what was measured.

verify runs here, in the test process (`main(argv)`); its variants are processes of their own, as a user's are: a
process start (a generator seeded at start, a set's order) and a SIGKILL are what the checks see.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import ROOT, SCRIPTS

from accel_train import ConfigError
from accel_train.cli import main as cli_main
from accel_train.verify import CERTIFICATE, main, parse_args
from accel_train.verify.diagnose import accumulation_cause, determinism_cause, resume_cause
from accel_train.verify.runs import Variant, killed

BUGS = SCRIPTS / "verify"
TOY = SCRIPTS / "toy_train.py"


@pytest.fixture
def variant_env(monkeypatch):
    """The variants inherit this environment: no launcher variables of earlier in-process runs, the package on the
    path, one thread each (2 cores), and no PYTHONHASHSEED (a fixed one would hide the set-order bug)."""
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_")) or name in (
                "PYTHONHASHSEED", "ACCEL_TRAIN_FAULT"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def verify(out, script, check, *flags) -> tuple[int, dict]:
    code = main(["--checks", check, "--output_dir", str(out), "--", str(script), *flags])
    return code, json.loads((out / CERTIFICATE).read_text())


# (script, the check that names its class, the cause class it must be given)
SEEDED = [
    ("divided_loss.py", "accumulation", "loss scaled by the accumulation count"),
    ("unseeded_noise.py", "determinism", "data order / unseeded RNG"),
    ("set_order.py", "determinism", "data order / unseeded RNG"),
    ("init_order.py", "determinism", "data order / unseeded RNG"),
    ("global_noise.py", "resume", "data / RNG after resume"),
]


@pytest.mark.slow
@pytest.mark.parametrize("script,check,cause", SEEDED, ids=[s[0] for s in SEEDED])
def test_a_seeded_bug_is_flagged_by_its_check_and_its_twin_passes(tmp_path, variant_env, capsys, script, check,
                                                                  cause):
    code, certificate = verify(tmp_path / "bug", BUGS / script, check)
    result = certificate["checks"][check]
    assert (code, certificate["passed"], result["status"]) == (1, False, "failed")
    assert result["cause"] == cause and "What to change" in result["diagnosis"]
    measured = result["measured"]
    if check == "accumulation":  # the gradient of k accumulated micro-batches is 1/k of one batch's
        assert measured["grad_norm"][0] == pytest.approx(measured["grad_norm"][1] / 2, rel=1e-4)
        assert measured["loss_relative"] > 0.4
    else:
        # the largest difference over the compared steps: one step of other data can move the loss by little
        # (7.6e-4 measured once at the first step of unseeded_noise.py), not all of them
        assert measured["first_loss_difference"] and measured["tensors_differing"] > 0
        assert measured["largest_loss_relative"] > 1e-3
    if check == "resume":  # the uninterrupted run is deterministic; the resumed one differs from its first step
        assert measured["first_loss_difference"]["step"] == measured["resumed_from_step"] + 1
    assert f"{check} failed ({cause})" in capsys.readouterr().out

    code, certificate = verify(tmp_path / "twin", BUGS / script, check, "--fixed", "true")
    assert (code, certificate["passed"], certificate["checks"][check]["status"]) == (0, True, "passed")
    assert certificate["variants"] and all(
        attempt["command"][1] == str(BUGS / script) for variant in certificate["variants"].values()
        for attempt in variant["attempts"])


@pytest.mark.slow
def test_toy_train_is_certified_by_every_check(tmp_path, variant_env):
    """Six runs: two of 6 steps (determinism), one killed after step 5 and resumed from step 3 (resume, against the
    first), two of one step (accumulation 2 x 8 against 16)."""
    code, certificate = verify(tmp_path, TOY, "determinism,resume,accumulation")
    checks = certificate["checks"]
    assert code == 0 and {name: c["status"] for name, c in checks.items()} == dict.fromkeys(checks, "passed")
    assert len(checks) == 3
    assert checks["determinism"]["measured"]["steps_compared"] == 6
    resumed = checks["resume"]["measured"]
    assert (resumed["killed_after_step"], resumed["resumed_from_step"], resumed["steps_compared"]) == (5, 3, 3)
    assert resumed["optimizer_compared"] and resumed["optimizer_differing"] == [] and resumed["weights_compared"]
    attempts = certificate["variants"]["resumed"]["attempts"]
    assert attempts[0]["env"] == {"ACCEL_TRAIN_FAULT": "kill_after_step:5"} and attempts[0]["returncode"] == -9
    assert attempts[1]["command"][-4:-2] == ["--resume_from_checkpoint", "latest"] and attempts[1]["returncode"] == 0
    accumulated = checks["accumulation"]["measured"]
    assert (accumulated["micro_batch"], accumulated["accumulation_steps"]) == (8, 2)
    assert accumulated["loss_relative"] <= 1e-5 and accumulated["grad_norm_relative"] <= 1e-5


@pytest.mark.slow
def test_a_script_that_refuses_the_flags_is_bad_input(tmp_path, variant_env, capsys):
    script = tmp_path / "own_flags.py"
    script.write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    code = cli_main(["verify", "--checks", "determinism", "--output_dir", str(tmp_path / "v"), "--", str(script)])
    err = capsys.readouterr().err
    assert code == 2 and "refused the flags verify gives" in err and "unrecognized arguments: --max_steps" in err
    assert "parse_config" in err
    certificate = json.loads((tmp_path / "v" / CERTIFICATE).read_text())  # kept, with why verify stopped
    assert (certificate["exit_code"], certificate["passed"], certificate["checks"]) == (2, False, {})
    assert certificate["error"].startswith("config error:") and "--max_steps" in certificate["error"]
    assert certificate["variants"]["reference"]["attempts"][0]["returncode"] == 2


def test_bad_input_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the default --output_dir (verify) would be made
    with pytest.raises(ConfigError, match="after `--`"):
        parse_args(["--steps", "4", str(TOY)])
    with pytest.raises(ConfigError, match="unknown flags before `--`: --hidden 8"):
        parse_args(["--hidden", "8", "--", str(TOY)])
    with pytest.raises(ConfigError, match="not a Python script file"):
        parse_args(["--", str(tmp_path / "missing.py")])
    with pytest.raises(ConfigError, match="drop them"):
        parse_args(["--", str(TOY), "--output_dir", "x"])
    with pytest.raises(ConfigError, match="unknown speed"):
        parse_args(["--checks", "determinism,speed", "--", str(TOY)])
    with pytest.raises(ConfigError, match="at least 3"):
        parse_args(["--steps", "2", "--", str(TOY)])
    assert cli_main(["verify", "--", str(tmp_path / "missing.py")]) == 2
    assert "accel-train config error: accel-train verify:" in capsys.readouterr().err
    assert not (tmp_path / "verify").exists()
    parsed = parse_args(["--launch_args", "--cpu", "--steps", "4", "--", str(TOY), "--hidden", "8"])
    assert parsed.command(tmp_path)[:6] == [parsed.command(tmp_path)[0], "-m", "accel_train.cli", "launch", "--cpu",
                                            str(TOY)]
    assert (parsed.save_steps, parsed.kill_step, parsed.script_args) == (2, 3, ["--hidden", "8"])
    parsed = parse_args(["--accumulation_args", "--dropout 0", "--", str(TOY), "--hidden", "8"])
    assert parsed.accumulation_args == ["--dropout", "0"]
    assert parsed.command(tmp_path, parsed.accumulation_args)[1:6] == [str(TOY), "--hidden", "8", "--dropout", "0"]


def test_the_cause_paragraph_follows_what_was_measured():
    accumulated = {"accumulation_steps": 4, "micro_batch": 8, "loss": [0.1, 0.4], "grad_norm": [0.25, 1.0]}
    assert accumulation_cause(accumulated)[0] == "loss scaled by the accumulation count"
    assert accumulation_cause({**accumulated, "grad_norm": [4.0, 1.0]})[0] == "loss summed over micro-batches"
    assert accumulation_cause({**accumulated, "grad_norm": [1.3, 1.0]})[0] == "normalisation per micro-batch"
    # the main job's MiniLM with its dropout on: 2 x 32 against 64 (dropout off it passes, 4.5e-6)
    dropout = accumulation_cause({**accumulated, "grad_norm": [0.6288026571273804, 0.6277480721473694]})
    assert dropout[0] == "dropout or per-micro-batch normalisation" and "--accumulation_args" in dropout[1]
    first = {"step": 2, "loss": [0.5, 0.5000001], "relative": 2e-7}
    tensors = [{"tensor": "0.weight", "max_abs": 1e-7, "relative": 1e-7}]
    assert determinism_cause({"first_loss_difference": first, "largest_differences": tensors})[0] == \
        "nondeterministic kernel"
    assert determinism_cause({"first_loss_difference": {**first, "relative": 0.2}})[0] == "data order / unseeded RNG"
    # other data that by chance moved the first step's loss by little is still other data when a later step's moved
    small_first = {"first_loss_difference": {**first, "relative": 5e-5}}
    assert determinism_cause({**small_first, "largest_loss_relative": 5e-5})[0] == "nondeterministic kernel"
    assert determinism_cause({**small_first, "largest_loss_relative": 0.02})[0] == "data order / unseeded RNG"
    assert determinism_cause({"first_loss_difference": first,
                              "generators_differing_at_checkpoint": ["torch_manual_seed"]})[0] == "dropout / RNG"
    assert resume_cause({"first_loss_difference": {**first, "step": 4}, "resumed_from_step": 3})[0] == \
        "data / RNG after resume"
    assert resume_cause({"first_loss_difference": None, "optimizer_differing": ["state.0.exp_avg"],
                         "resumed_from_step": 3})[0] == "state outside the checkpoint"


def test_a_cut_run_is_killed_only_when_sigkill_ended_it(tmp_path):
    """A run that crashed before the kill point (exit 1 from a traceback: no status) is not taken for the cut run;
    under a launcher, which reports any failure as 1, the status run_cli writes at every other end tells them apart."""
    direct = parse_args(["--", str(TOY)])
    launched = parse_args(["--launch_args", "--cpu", "--", str(TOY)])

    def ended(code, status=None):
        return Variant("resumed", [], tmp_path, returncode=code, attempts=[{"status": status or {}}])

    assert killed(ended(-9), direct) and killed(ended(137), launched)
    assert not killed(ended(1), direct) and not killed(ended(0), direct)
    assert killed(ended(1), launched)  # accelerate launch: its child was killed
    assert not killed(ended(1, {"exit": 2, "kind": "config error"}), launched) and not killed(ended(2), launched)
