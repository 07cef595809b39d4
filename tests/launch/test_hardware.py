"""accelerate_configs/ and distributed runs on CPU: presets parse and run through the real launcher, two
"nodes" on one machine equal one process, and checkpoints move between world sizes."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import (
    ACCELERATE_CONFIGS,
    ROOT,
    SCRIPTS,
    free_port,
    kill_tree,
    launch,
    printed_per_rank,
    printing_to_a_file,
    reset_accelerate,
    run_process_tree,
    subprocess_env,
    toy_main,
    toy_on,
    toy_records,
)
from safetensors.torch import load_file

from accel_train import CheckpointError
from accel_train.cli import plan_launch

PRESETS = sorted(ACCELERATE_CONFIGS.glob("*.yaml"))
TOY = SCRIPTS / "toy_train.py"
QUIET = ["--report_to", "none", "--disable_tqdm"]


def test_there_is_a_preset_for_every_target():
    names = {p.stem for p in PRESETS}
    assert names == {"cpu", "cpu_multiprocess", "single_gpu_bf16", "single_gpu_fp16", "multi_gpu", "multi_node",
                     "fsdp", "deepspeed_zero2", "deepspeed_zero3"}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_parses_with_accelerate_and_says_when_and_how(preset):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(preset))
    header = [line for line in preset.read_text().splitlines() if line.startswith("#")]
    text = "\n".join(header)
    assert header[0].startswith("# When:"), preset
    assert f"--config_file accelerate_configs/{preset.name}" in text and "Launch" in text
    assert config.num_processes >= 1
    ds = (config.deepspeed_config or {}).get("deepspeed_config_file")
    if ds:
        assert "optimizer" in json.loads((ROOT / ds).read_text())


def test_fsdp_preset_is_fsdp2_full_shard_with_layer_wrap_and_sharded_state():
    from accelerate.commands.config.config_args import load_config_from_file

    fsdp = load_config_from_file(str(ACCELERATE_CONFIGS / "fsdp.yaml")).fsdp_config
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_reshard_after_forward"] is True
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"


def test_accel_train_launch_turns_cpu_multiprocess_into_a_gloo_group():
    args, env = plan_launch(["--cpu", "--num_processes", "2", "train.py", "--lr", "1"], has_gpu=False)
    assert args == ["launch", "--multi_gpu", "--num_processes", "2", "train.py", "--lr", "1"]
    assert env == {"ACCEL_TRAIN_EXPECTED_WORLD_SIZE": "2", "ACCELERATE_USE_CPU": "1"}
    preset = str(ACCELERATE_CONFIGS / "cpu_multiprocess.yaml")
    args, env = plan_launch(["--cpu", "--config_file", preset, "train.py"], has_gpu=True)
    assert args == ["launch", "--config_file", preset, "train.py"] and env["ACCELERATE_USE_CPU"] == "1"
    args, env = plan_launch(["--num_processes", "1", "train.py"], has_gpu=True)
    assert env == {"ACCEL_TRAIN_EXPECTED_WORLD_SIZE": "1"}


@pytest.mark.slow
def test_cpu_presets_run_the_nlp_recipe(tmp_path, request):
    tiny_bert = request.getfixturevalue("tiny_bert")
    sst_like = request.getfixturevalue("sst_like")
    recipe = ["recipes/nlp_finetune.py", "--model_name_or_path", str(tiny_bert), "--train_file",
              str(sst_like["train"]), "--validation_file", str(sst_like["dev"]), "--max_steps", "4",
              "--per_device_train_batch_size", "4", *QUIET]
    env = subprocess_env()
    single = run_process_tree([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                               "accelerate_configs/cpu.yaml", *recipe, "--output_dir", str(tmp_path / "cpu")], env, 600)
    assert single.returncode == 0, single.stderr[-3000:]
    assert "1 process(es), NO, device cpu" in single.stdout
    multi = run_process_tree([sys.executable, "-m", "accel_train.cli", "launch", "--cpu", "--config_file",
                              "accelerate_configs/cpu_multiprocess.yaml", "--main_process_port", str(free_port()),
                              *recipe, "--output_dir", str(tmp_path / "multi")], env, 600)
    assert multi.returncode == 0, multi.stderr[-3000:]
    assert "2 process(es), MULTI_CPU" in multi.stdout
    for name in ("cpu", "multi"):
        assert json.loads((tmp_path / name / "all_results.json").read_text())["train_steps"] == 4


def launch_two_nodes(args, tmp_path):
    """Two `accelerate launch` commands, machine rank 0 and 1, one process each, rendezvous on 127.0.0.1."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
               "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
               "--main_process_port", port, str(TOY), *args]
        log = open(tmp_path / f"node{rank}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(ACCELERATE_USE_CPU="1"), stdout=log,
                                      stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:  # a node that hangs (or a timeout) must not leave its workers behind
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
    assert codes == [0, 0], (tmp_path / "node0.log").read_text()[-3000:] + (tmp_path / "node1.log").read_text()[-3000:]


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_two_nodes_equal_one_process_with_the_same_global_batch(tmp_path, ranks):
    common = ["--num_train_epochs", "2", "--learning_rate", "0.05", "--logging_steps", "1", "--eval_strategy",
              "epoch", "--save_strategy", "no", *QUIET]
    launch_two_nodes([*common, "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "nodes")],
                     tmp_path)
    toy_on(ranks, [*common, "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path / "one")])
    nodes, one = tmp_path / "nodes", tmp_path / "one"
    assert "2 process(es), MULTI_CPU" in (tmp_path / "node0.log").read_text()
    diff = max_diff(load_file(one / "model.safetensors"), load_file(nodes / "model.safetensors"))
    assert diff < 1e-6
    a = json.loads((one / "all_results.json").read_text())
    b = json.loads((nodes / "all_results.json").read_text())
    assert a["eval_samples"] == b["eval_samples"] == 37 and a["eval_accuracy"] == b["eval_accuracy"]
    assert a["eval_loss"] == pytest.approx(b["eval_loss"], abs=1e-6)
    assert len(toy_records(nodes)) == 2  # both machine ranks trained


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_checkpoint_moves_between_world_sizes(tmp_path, before, after, ranks, capsys):
    """Same global batch (8 = 4 x 2 = 8 x 1): the data position is re-derived from the samples consumed, and the
    resume says so (2 processes: the session's spawned gloo ranks; the launcher is not what this tests)."""
    common = ["--num_train_epochs", "3", "--gradient_accumulation_steps", "2", "--learning_rate", "0.05",
              "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "5", "--eval_strategy", "no", *QUIET]
    bs = {1: "8", 2: "4"}
    toy_on(ranks, [*common, "--per_device_train_batch_size", bs[after], "--output_dir", str(tmp_path / "full")],
           after)
    cut = ["--output_dir", str(tmp_path / "cut")]
    toy_on(ranks, [*common, *cut, "--per_device_train_batch_size", bs[before], "--stop_at_step", "7"], before)
    resume = [*common, *cut, "--per_device_train_batch_size", bs[after], "--resume_from_checkpoint", "latest"]
    capsys.readouterr()
    if after == 2:
        ranks.run(printing_to_a_file, toy_main, resume)
        printed = printed_per_rank(tmp_path / "cut")[0]
    else:
        toy_main(resume)
        printed = capsys.readouterr().out
    assert f"was written by {before} process(es), resuming on {after}; the data position is re-derived" in printed
    manifests = [json.loads((p / "manifest.json").read_text()) for p in sorted((tmp_path / "cut").glob(
        "checkpoints/step-*"))]
    assert [m["world_size"] for m in manifests][-1] == after and manifests[0]["world_size"] == before
    diff = max_diff(load_file(tmp_path / "full" / "model.safetensors"),
                    load_file(tmp_path / "cut" / "model.safetensors"))
    assert diff < 1e-6
    # the samples seen after the resume are exactly those the uninterrupted run saw after step 7
    # (7 steps x 2 accumulation = 14 micro-batches per process before the cut)
    full_runs, cut_runs = toy_records(tmp_path / "full"), toy_records(tmp_path / "cut")
    full = sorted(i for rank in range(after) for b in full_runs[rank][0]["indices"][14:] for i in b)
    resumed = sorted(i for rank in range(after) for b in cut_runs[rank][-1]["indices"] for i in b)
    assert full == resumed


@pytest.mark.slow
def test_resume_with_another_global_batch_is_refused(tmp_path, ranks):
    common = ["--num_train_epochs", "2", "--save_strategy", "steps", "--save_steps", "3", "--eval_strategy", "no",
              *QUIET, "--output_dir", str(tmp_path)]
    toy_on(ranks, [*common, "--per_device_train_batch_size", "4"], 2)
    with pytest.raises(CheckpointError, match="global batch of 8 samples per step, this run has 4"):
        toy_on(ranks, [*common, "--per_device_train_batch_size", "4", "--resume_from_checkpoint", "latest"])


THREADS_SCRIPT = """
import json, sys, torch
from accel_train import build_accelerator, parse_config
from accel_train.core.accelerator import usable_cores
(config,) = parse_config(argv=sys.argv[1:])
accelerator = build_accelerator(config)
# one write per line: two processes printing at once must not interleave inside a line
sys.stdout.write("THREADS " + json.dumps({"rank": accelerator.process_index, "threads": torch.get_num_threads(),
                                         "cores": usable_cores()}) + chr(10))
sys.stdout.flush()
"""


def _threads(proc):
    return [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("THREADS ")]


@pytest.mark.slow
def test_a_lone_cpu_process_gets_the_cores_accelerate_launch_withheld(tmp_path):
    """`accelerate launch script.py` exports OMP_NUM_THREADS=1 on a machine without a GPU: the main job ran on one
    core of two. A lone CPU process now takes the cores and 2 processes keep 1 each, under the real launcher
    (--cpu_threads winning over that: test_cpu_threads_wins_over_the_lone_process_cores, in this process)."""
    script = tmp_path / "threads.py"
    script.write_text(THREADS_SCRIPT)
    out = ["--output_dir", str(tmp_path / "o")]
    (alone,) = _threads(launch(script, out))
    assert alone["threads"] == alone["cores"]
    pair = _threads(launch(script, out, num_processes=2))
    assert [r["threads"] for r in sorted(pair, key=lambda r: r["rank"])] == [1, 1]


def test_cpu_threads_wins_over_the_lone_process_cores(tmp_path, monkeypatch):
    """In the environment `accelerate launch` gives a lone CPU process (OMP_NUM_THREADS=1, its dynamo variable), the
    cores are taken unless --cpu_threads says otherwise."""
    import torch

    from accel_train import build_accelerator, parse_config
    from accel_train.core.accelerator import usable_cores

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    threads = torch.get_num_threads()
    try:
        seen = {}
        for flags in ([], ["--cpu_threads", "1"]):
            torch.set_num_threads(1)  # as the launcher left it
            (config,) = parse_config(argv=["--output_dir", str(tmp_path / "o"), *flags])
            build_accelerator(config)
            seen[tuple(flags)] = torch.get_num_threads()
            reset_accelerate()
        torch.set_num_threads(usable_cores())  # a --cpu_threads below what the process has is applied too
        (config,) = parse_config(argv=["--output_dir", str(tmp_path / "o"), "--cpu_threads", "1"])
        build_accelerator(config)
        seen["from the cores"] = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    assert seen == {(): usable_cores(), ("--cpu_threads", "1"): 1, "from the cores": 1}


@pytest.mark.slow
def test_a_launch_that_times_out_leaves_no_worker_behind(tmp_path):
    """On a timeout the launch helpers kill the launcher and every process below it: a hung worker of a failed
    test must not outlive it (one did, in CI, and held a core for the rest of the suite)."""
    script = tmp_path / "hang.py"
    script.write_text("import os, pathlib, time\n"
                      f"pathlib.Path({str(tmp_path)!r}, f'worker{{os.getpid()}}').touch()\n"
                      "time.sleep(600)\n")
    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        # a killed child that nobody reaped yet is a zombie: gone for our purposes
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"

    # the timeout must fall after both workers started (a few seconds): a longer one only where the machine is slow
    for timeout in (8, 16, 32):
        for old in tmp_path.glob("worker*"):
            old.unlink()
        with pytest.raises(subprocess.TimeoutExpired):
            launch(script, [], num_processes=2, timeout=timeout)
        workers = [int(p.name.removeprefix("worker")) for p in tmp_path.glob("worker*")]
        assert not [pid for pid in workers if alive(pid)]
        if len(workers) == 2:
            break
    assert len(workers) == 2
