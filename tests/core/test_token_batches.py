"""--max_tokens_per_batch (accel_train/core/token_batches.py): training micro-batches of as many examples as fit in N
padded tokens (rows x longest row). The plan holds the budget and every example once, is dealt by Accelerate evenly
to 2 processes, is a function of the seed; a step over micro-batches of different sizes is the token-mean gradient of
its examples (the per-token loss contract) on 1 process and on 2; the schedule is built for the plan's steps; a run
cut mid-epoch resumes bitwise (with accumulation, bf16 and a weight average: the matrix's rows, tests/core/
test_matrix.py); what cannot hold is refused before training. Everything runs in this process (the 2-process case on
the session's gloo ranks)."""

import json
import random

import pytest
import token_train
import torch
from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler
from conftest import read_jsonl, reset_accelerate, step_gradient, token_gradient_error, token_main
from torch.utils.data import DataLoader, IterableDataset

from accel_train import TrainConfig, make_loader
from accel_train.config.validation import parse_tokens
from accel_train.core.accelerator import duplicated_samples
from accel_train.core.optim import make_plan
from accel_train.core.state import TrainState
from accel_train.core.token_batches import (
    TokenBudgetBatchSampler,
    auto_budget,
    check_token_loader,
    check_token_plan,
    padded_tokens,
    plan_batches,
    resolve_token_budget,
)
from accel_train.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")
ONE_SGD_STEP = ["--optim", "sgd", "--sgd_momentum", "0", "--learning_rate", "1", "--max_grad_norm", "0",
                "--max_steps", "1", "--lr_scheduler_type", "constant", "--weight_decay", "0",
                "--eval_strategy", "no"]  # as tests/core/test_token_loss.py: the step moves by minus the gradient
RNG = random.Random(0)
LENGTHS = [RNG.randint(3, 30) if RNG.random() < 0.5 else RNG.randint(31, 128) for _ in range(300)]  # 3 to 128 tokens


def run_tokens(out, *args):
    reset_accelerate()
    return token_train.main(["--output_dir", str(out), "--save_initial", "true", *args])


def test_the_plan_holds_the_budget_and_every_example_once_and_is_a_function_of_the_seed():
    for budget in (128, 512):
        for processes in (1, 2, 3):
            plan = plan_batches(LENGTHS, budget, processes, seed=0)
            assert all(padded_tokens(LENGTHS, batch) <= budget for batch in plan)
            assert sorted(i for batch in plan for i in batch) == list(range(len(LENGTHS)))
            assert len(plan) % processes == 0
    sampler = TokenBudgetBatchSampler(LENGTHS, 512, 2, seed=0)
    assert max(map(len, sampler.batches)) >= 512 // 30  # short examples: many to a batch, the point of a budget
    first, again, second = sampler.epoch_batches(0), sampler.epoch_batches(0), sampler.epoch_batches(1)
    assert first == again and first != second
    # every epoch the plan's shape (so as many micro-batches, each of the same lengths), other examples of equal
    # length together, each example once
    def shape(batches):
        return sorted(sorted(LENGTHS[i] for i in batch) for batch in batches)

    assert shape(first) == shape(second) == shape(sampler.batches)
    assert sorted(map(sorted, first)) != sorted(map(sorted, second))
    assert sorted(i for batch in second for i in batch) == list(range(len(LENGTHS)))
    sampler.set_epoch(1)
    assert list(sampler) == second
    assert TokenBudgetBatchSampler(LENGTHS, 512, 2, seed=0).batches == sampler.batches  # seeded: the same plan
    assert TokenBudgetBatchSampler(LENGTHS, 512, 2, seed=1).epoch_batches(0) != first  # another seed, another one


def test_accelerate_deals_the_plan_evenly_every_example_once_with_comparable_tokens():
    """Accelerate's own sharding of a batch sampler (what `prepare` wraps it in on 2 processes): the same number of
    micro-batches on both ranks (else one waits for a step the other never takes), no example repeated to even them
    out, the ranks' tokens close round by round; a resume's skip (SkipBatchSampler) leaves the rest of the epoch."""
    assert len(plan_batches(LENGTHS, 200, 1)) % 2 == 1  # 105 batches for 1 process: not dealt evenly as they are
    for budget in (128, 200, 512):
        sampler = TokenBudgetBatchSampler(LENGTHS, budget, 2, seed=3)
        sampler.set_epoch(2)
        shards = [list(BatchSamplerShard(sampler, 2, rank, split_batches=False, even_batches=True))
                  for rank in (0, 1)]
        assert len(shards[0]) == len(shards[1]) == len(sampler) // 2
        assert sorted(i for shard in shards for batch in shard for i in batch) == list(range(len(LENGTHS)))
        tokens = [[sum(LENGTHS[i] for i in batch) for batch in shard] for shard in shards]
        assert abs(sum(tokens[0]) - sum(tokens[1])) < 0.05 * sum(tokens[0])
        # the batches that run side by side are paired as closely as any pairing can (adjacent in token order)
        ordered = sorted(tokens[0] + tokens[1])
        closest = sum(ordered[k + 1] - ordered[k] for k in range(0, len(ordered), 2))
        assert sum(abs(a - b) for a, b in zip(*tokens, strict=True)) == closest
        assert list(SkipBatchSampler(BatchSamplerShard(sampler, 2, 1), 3)) == shards[1][3:]


def test_refused_where_it_cannot_hold(tmp_path):
    config = TrainConfig(output_dir=str(tmp_path), max_tokens_per_batch=64)
    with pytest.raises(ConfigError, match="training example 2 has 90 tokens, more than a whole batch may hold. "
                                          "Raise --max_tokens_per_batch to at least 90"):
        plan_batches([10, 20, 90, 5], 64)
    with pytest.raises(ConfigError, match="every batch holds a single example and the 3 examples cannot be dealt "
                                          "evenly to 2 processes"):
        plan_batches([40, 50, 60], 64, 2)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter([[1, 2]])

    with pytest.raises(ConfigError, match="the training set is a stream"):
        make_loader(Stream(), config, train=True, lengths=[2])
    with pytest.raises(ConfigError, match="built without the examples' lengths.*--packing.*fills rows to a token "
                                          "budget already"):
        make_loader([[1], [2]], config, train=True)
    with pytest.raises(ConfigError, match="3 lengths for a training set of 2 examples"):
        make_loader([[1], [2]], config, train=True, lengths=[1, 1, 1])
    for flag, value in (("auto_find_batch_size", True), ("dataloader_drop_last", True), ("scale_lr", "linear"),
                        ("overfit_batches", 2)):  # --overfit_batches: before, an error about the loader's batch_size
        with pytest.raises(ConfigError, match=f"--{flag} and --max_tokens_per_batch 64"):
            TrainConfig(output_dir=str(tmp_path), max_tokens_per_batch=64, **{flag: value})
    with pytest.raises(ConfigError, match="--max_tokens_per_batch=-1"):
        TrainConfig(output_dir=str(tmp_path), max_tokens_per_batch=-1)
    assert make_loader([[1], [2]], config, train=False).batch_size == 8  # evaluation: batches of examples still
    with pytest.raises(ConfigError, match="--overfit_batches and --max_tokens_per_batch 64: --overfit_batches repeats"):
        run_tokens(tmp_path / "overfit", "--max_tokens_per_batch", "64", "--overfit_batches", "2")
    budget = TrainConfig(output_dir=str(tmp_path), max_tokens_per_batch=64, gradient_accumulation_steps=2)
    check_token_plan(TrainState(token_plan=[64, 2], world_size=2), budget, 2, "ckpt")
    with pytest.raises(CheckpointError, match="trained with --max_tokens_per_batch 64 and --gradient_accumulation_"
                                              "steps 2, this run asks for batches of --per_device_train_batch_size"):
        check_token_plan(TrainState(token_plan=[64, 2], world_size=1), TrainConfig(output_dir=str(tmp_path)), 1, "c")
    with pytest.raises(CheckpointError, match="this run asks for --max_tokens_per_batch 64 and --gradient_"
                                              "accumulation_steps 2"):
        check_token_plan(TrainState(token_plan=[64, 1], world_size=1), budget, 1, "ckpt")
    # auto's number follows the hardware's pad multiple: a resume elsewhere is told so (it blamed the flags only)
    with pytest.raises(CheckpointError, match=r"trained with --max_tokens_per_batch 1102.*this run asks for "
                                              r"--max_tokens_per_batch 1115.*a multiple of 8 under fp16 / bf16"):
        check_token_plan(TrainState(token_plan=[1102, 1], world_size=1),
                         TrainConfig(output_dir=str(tmp_path), max_tokens_per_batch=1115), 1, "ckpt")
    from accelerate import Accelerator

    from accel_train.config import save_config
    from accel_train.rundir.outdir import resume_target

    reset_accelerate()
    save_config([TrainConfig(output_dir=str(tmp_path / "moved"), max_tokens_per_batch=1102)],
                tmp_path / "moved" / "config.yaml")
    with pytest.raises(ConfigError, match=r"max_tokens_per_batch: 1102 there, 1115 now.*a multiple of 8 under fp16"):
        resume_target(Accelerator(cpu=True), TrainConfig(output_dir=str(tmp_path / "moved"), max_tokens_per_batch=1115,
                                                         resume_from_checkpoint="auto"))
    with pytest.raises(CheckpointError, match="trained on 2 process.* this run has 1.*Resume on 2"):
        check_token_plan(TrainState(token_plan=[64, 2], world_size=2), budget, 1, "ckpt")


def test_auto_is_the_mean_padded_tokens_of_the_grouped_batches_it_replaces(tmp_path):
    """--max_tokens_per_batch auto: the mean padded tokens of the micro-batches of --per_device_train_batch_size that
    length grouping makes in epoch 0 at the data seed (about as many micro-batches an epoch, less padding), at least
    the longest example; the same number whatever the accumulation or the processes; taken by the loader's plan and
    by train() as the run's budget. Refused, by name, where there is nothing to choose it from."""
    from accel_train.config.parsing import parse_config

    assert parse_config(argv=["--max_tokens_per_batch", "Auto"])[0].max_tokens_per_batch == "auto"
    (tmp_path / "c.yaml").write_text("max_tokens_per_batch: auto\n")
    assert parse_config(argv=["--config", str(tmp_path / "c.yaml")])[0].max_tokens_per_batch == "auto"
    for value in ("x", "-1", "1.5"):
        with pytest.raises(ConfigError, match=f"'{value}' is neither a number of tokens"):
            parse_config(argv=["--max_tokens_per_batch", value])
    with pytest.raises(ConfigError, match="--scale_lr and --max_tokens_per_batch auto"):
        TrainConfig(output_dir=str(tmp_path), max_tokens_per_batch="auto", scale_lr="linear")

    fixed = TrainConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, seed=3)
    batches = list(make_loader(list(range(300)), fixed, train=True, lengths=LENGTHS, num_processes=1).batch_sampler)
    mean = sum(padded_tokens(LENGTHS, b) for b in batches) / len(batches)  # what length-grouped batches of 8 cost
    assert auto_budget(LENGTHS, 8, 3) == round(mean) and 128 < round(mean) < 8 * 128
    assert auto_budget([3, 100, 5, 3], 1) == 100  # a mean of 27.75 padded tokens: at least the longest example
    auto = fixed.replace(max_tokens_per_batch="auto")
    for config in (auto, auto.replace(gradient_accumulation_steps=4)):
        assert resolve_token_budget(config, LENGTHS).max_tokens_per_batch == round(mean)
    assert resolve_token_budget(fixed, LENGTHS) is fixed  # no budget asked: as it is
    loader = make_loader(list(range(300)), auto, train=True, lengths=LENGTHS, num_processes=1)
    assert loader.batch_sampler.max_tokens == round(mean)
    assert abs(len(loader) - len(batches)) <= 0.1 * len(batches)  # about as many micro-batches an epoch
    assert loader.batch_sampler.padding_share(LENGTHS) < 1 - sum(LENGTHS) / (len(batches) * mean)  # less padding
    assert check_token_loader(loader, auto, 1).max_tokens_per_batch == round(mean)  # train() runs with the number
    with pytest.raises(ConfigError, match="--max_tokens_per_batch auto: the budget is chosen from the training "
                                          "examples' lengths, and the loader was given none"):
        resolve_token_budget(auto, None)  # a recipe under --no_group_by_length
    with pytest.raises(ConfigError, match="--max_tokens_per_batch auto: the training loader was built without"):
        make_loader(list(range(300)), auto, train=True)
    with pytest.raises(ConfigError, match="--max_tokens_per_batch auto: the training loader is not batched by a "
                                          "token budget's plan"):
        check_token_loader(DataLoader(list(range(300)), batch_size=8), auto, 1)
    # a number too: before, the loader's own batches trained under a budget the report and checkpoints claimed (a
    # resume skipped a data position counted in the budget's plan)
    with pytest.raises(ConfigError, match="--max_tokens_per_batch 512: the training loader is not batched by a "
                                          "token budget's plan .* drop --max_tokens_per_batch"):
        check_token_loader(DataLoader(list(range(300)), batch_size=8), auto.replace(max_tokens_per_batch=512), 1)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter([[1, 2]])

    with pytest.raises(ConfigError, match="--max_tokens_per_batch auto: the training set is a stream"):
        make_loader(Stream(), auto, train=True, lengths=[2])


def test_a_recipes_default_budget_gives_way_to_what_the_run_chose_or_needs(tmp_path, monkeypatch):
    """default_budget (the NLP recipes' batching): auto, unless --max_tokens_per_batch was given (a number, auto or
    0) or the run needs batches of examples (a recipe's reason, a fixed-batch flag, DeepSpeed, a checkpoint trained
    with batches of examples), each said."""
    from types import SimpleNamespace

    from accel_train.config.parsing import parse_config
    from accel_train.core.token_batches import FIXED_BATCHES_VARIABLE, default_budget

    fixed_line = "batches: 8 examples each (--per_device_train_batch_size), not the default token budget: "

    def engine(name="NO"):
        return SimpleNamespace(distributed_type=SimpleNamespace(value=name))

    def batching(*argv, accelerator=None, refused=None):
        config = parse_config(argv=["--output_dir", str(tmp_path), *argv])[0]
        config, line = default_budget(config, accelerator or engine(), refused)
        return config.max_tokens_per_batch, line

    assert batching() == ("auto", "batches: the default token budget (--max_tokens_per_batch auto: as many padded "
                          "tokens as the length-grouped batches of 8 examples hold on average; "
                          "--max_tokens_per_batch 0 for batches of examples)")
    for given in ("0", "auto", "300"):  # the run's own choice, said by the start-up report
        assert batching("--max_tokens_per_batch", given) == (0 if given == "0" else parse_tokens(given), "")
    assert batching("--max_tokens_per_batch", "0", "--scale_lr", "linear")[0] == 0
    for argv, why in ((["--scale_lr", "linear"], "--scale_lr scales the learning rate"),
                      (["--dataloader_drop_last"], "--dataloader_drop_last drops"),
                      (["--auto_find_batch_size"], "--auto_find_batch_size searches"),
                      (["--overfit_batches", "2"], "--overfit_batches repeats")):
        tokens, line = batching(*argv)
        assert tokens == 0 and line.startswith(f"{fixed_line}{why}")
    assert batching(accelerator=engine("DEEPSPEED"))[1].endswith("DeepSpeed needs a fixed number of examples per "
                                                                  "micro-batch")
    assert batching(refused="--packing fills rows")[0] == 0
    assert batching("--max_tokens", "0") == (0, "")  # an abbreviated flag is the run's choice too
    monkeypatch.setenv(FIXED_BATCHES_VARIABLE, "1")  # accel-train verify's runs: their variants batch alike
    assert batching()[1].endswith("accel-train verify compares runs of other micro-batch sizes and numbers of "
                                  "processes, which a budget chosen per micro-batch would batch differently")
    assert batching("--max_tokens_per_batch", "auto")[0] == "auto"
    monkeypatch.delenv(FIXED_BATCHES_VARIABLE)
    from accel_train.verify.runs import Verify

    assert Verify("train.py", [], tmp_path).env[FIXED_BATCHES_VARIABLE] == "1"
    checkpoint = tmp_path / "checkpoints" / "step-00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_text("{}")
    (checkpoint / "train_state.json").write_text(json.dumps({"token_plan": []}))
    assert batching("--resume_from_checkpoint", "latest") == (0, f"{fixed_line}the checkpoint it resumes "
                                                                 "(step-00000004) was trained with batches of examples")
    (checkpoint / "train_state.json").write_text(json.dumps({"token_plan": [300, 1, 5, 7]}))
    assert batching("--resume_from_checkpoint", str(checkpoint))[0] == "auto"


def test_an_auto_budget_runs_cut_and_resumed_as_the_uncut_run_and_says_its_number(tmp_path, capsys):
    """train() with --max_tokens_per_batch auto: the start-up report, config.yaml and the checkpoints' plan give the
    number it resolved to; a run cut after step 2 and resumed with auto (the same data: the same number) feeds what
    the uncut run fed and ends on its weights, bitwise, under bf16 and accumulation; resumed with another
    --per_device_train_batch_size (another auto number) it is refused, naming both numbers."""
    from safetensors.torch import load_file

    rows = token_train.sequences(24, 0)
    number = auto_budget(list(map(len, rows)), 4, 42)
    common = ["--max_tokens_per_batch", "auto", "--per_device_train_batch_size", "4", "--num_sequences", "24",
              "--gradient_accumulation_steps", "2", "--mixed_precision", "bf16", "--max_steps", "5",
              "--eval_strategy", "no", "--save_strategy", "steps", "--save_steps", "1"]
    run_tokens(tmp_path / "whole", *common)
    assert f"at most {number} padded tokens per micro-batch (--max_tokens_per_batch" in capsys.readouterr().out
    assert f"max_tokens_per_batch: {number}\n" in (tmp_path / "whole" / "config.yaml").read_text()
    run_tokens(tmp_path / "cut", *common, "--stop_at_step", "2")
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step-00000002" / "train_state.json").read_text())
    assert state["token_plan"][:2] == [number, 2]
    run_tokens(tmp_path / "cut", *common, "--resume_from_checkpoint", "latest")
    whole = json.loads(next((tmp_path / "whole").glob("token_rank0_*.json")).read_text())["fed"]
    cut, resumed = (json.loads(p.read_text())["fed"] for p in sorted((tmp_path / "cut").glob("token_rank0_*.json"),
                                                                       key=lambda p: int(p.stem.split("_")[-1])))
    assert len(whole) == 9 and cut == whole[:4] and resumed == whole[4:]  # 5 micro-batches an epoch: steps of 2,2,1
    final = [load_file(tmp_path / run / "model.safetensors") for run in ("whole", "cut")]
    assert all(final[0][name].equal(final[1][name]) for name in final[0])
    other = auto_budget(list(map(len, rows)), 2, 42)
    assert other != number
    with pytest.raises(CheckpointError, match=f"trained with --max_tokens_per_batch {number} and .*this run asks for "
                                              f"--max_tokens_per_batch {other}"):
        run_tokens(tmp_path / "cut", *common, "--per_device_train_batch_size", "2", "--max_steps", "6",
                   "--resume_from_checkpoint", "latest")


def test_a_checkpoint_resumes_only_with_its_own_plan(tmp_path):
    """Its data position counts the micro-batches of its plan: resuming it with another budget, or the same budget
    over other example lengths, is refused by name."""
    common = ["--max_steps", "3", "--save_strategy", "steps", "--save_steps", "1", "--eval_strategy", "no"]
    run_tokens(tmp_path, *common, "--max_tokens_per_batch", "64", "--stop_at_step", "2")
    with pytest.raises(CheckpointError, match="trained with --max_tokens_per_batch 64 and --gradient_accumulation_"
                                              "steps 1, this run asks for --max_tokens_per_batch 80"):
        run_tokens(tmp_path, *common, "--max_tokens_per_batch", "80", "--resume_from_checkpoint", "latest")
    # the same budget over other examples (their lengths are the plan's): refused, not a position in another plan
    with pytest.raises(CheckpointError, match=r"was trained on a plan of 7 micro-batches an epoch over other example "
                                              r"lengths than this run's \(9 micro-batches\)"):
        run_tokens(tmp_path, *common, "--max_tokens_per_batch", "64", "--num_sequences", "18",
                   "--resume_from_checkpoint", "latest")
    state = json.loads(sorted((tmp_path / "checkpoints").glob("step-*"))[-1].joinpath("train_state.json").read_text())
    assert state["token_plan"][:3] == [64, 1, 7] and len(state["token_plan"]) == 4


def test_a_resume_goes_on_at_its_plans_micro_batch_whatever_the_per_device_batch(tmp_path):
    """Under a budget --per_device_train_batch_size batches nothing: a resume that changes it goes on at the
    checkpoint's micro-batch of its plan (not one re-derived from samples counted in batches of the new size),
    feeding what the uncut run fed and ending on its weights, bitwise."""
    from safetensors.torch import load_file

    common = ["--max_steps", "5", "--max_tokens_per_batch", "64", "--eval_strategy", "no", "--save_strategy", "steps",
              "--save_steps", "1"]
    run_tokens(tmp_path / "whole", *common)
    run_tokens(tmp_path / "cut", *common, "--stop_at_step", "2")
    run_tokens(tmp_path / "cut", *common, "--resume_from_checkpoint", "latest", "--per_device_train_batch_size", "4")
    whole = json.loads(next((tmp_path / "whole").glob("token_rank0_*.json")).read_text())["fed"]
    cut, resumed = (json.loads(p.read_text())["fed"] for p in sorted((tmp_path / "cut").glob("token_rank0_*.json")))
    assert len(whole) == 5 and cut == whole[:2] and resumed == whole[2:]
    final = [load_file(tmp_path / run / "model.safetensors") for run in ("whole", "cut")]
    assert all(final[0][name].equal(final[1][name]) for name in final[0])


def test_a_mean_is_weighed_by_its_examples_and_a_sum_is_left_as_it_is():
    from accel_train.core.loss import as_loss_output, weigh_by_examples

    mean = as_loss_output({"loss": torch.tensor(2.0, requires_grad=True)})
    weighed = weigh_by_examples(mean, 5)
    assert weighed["objective"].item() == 10.0 and weighed["items"].item() == 5.0 and weighed["loss"].item() == 2.0
    sums = as_loss_output({"loss_sum": torch.tensor([3.0, 3.0]), "num_items": torch.tensor([2, 1])})
    assert weigh_by_examples(sums, 7) is sums


@pytest.mark.parametrize("mean_loss", [False, True], ids=["token sums", "example means"])
def test_a_step_of_token_budget_batches_is_the_token_mean_gradient(tmp_path, mean_loss):
    """One SGD step over the 16 sequences' whole plan (7 micro-batches of 1 to 4 sequences, 64 padded tokens at most,
    accumulated): the token-mean gradient of all 16, as one batch of them. With a mean loss (one value per example,
    as a classifier's) the mean over the 16 sequences: each micro-batch's mean weighs as many as its examples, not
    one micro-batch's worth (loss.weigh_by_examples)."""
    sizes = {len(batch) for batch in plan_batches(list(map(len, token_train.sequences(16, 0))), 64)}
    assert len(sizes) > 1
    run_tokens(tmp_path, *ONE_SGD_STEP, "--max_tokens_per_batch", "64", "--gradient_accumulation_steps", "16",
               "--mean_loss", str(mean_loss).lower())
    assert token_gradient_error(step_gradient(tmp_path), per_sequence=mean_loss) < 1e-6


@pytest.mark.parametrize("mean_loss", [False, True], ids=["token sums", "example means"])
def test_two_processes_run_as_many_micro_batches_and_give_the_token_mean_gradient(tmp_path, ranks, mean_loss):
    """2 processes on the session's gloo ranks: the plan's 8 micro-batches dealt 4 and 4 (each rank's tokens close to
    the other's), one accumulated step: the token-mean gradient of all 16 sequences (with a mean loss, the mean over
    the sequences of both ranks)."""
    ranks.run(token_main, [*ONE_SGD_STEP, "--save_initial", "true", "--max_tokens_per_batch", "64",
                           "--gradient_accumulation_steps", "16", "--output_dir", str(tmp_path),
                           "--mean_loss", str(mean_loss).lower()])
    assert token_gradient_error(step_gradient(tmp_path), per_sequence=mean_loss) < 1e-6
    fed = [json.loads(p.read_text())["fed"] for p in sorted(tmp_path.glob("token_rank[01]_*.json"))]
    assert len(fed[0]) == len(fed[1]) == 4
    tokens = [sum(real for _, real in rank) for rank in fed]
    assert sum(tokens) == sum(map(len, token_train.sequences(16, 0)))
    assert abs(tokens[0] - tokens[1]) <= 0.1 * sum(tokens)


def test_two_processes_over_two_epochs_cut_and_resumed_feed_and_end_as_the_uncut_run(tmp_path, ranks):
    """2 processes, accumulation 2, a mean loss, 2 epochs (the second epoch's order reaches the plan through
    Accelerate's sharding wrapper), cut after step 3 (inside epoch 1) and resumed: each rank feeds as many
    micro-batches as the other, each epoch's examples once across both ranks (and counts them so: samples_seen), and
    the resumed run feeds what the uncut run fed from there and ends on its weights, bitwise."""
    from safetensors.torch import load_file

    common = ["--max_tokens_per_batch", "64", "--gradient_accumulation_steps", "2", "--num_train_epochs", "2",
              "--eval_strategy", "no", "--save_strategy", "steps", "--save_steps", "1", "--mean_loss", "true"]
    ranks.run(token_main, [*common, "--output_dir", str(tmp_path / "whole")])
    ranks.run(token_main, [*common, "--output_dir", str(tmp_path / "cut"), "--stop_at_step", "3"])
    ranks.run(token_main, [*common, "--output_dir", str(tmp_path / "cut"), "--resume_from_checkpoint", "latest"])

    def fed(run: str, rank: int) -> list[list[list[int]]]:  # each run's micro-batches, oldest run first
        files = sorted((tmp_path / run).glob(f"token_rank{rank}_*.json"), key=lambda p: int(p.stem.split("_")[-1]))
        return [json.loads(p.read_text())["fed"] for p in files]

    total = sum(map(len, token_train.sequences(16, 0)))
    for rank in (0, 1):
        (whole,), (cut, resumed) = fed("whole", rank), fed("cut", rank)
        assert len(whole) == 8 and cut == whole[:6] and resumed == whole[6:]
    both = [fed("whole", rank)[0] for rank in (0, 1)]
    # each rank counts the examples of both ranks' micro-batches, not its own times 2: 16 an epoch
    assert [json.loads(p.read_text())["samples"] for p in (tmp_path / "whole").glob("token_rank*_*.json")] == [32, 32]
    for epoch in (0, 1):  # 4 micro-batches a rank an epoch: every token of the 16 sequences once
        assert sum(real for rank in both for _, real in rank[4 * epoch:4 * epoch + 4]) == total
    assert [r[:4] for r in both] != [r[4:] for r in both]  # the second epoch in another order
    final = [load_file(tmp_path / run / "model.safetensors") for run in ("whole", "cut")]
    assert all(final[0][name].equal(final[1][name]) for name in final[0])


def plan_of_a_loader_built_without_the_world(out: str) -> None:
    """On each rank: make_loader called without num_processes (a user's loop, after building its Accelerator) plans
    for the world it runs in, not for 1 process (whose odd count Accelerate would even out by repeating a batch)."""
    from accel_train import build_accelerator

    config = TrainConfig(output_dir=out, max_tokens_per_batch=64)
    build_accelerator(config)
    rows = token_train.sequences(16, 0)
    loader = make_loader(rows, config, train=True, lengths=list(map(len, rows)))
    assert (loader.batch_sampler.num_processes, len(loader)) == (2, 8)
    auto = make_loader(rows, config.replace(max_tokens_per_batch="auto"), train=True, lengths=list(map(len, rows)))
    # auto: the number one process would choose (grouped by the micro-batch, not the world), planned for 2
    assert auto.batch_sampler.max_tokens == auto_budget(list(map(len, rows)), 8, 42)
    assert auto.batch_sampler.num_processes == 2 and len(auto.batch_sampler.batches) % 2 == 0
    # the start-up report's "trained twice" note counts batches of --per_device_train_batch_size: none under a plan
    plan = make_plan(config, 4, 2)
    assert duplicated_samples(plan, config, 2, 16) == 0
    assert duplicated_samples(plan, TrainConfig(output_dir=out), 2, 16) == 48  # 4 x 2 x 8 - 16
    assert len(plan_batches(list(map(len, rows)), 64, 1)) == 7


def test_a_token_budget_sampler_of_ones_own_must_plan_for_the_run(tmp_path):
    """A DataLoader batched by a TokenBudgetBatchSampler built by hand: planned for another number of processes than
    run (Accelerate would repeat batches to even out its count), or for another budget than
    --max_tokens_per_batch (the checkpoints and report would count in batches of examples), refused before training."""
    from accel_train import train
    from accel_train.core.token_batches import check_token_loader

    rows = token_train.sequences(16, 0)
    lengths = list(map(len, rows))
    budget = TrainConfig(output_dir=str(tmp_path / "run"), max_tokens_per_batch=64, report_to=["none"])
    loader = DataLoader(rows, batch_sampler=TokenBudgetBatchSampler(lengths, 64, 1, 0))
    check_token_loader(loader, budget, 1)
    with pytest.raises(ConfigError, match=r"planned for 1 process\(es\) and this run has 2: its plan is dealt in "
                                          r"rounds.*TokenBudgetBatchSampler\(lengths, 64, accelerator"):
        check_token_loader(loader, budget, 2)
    reset_accelerate()
    with pytest.raises(ConfigError, match=r"plans batches of 64 padded tokens and --max_tokens_per_batch is 0 \(off\): "
                                          "set --max_tokens_per_batch 64"):
        train(token_train.tiny_lm(), loader, config=TrainConfig(output_dir=str(tmp_path / "run"), report_to=["none"]))
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "config.yaml").exists()


def test_a_loader_built_without_the_number_of_processes_plans_for_the_world(tmp_path, ranks):
    ranks.run(plan_of_a_loader_built_without_the_world, str(tmp_path))


def test_the_schedule_is_built_for_the_plans_steps(tmp_path, capsys):
    """24 sequences, 64 tokens a micro-batch: 11 micro-batches an epoch (not 24 / 8 = 3), 2 accumulated: 6 steps an
    epoch, 12 in 2 epochs; the linear schedule's warmup and decay are counted in those: lr 0 at the last step, which
    ends the second epoch. The start-up report gives the budget and the mean samples per step."""
    plan = plan_batches(list(map(len, token_train.sequences(24, 0))), 64)
    assert len(plan) == 11
    run_tokens(tmp_path, "--max_tokens_per_batch", "64", "--num_sequences", "24", "--gradient_accumulation_steps",
               "2", "--num_train_epochs", "2", "--warmup_ratio", "0.25", "--learning_rate", "0.01",
               "--logging_steps", "1", "--eval_strategy", "no")
    printed = capsys.readouterr().out
    assert "steps            6 per epoch, 12 in total (2 epoch(s))" in printed
    assert "at most 64 padded tokens per micro-batch (--max_tokens_per_batch" in printed
    assert "= 4.0 samples per step on average" in printed
    logged = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "learning_rate" in r]
    assert [r["step"] for r in logged] == list(range(1, 13))
    assert logged[2]["learning_rate"] == pytest.approx(0.01)  # warmup: 3 steps (0.25 x 12)
    assert logged[-1]["learning_rate"] == 0.0 and logged[-1]["epoch"] == 2.0
    findings = {f["check"]: f["message"] for f in
                json.loads((tmp_path / "report" / "preflight.json").read_text())["findings"]}
    assert findings["train_order"] == "training order: shuffled (TokenBudgetOrder)."
    assert findings["global_batch"].startswith("micro-batches of at most 64 padded tokens (--max_tokens_per_batch)")
    plan = json.loads((tmp_path / "report" / "run_info.json").read_text())["plan"]
    assert plan["steps_per_epoch"] == 6 and plan["global_batch_size"] == 0  # no fixed samples per step to claim
    record = json.loads(next(tmp_path.glob("token_rank0_*.json")).read_text())
    assert len(record["fed"]) == 22  # every micro-batch of both epochs, none repeated to fill a window


LLAMA = ["--model_type", "llama", "--train_tokenizer_vocab_size", "300", "--config_overrides",
         "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=2,"
         "max_position_embeddings=128"]


def test_the_recipes_plan_from_the_widths_they_pad_to_and_refuse_what_batches_otherwise(tmp_path, tiny_bert,
                                                                                       capsys):
    """In this process: recipes/nlp_finetune.py (tiny BERT, rows of 1 to 28 words, --max_tokens_per_batch auto)
    trains on the plan of the budget auto chose, whose steps and padding share are what it reports;
    recipes/text_generation.py (a tiny Llama) refuses a budget with --packing and with --padding_free, naming why,
    before training, and trains on auto's; the classification recipe's lengths are the widths its collator pads to
    (a pad multiple, a length bucket)."""
    import text_generation
    from conftest import FILLER
    from conftest import nlp_main as run_nlp

    from accel_train.tasks.text.buckets import resolve_buckets
    from accel_train.tasks.text.classification import loader_lengths
    from accel_train.tasks.text.generation.demo import date_pairs

    config = TrainConfig(output_dir=str(tmp_path), max_tokens_per_batch=96)
    assert loader_lengths([5, 9, 17], config, False, None, 8) == [8, 16, 24]
    assert loader_lengths([5, 9, 17], config, True, None, None, resolve_buckets("16,32", 32, None)) == [16, 16, 32]
    assert loader_lengths([5, 9], config, True, 32, None) == [32, 32]
    assert loader_lengths([5, 9], TrainConfig(output_dir=str(tmp_path)), False, None, None) is None

    import datasets
    from transformers import T5Config, T5ForConditionalGeneration

    from accel_train.tasks.text.generation import GenerationDataArguments, training_set

    rows = datasets.Dataset.from_dict({"input_ids": [[1] * 5, [1] * 20], "labels": [[1] * 5, [1] * 20]})
    lm, args = token_train.tiny_lm(), GenerationDataArguments()
    assert training_set(rows, args, 40, 0, 8, lm, None, 96).lengths == [8, 24]  # to the pad multiple
    assert "batches of at most 96 padded tokens" in training_set(rows, args, 40, 0, 8, lm, None, 96).summary
    assert training_set(rows, args, 40, 0, None, lm, resolve_buckets("16,40", 40, None), 96).lengths == [16, 40]
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2))
    with pytest.raises(ConfigError, match="encoder-decoder, whose source and target are padded apart"):
        training_set(rows, args, 40, 0, None, t5, None, 96)

    rng = random.Random(5)
    lines = [f"{i % 2} {' '.join(rng.choices(FILLER, k=rng.randint(1, 28)))}\n" for i in range(64)]
    (tmp_path / "train.txt").write_text("".join(lines))
    out = tmp_path / "nlp"
    run_nlp(["--model_name_or_path", str(tiny_bert), "--train_file", str(tmp_path / "train.txt"), "--output_dir",
             str(out), "--report_to", "none", "--disable_tqdm", "--num_train_epochs", "1", "--max_seq_length", "32",
             "--save_strategy", "no", "--load_best_model_at_end", "false", "--per_device_train_batch_size", "8",
             "--eval_strategy", "no", "--no_preflight", "--no_run_report"])  # the recipe's default: auto
    printed = capsys.readouterr().out
    assert "batches: the default token budget (--max_tokens_per_batch auto: as many padded tokens" in printed
    results = json.loads((out / "all_results.json").read_text())
    steps = int(printed.split("steps            ")[1].split(" per epoch")[0])
    assert results["train_steps"] == steps and 5 <= steps <= 9  # auto: about the 7 batches of 8 (58 rows) it replaces
    budget = int(printed.split("at most ")[1].split(" padded tokens per micro-batch")[0])  # auto's number, in use
    assert f"max_tokens_per_batch: {budget}\n" in (out / "config.yaml").read_text() and budget <= 8 * 32
    assert f"train padding ratio {100 * results['train_padding_ratio']:.1f}% (token-budget batches)" in printed

    d = date_pairs(24, 1)
    data = tmp_path / "dates.jsonl"
    data.write_text("".join(json.dumps({"text": t, "summary": s}) + "\n"
                            for t, s in zip(d["text"], d["summary"], strict=True)))
    common = ["--train_file", str(data), "--text_column", "text", "--summary_column", "summary", *LLAMA,
              "--validation_split", "4", "--report_to", "none", "--disable_tqdm", "--no_run_report", "--no_preflight",
              "--max_generate_samples", "0", "--max_source_length", "24", "--max_target_length", "12",
              "--num_train_epochs", "1", "--save_strategy", "no", "--eval_strategy", "no",
              "--load_best_model_at_end", "false"]
    for flags, why in ((["--packing", "--max_seq_length", "64"], "packing fills rows of --max_seq_length tokens"),
                       (["--padding_free"], "a padding-free micro-batch is one row of its examples")):
        reset_accelerate()
        with pytest.raises(ConfigError, match=why):  # asked for: refused
            text_generation.main([*common, "--output_dir", str(tmp_path / "gen"), "--max_tokens_per_batch", "256",
                                  *flags])
    reset_accelerate()  # not asked for: the default gives way to --packing, and says so
    capsys.readouterr()
    text_generation.main([*common, "--output_dir", str(tmp_path / "packed"), "--packing", "--max_seq_length", "64"])
    assert ("batches: 32 examples each (--per_device_train_batch_size), not the default token budget: --packing "
            "fills rows of --max_seq_length tokens already") in capsys.readouterr().out
    reset_accelerate()  # a causal LM's padded batches: planned from the widths its collator pads input_ids to
    text_generation.main([*common, "--output_dir", str(tmp_path / "gen"), "--per_device_train_batch_size", "4"])
    printed = capsys.readouterr().out
    assert "token budget: batches of at most the auto budget (the start-up report gives it)" in printed
    assert "batches: the default token budget (--max_tokens_per_batch auto" in printed
    budget = int(printed.split("at most ")[2].split(" padded tokens per micro-batch")[0])
    assert f"max_tokens_per_batch: {budget}\n" in (tmp_path / "gen" / "config.yaml").read_text()
    steps = int(printed.split("steps            ")[1].split(" per epoch")[0])
    assert json.loads((tmp_path / "gen" / "all_results.json").read_text())["train_steps"] == steps <= 6  # 20 rows


def fixed_batch_checkpoint_seen_by_the_main_process_only(out: str) -> None:
    """[on each rank] A checkpoint trained with batches of examples, which only the main process sees (a node-local
    disk): every rank must take batches of examples, as the main process decides (each rank looked itself before,
    and the other took the budget: loaders of other lengths, and a hang at the first collective)."""
    import json
    from pathlib import Path

    from accelerate import Accelerator

    from accel_train.core import token_batches

    accelerator = Accelerator(cpu=True)
    step = Path(out) / "checkpoints" / "step-00000004"
    if accelerator.is_main_process:
        step.mkdir(parents=True)
        (step / "manifest.json").write_text("{}")
        (step / "train_state.json").write_text(json.dumps({"step": 4, "token_plan": []}))
    real = token_batches.list_checkpoints
    if not accelerator.is_main_process:  # this rank's processes live on: put it back after
        token_batches.list_checkpoints = lambda output_dir: []
    accelerator.wait_for_everyone()
    try:
        why = token_batches._resumed_with_fixed_batches(TrainConfig(output_dir=out, resume_from_checkpoint="latest"),
                                                        accelerator)
    finally:
        token_batches.list_checkpoints = real
    assert why == "the checkpoint it resumes (step-00000004) was trained with batches of examples", why


def test_every_rank_keeps_batches_of_examples_as_the_main_process_decides(tmp_path, ranks):
    ranks.run(fixed_batch_checkpoint_seen_by_the_main_process_only, str(tmp_path / "run"))
