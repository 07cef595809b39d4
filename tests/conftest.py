"""Shared test helpers: offline environment, fresh Accelerate state, and real multi-process launches."""

from __future__ import annotations

import contextlib
import json
import multiprocessing.process
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
SCRIPTS = ROOT / "tests" / "scripts"  # the scripts tests launch (toy_train, token_train, sharded_cpu, ...)
CI = ROOT / ".ci"  # the tools: the import-linter plugin (import_contracts)
SHARED_DATA = ROOT.parent / "shared" / "data"
ACCELERATE_CONFIGS = ROOT / "accelerate_configs"  # the launcher presets
# Recipes, test scripts and tools are scripts, not a package: tests import them by their file names.
sys.path[:0] = [str(RECIPES), str(SCRIPTS), str(CI)]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# datasets sleeps 5 s whenever an interleaved parquet stream (a shuffled --stream_dir) closes its reader threads, a
# guard against an Arrow crash at interpreter exit (apache/arrow#45214; 0.1 s was reported to suffice). The stream
# tests close such streams at every epoch end, cut and resume: 26 of the shuffled-stream cell's 29 s were this sleep.
# In the tests' own processes (pytest and its ranks) it is 0.2 s; launched runs keep datasets' 5 s.
import datasets.config  # noqa: E402

datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0.2


# ------------------------------------------------------------------ where the suite's time goes
# Every run writes test-durations.txt (the slowest tests, and per module: tests, seconds, the Python processes it
# started and the processes it forked), and pytest prints its head at the end: .ci/run keeps it in the CI log. A new
# process imports torch, transformers and accelerate again (seconds each); a fork does not.
DURATIONS = ROOT / "test-durations.txt"
_STARTS: dict[str, list[int]] = {}  # module -> [python processes started, forks]
_TIMES: dict[str, float] = {}  # test id -> seconds (setup + call + teardown)
_UNMARKED: dict[str, int] = {}  # tests not marked slow that started processes -> how many
# This process's starts and forks during the running test. They travel with the test's teardown report: under
# pytest-xdist the tests run in worker processes and only the reports reach the one that writes the summary.
_counted = [0, 0]
_current = {"test": None}


def _counting(method, index: int):
    def wrapper(self, *args, **kwargs):
        command = str(args[0] if args else kwargs.get("args", "")) if index == 0 else "fork"
        starts_python = any(word in command for word in ("python", "accelerate", "accel-train", "torchrun", "sbatch"))
        if _current["test"] is not None and (index == 1 or starts_python):
            _counted[index] += 1
        return method(self, *args, **kwargs)
    return wrapper


subprocess.Popen.__init__ = _counting(subprocess.Popen.__init__, 0)
multiprocessing.process.BaseProcess.start = _counting(multiprocessing.process.BaseProcess.start, 1)


def pytest_runtest_setup(item):
    _current["test"] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if call.when == "teardown":
        report.user_properties.append(("process_starts", tuple(_counted)))
        _counted[:] = [0, 0]


def pytest_runtest_logreport(report):
    _TIMES[report.nodeid] = _TIMES.get(report.nodeid, 0.0) + report.duration
    for _, (started, forked) in (p for p in report.user_properties if p[0] == "process_starts"):
        entry = _STARTS.setdefault(report.nodeid.split("::")[0], [0, 0])
        entry[0] += started
        entry[1] += forked
        if started and "slow" not in report.keywords:
            _UNMARKED[report.nodeid] = started


_STARTED = time.monotonic()


def pytest_collection_modifyitems(session, config, items):
    """Modules with the most `slow` tests first, each module's tests in their own order. Under pytest-xdist
    (`-n 2 --dist loadfile`: a module runs whole on one worker, its module fixtures built once) the long modules then
    start early instead of leaving one worker alone with the last of them; a plain run gets the same order."""
    slow: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        slow[module] = slow.get(module, 0) + (item.get_closest_marker("slow") is not None)
    first_seen = {m: i for i, m in reversed(list(enumerate(item.nodeid.split("::")[0] for item in items)))}
    items.sort(key=lambda item: (-slow[m := item.nodeid.split("::")[0]], first_seen[m]))


def pytest_terminal_summary(terminalreporter, config):
    if not _TIMES or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    modules: dict[str, list[float]] = {}
    for nodeid, seconds in _TIMES.items():
        entry = modules.setdefault(nodeid.split("::")[0], [0, 0.0])
        entry[0] += 1
        entry[1] += seconds
    workers = getattr(config.option, "numprocesses", None) or 1
    lines = [f"{len(_TIMES)} tests, {sum(_TIMES.values()) / 60:.1f} min in tests, "
             f"{(time.monotonic() - _STARTED) / 60:.1f} min from start to summary on {workers} worker(s)", "",
             "slowest tests:"]
    lines += [f"{s:8.1f} s  {n}" for n, s in sorted(_TIMES.items(), key=lambda kv: -kv[1])[:20]]
    lines += ["", "by module: seconds, tests, python processes started, processes forked"]
    for module, (count, seconds) in sorted(modules.items(), key=lambda kv: -kv[1][1]):
        started, forked = _STARTS.get(module, [0, 0])
        lines.append(f"{seconds:8.1f} s  {count:4d}  {started:4d}  {forked:4d}  {module}")
    lines += ["", "not marked slow, and started processes (the slow marker says which tests start them):"]
    lines += [f"{count:4d}  {test}" for test, count in sorted(_UNMARKED.items())] or ["  none"]
    DURATIONS.write_text("\n".join(lines) + "\n")
    # every test's seconds, for ranking what to cut next (the text file keeps only the slowest 20)
    DURATIONS.with_suffix(".json").write_text(json.dumps(
        {"tests": dict(sorted(_TIMES.items(), key=lambda kv: -kv[1])),
         "processes": {m: {"started": s, "forked": f} for m, (s, f) in _STARTS.items()}}, indent=1))
    terminalreporter.write_sep("-", f"where the time went (all of it in {DURATIONS.name})")
    for line in lines[:25]:
        terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; each test starts from a clean slate."""
    reset_accelerate()
    yield
    reset_accelerate()


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    launcher_vars = ("ACCELERATE_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher_vars)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def launch(script: str | Path, args: list[str], num_processes: int = 1, check: bool = True, timeout: int = 600,
           launcher_args: list[str] | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `script` through the real `accelerate launch` (N gloo processes on CPU when N > 1)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if num_processes > 1:
        cmd += ["--multi_gpu", "--num_processes", str(num_processes), "--main_process_port", str(free_port())]
    else:
        cmd += ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += [*(launcher_args or []), str(script), *args]
    proc = run_process_tree(cmd, env or subprocess_env(ACCELERATE_USE_CPU="1"), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return proc


def run_process_tree(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout), but a timeout (or an interrupt) kills
    the launcher *and every process below it*: torch's launcher starts each worker in a session of its own, so
    neither killing the launcher nor its process group reaches a hung worker, which would outlive its test."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        kill_tree(proc.pid)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and all its descendants. Each is stopped first (SIGSTOP), and the tree is listed again until no
    new process appears: a stopped process starts no other, and a child is not re-parented out of reach while its
    parent is only stopped (listing once and killing let a worker the launcher was starting at that moment escape,
    re-parented to init, in CI)."""
    stopped: list[int] = []
    while True:
        new = [member for member in _descendants_and_self(pid) if member not in stopped]
        if not new:
            break
        for member in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(member, signal.SIGSTOP)
        stopped += new
    for member in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def _descendants_and_self(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


# ------------------------------------------------------------------ N gloo ranks that stay up for the session
class Ranks:
    """`world` spawned processes, started once per session, that run a function on `world` gloo ranks: for tests of
    what happens on several processes where the launcher is not what they test (tests/launch/ launches for real).
    Each process imports torch once; a task costs what its function costs. Spawned, not forked: a fork of a process
    whose math libraries already ran on several threads can hang in its first matmul.

        ranks.run(module_function, arg1, env={"ACCEL_TRAIN_FAULT": ...})   # on every rank, raises if one fails
    """

    def __init__(self, world: int = 2):
        import multiprocessing

        self.context, self.world, self.workers = multiprocessing.get_context("spawn"), world, []

    def start(self) -> None:
        self.results = self.context.Queue()
        self.inboxes = [self.context.Queue() for _ in range(self.world)]
        self.workers = [self.context.Process(target=_rank_worker, args=(rank, self.world, self.inboxes[rank],
                                                                        self.results), daemon=True)
                        for rank in range(self.world)]
        for worker in self.workers:
            worker.start()

    def run(self, function, *args, env: dict[str, str] | None = None, timeout: float = 600) -> None:
        import queue

        if not self.workers or not all(w.is_alive() for w in self.workers):
            self.stop()
            self.start()
        task = (function.__module__, function.__qualname__, args, dict(env or {}), free_port())
        for inbox in self.inboxes:
            inbox.put(task)
        errors = []
        try:
            for _ in range(self.world):
                rank, error = self.results.get(timeout=timeout)
                if error:
                    errors.append(f"rank {rank}:\n{error}")
        except queue.Empty:
            self.stop()  # a hung rank: the next task starts new processes
            raise AssertionError(f"{function.__qualname__}: not done on {self.world} ranks in {timeout} s") from None
        if errors:
            raise AssertionError("\n".join(errors))

    def stop(self) -> None:
        for worker in self.workers:
            worker.kill()
            worker.join()
        self.workers = []


def _rank_worker(rank: int, world: int, inbox, results) -> None:
    import importlib
    import traceback

    torch.set_num_threads(1)
    base = dict(os.environ)
    while True:
        task = inbox.get()
        module, name, args, env, port = task
        os.environ.clear()
        os.environ.update(base)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ACCELERATE_USE_CPU="1", **env)
        try:
            reset_accelerate()
            function = importlib.import_module(module)
            for part in name.split("."):
                function = getattr(function, part)
            function(*args)
            error = None
        except BaseException:  # noqa: BLE001 - the parent reports it with the rank
            error = traceback.format_exc()
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        results.put((rank, error))


def toy_main(args: list[str]) -> None:
    """tests/scripts/toy_train.py's main in this process (Ranks runs it on each rank)."""
    import toy_train

    reset_accelerate()
    toy_train.main(args)


def nlp_main(args: list[str]):
    """recipes/nlp_finetune.py's main in this process (Ranks runs it on each rank); returns what main returns."""
    import nlp_finetune

    reset_accelerate()
    return nlp_finetune.main(args)


def toy_on(ranks: Ranks, args: list[str], processes: int = 1) -> None:
    """toy_train in this process for 1 process, on the session's spawned gloo ranks for 2: where the launcher is not
    what a test is about (tests/launch/ keeps a real launch per promise about the launcher)."""
    if processes == 1:
        toy_main(args)
    else:
        ranks.run(toy_main, args)


def printing_to_a_file(main, argv: list[str]) -> None:
    """`main(argv)` on this rank, what it prints on stdout kept in <output_dir>/stdout_rank<R>.txt: a pooled rank's
    stdout is the test session's. `ranks.run(printing_to_a_file, main, argv)`; read back with `printed_per_rank`."""
    out = Path(argv[argv.index("--output_dir") + 1])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"stdout_rank{os.environ['RANK']}.txt", "w") as printed, contextlib.redirect_stdout(printed):
        main(argv)


def printing_fresh_dynamo(main, argv: list[str]) -> None:
    """`printing_to_a_file(main, argv)` with dynamo's process-wide caches empty before and after: a pooled rank's
    earlier compiles (past the recompile limit) cannot leave this run uncompiled, nor this run's a later one."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        printing_to_a_file(main, argv)
    finally:
        torch._dynamo.reset()


def printed_per_rank(output_dir: Path, world: int = 2) -> list[str]:
    return [(Path(output_dir) / f"stdout_rank{rank}.txt").read_text() for rank in range(world)]


@pytest.fixture(scope="session")
def ranks():
    pool = Ranks(2)
    yield pool
    pool.stop()


def run_toy(capsys, argv, code=None):
    """tests/scripts/toy_train.py in this process through run_cli: its captured output, after checking the exit code
    `code` (None: it must not exit)."""
    import toy_train

    from accel_train import run_cli

    reset_accelerate()
    if code is None:
        run_cli(toy_train.main, argv)
        return capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(toy_train.main, argv)
    assert exit_info.value.code == code
    return capsys.readouterr()


def toy_process(args: list[str], fault: str | None = None, processes: int = 1,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """tests/scripts/toy_train.py in a process of its own, or launched on `processes` gloo processes, with an
    optional fault point (ACCEL_TRAIN_FAULT) and more environment `env`; the caller checks the return code."""
    env = subprocess_env(ACCELERATE_USE_CPU="1", **({"ACCEL_TRAIN_FAULT": fault} if fault else {}), **(env or {}))
    if processes > 1:
        return launch(SCRIPTS / "toy_train.py", args, num_processes=processes, check=False, env=env)
    return run_process_tree([sys.executable, str(SCRIPTS / "toy_train.py"), *args], env, timeout=600)


def kill_then_resume(toy, full: Path, cut: Path, step: int, checkpoint: str, processes: int = 1) -> None:
    """`toy(out, *flags, fault=, processes=)` run whole into `full`; into `cut` SIGKILLed after optimizer step `step`
    (its newest checkpoint must then be `checkpoint`) and resumed with `latest`. The caller compares the two."""
    assert toy(full, processes=processes).returncode == 0
    killed = toy(cut, fault=f"kill_after_step:{step}", processes=processes)
    assert killed.returncode != 0 and sorted(p.name for p in (cut / "checkpoints").glob("step-*"))[-1] == checkpoint, \
        killed.stderr[-2000:]
    resumed = toy(cut, "--resume_from_checkpoint", "latest", processes=processes)
    assert resumed.returncode == 0, resumed.stderr[-3000:]


def stop_then_resume(run, full: Path, cut: Path, step: int, resume_at: int) -> None:
    """`run(out, *flags)` whole into `full`; into `cut` stopped with --stop_at_step at `step`, then resumed with latest
    from the earlier checkpoint `resume_at`, as a SIGKILL after `step` leaves a run: the stop's own checkpoint is
    removed, so the resume replays the steps after `resume_at` over what the cut run already wrote (records, logged
    lines). kill_then_resume's twin for a test whose subject is a state the checkpoint keeps, not the process's death
    (tests/rundir/test_reliability.py kills for real). The caller compares the two."""
    import shutil

    from accel_train.rundir.checkpoint import list_checkpoints

    run(full)
    run(cut, "--stop_at_step", str(step))
    saved = list_checkpoints(cut)
    assert saved[-1].name == f"step-{step:08d}" and f"step-{resume_at:08d}" in [p.name for p in saved], saved
    for later in saved:
        if int(later.name.split("-")[1]) > resume_at:
            shutil.rmtree(later)
    run(cut, "--resume_from_checkpoint", "latest")


class StopOnSave:
    """A hook that asks the loop to stop when the checkpoint of `step` lands (its on_save)."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, state, checkpoint_dir):
        return state.step == self.step


class Clock:
    """A training clock in the loop's modules (meter, loop, train: the meter's intervals and the pauses it takes out
    of them read the same clock) that reads one second later at each reading; `now` moved on by
    hand is time spent elsewhere."""

    def __init__(self, monkeypatch):
        import importlib
        from types import SimpleNamespace

        from accel_train.core import loop, meter

        train_module = importlib.import_module("accel_train.train")  # the package's `train` is the function

        self.now = 0.0
        for module in (train_module, loop, meter):
            monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=self.read))

    def read(self) -> float:
        self.now += 1.0
        return self.now


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def toy_records(output_dir: Path) -> dict[int, list[dict]]:
    """{rank: [record of each toy_train run, oldest first]} written by tests/scripts/toy_train.py."""
    out: dict[int, list[dict]] = {}
    for path in sorted(output_dir.glob("toy_rank*_*.json"), key=lambda p: p.stat().st_mtime_ns):
        rank = int(path.name.split("_")[1].removeprefix("rank"))
        out.setdefault(rank, []).append(json.loads(path.read_text()))
    return out


# ------------------------------------------------------------------ a tiny text classification world

POSITIVE = "good great fine lovely superb nice brilliant moving".split()
NEGATIVE = "bad awful poor dull boring weak terrible bland".split()
FILLER = "the movie film plot was a an and it is really quite story acting".split()


def sentence(rng, positive: bool) -> str:
    words = rng.sample(FILLER, 4) + rng.sample(POSITIVE if positive else NEGATIVE, 2)
    rng.shuffle(words)
    return " ".join(words)


def make_rows(n: int, seed: int):
    import random

    rng = random.Random(seed)
    return [(i % 2, sentence(rng, i % 2 == 1)) for i in range(n)]


@pytest.fixture
def one_thread():
    """For modules of tiny models (they use it through `pytestmark`): they gain nothing from threads, and on a
    shared CPU spinning OpenMP threads slow them 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory):
    """A 2-layer BERT with a word-level vocabulary, built from a config: no download."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    path = tmp_path_factory.mktemp("tiny_bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(POSITIVE + NEGATIVE + FILLER))]
    BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}).save_pretrained(path)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=48, max_position_embeddings=128, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    BertForSequenceClassification(config).save_pretrained(path)
    return path


@pytest.fixture
def sst_like(tmp_path):
    """'<label> <text>' files like ../shared/data/sentence-classification."""
    files = {}
    for split, n, seed in (("train", 96, 0), ("dev", 40, 1), ("test", 24, 2)):
        files[split] = tmp_path / f"toy.{split}"
        files[split].write_text("".join(f"{y} {t}\n" for y, t in make_rows(n, seed)))
    return files

# ------------------------------------------------------------------ a tiny image-text world
# (the fusion recipe's tests, and the fusion run that test_export_runs.py exports)

COLOURS = {"red": (220, 40, 40), "green": (40, 220, 40), "blue": (40, 40, 220)}
CAPTION_WORDS = sorted(set("a an of the photo picture square patch colour shape bright dark . red green blue".split()))
TINY_FUSION = ["--fusion_dim", "16", "--fusion_heads", "2", "--embed_dim", "16"]
TINY_VISION = ["--vision_config_overrides", '{"widths": [8, 16], "blocks_per_stage": 1}']


def text_tower_config():
    """A 1-layer BERT's config over CAPTION_WORDS (and the 5 special tokens)."""
    from transformers import BertConfig

    return BertConfig(vocab_size=len(CAPTION_WORDS) + 5, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)


def caption_folder(root, counts, size=16, seed=0):
    """<root>/<split>/*.png with metadata.jsonl: noisy single-colour images with two captions each."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in counts.items():
        folder = root / split
        folder.mkdir(parents=True, exist_ok=True)
        lines = []
        for name, colour in COLOURS.items():
            for i in range(n):
                pixels = np.clip(np.array(colour) + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{name}{i}.png")
                captions = [f"a {name} square", f"a photo of the colour {name}"]
                lines.append({"file_name": f"{name}{i}.png", "captions": captions})
        (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return root


def token_main(args: list[str]) -> None:
    """tests/scripts/token_train.py's main in this process (Ranks runs it on each rank), as toy_main is toy_train's."""
    import token_train

    reset_accelerate()
    token_train.main(args)


def step_gradient(out: Path) -> dict:
    """initial - final weights of a token_train run (--save_initial, one SGD step at learning rate 1): its gradient."""
    from safetensors.torch import load_file

    initial, final = load_file(out / "initial.safetensors"), load_file(out / "model.safetensors")
    return {name: initial[name] - final[name] for name in final}


def token_gradient_error(grads: dict, per_sequence: bool = False) -> float:
    """Largest difference from the one-batch token-mean gradient of token_train's 16 sequences (`per_sequence`: of the
    mean over the sequences of each one's token mean, --mean_loss)."""
    import token_train

    reference = token_train.reference_gradient(token_train.tiny_lm(), token_train.sequences(16, 0), per_sequence)
    return max((grads[name] - reference[name]).abs().max().item() for name in grads)


def points_run(tmp_path, metrics_values, **overrides):
    """A tiny classifier evaluated every 2 steps; metrics_fn returns the given values in turn as 'score'."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from accel_train import TrainConfig, train

    torch.manual_seed(0)
    x = torch.randn(32, 6)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    values = iter(metrics_values)  # one per evaluation: no pre-flight call of metrics_fn (preflight=False)
    settings = dict(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=8, learning_rate=0.01,
                    eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, report_to=["none"],
                    disable_tqdm=True, run_report=False, metric_for_best_model="score", greater_is_better=True,
                    load_best_model_at_end=True, logging_steps=2, preflight=False)
    config = TrainConfig(**{**settings, **overrides})

    def loss_fn(model, batch):
        logits = model(batch[0])
        losses = torch.nn.functional.cross_entropy(logits, batch[1], reduction="none")
        return {"loss": losses.mean(), "per_sample_loss": losses}

    reset_accelerate()
    return train(torch.nn.Linear(6, 2), DataLoader(data, batch_size=8, shuffle=True), config=config,
                 loss_fn=loss_fn, eval_loader=DataLoader(data, batch_size=8), metrics_fn=lambda out: {
                     "score": next(values)})
