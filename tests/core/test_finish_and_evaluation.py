"""Rules of the library that every recipe relies on at the end of a run and in its evaluations:

* the final model is written before the finish seam, and an error there loses nothing trained;
* evaluations (and the overfit check) never include training-only terms such as label smoothing;
* a resume follows each param group's own rate and decay; a best checkpoint of another run is not kept;
* a --metric_for_best_model that no evaluation reports is refused before training.
"""

import json

import pytest
import token_train
import torch
import toy_train
from conftest import read_jsonl, reset_accelerate
from torch.utils.data import DataLoader

from accel_train import ConfigError, FinishError, TrainConfig, default_loss, evaluation_loss, train
from accel_train.core.evaluation import evaluate_model, gather_outputs, prepare_for_evaluation
from accel_train.rundir.checkpoint import list_checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")


def token_config(out, **changes):
    base = dict(output_dir=str(out), report_to=["none"], disable_tqdm=True, run_report=False, save_strategy="no",
                eval_strategy="no", per_device_train_batch_size=4, per_device_eval_batch_size=4, logging_steps=1)
    return TrainConfig(**{**base, **changes})


def token_loaders(n=8):
    rows = token_train.sequences(n, 0)
    return (DataLoader(token_train.Sequences(rows), batch_size=4, collate_fn=token_train.collate()),
            DataLoader(token_train.Sequences(token_train.sequences(6, 1)), batch_size=4,
                       collate_fn=token_train.collate()))


# -------------------------------------------------------------------------------------------- the finish seam


class BrokenFinish:
    finish_advice = "Lower --generation_num_beams."

    def on_finish(self, session, metrics):
        metrics["eval_partial"] = 1.0
        raise RuntimeError("generation index out of range")


def test_an_error_in_the_finish_seam_keeps_the_model_the_results_and_the_crash_record(tmp_path):
    train_loader, eval_loader = token_loaders()
    with pytest.raises(FinishError) as caught:
        train(token_train.tiny_lm(), train_loader, eval_loader=eval_loader, hooks=[BrokenFinish()],
              config=token_config(tmp_path, max_steps=2))
    message = str(caught.value)
    assert "nothing it trained is lost" in message and "BrokenFinish.on_finish failed with RuntimeError" in message
    assert str(tmp_path / "all_results.json") in message and "crash_rank0.json" in message
    assert message.endswith("Lower --generation_num_beams.")
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "config.json").is_file()
    results = json.loads((tmp_path / "all_results.json").read_text())
    assert results["train_steps"] == 2 and results["eval_loss"] > 0 and results["eval_partial"] == 1.0
    crash = json.loads((tmp_path / "crash_rank0.json").read_text())
    assert crash["error"] == "FinishError" and "generation index out of range" in crash["traceback"]
    final = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("final")]
    assert final and "eval_loss" in final[0]  # the final evaluation is in the history too


def test_the_finish_seam_sees_the_final_model_already_written(tmp_path):
    seen = {}

    class Look:
        def on_finish(self, session, metrics):
            seen["weights"] = (tmp_path / "model.safetensors").is_file()

    train(token_train.tiny_lm(), token_loaders()[0], hooks=[Look()], config=token_config(tmp_path, max_steps=1))
    assert seen == {"weights": True}


# --------------------------------------------------------------------------------- evaluation without regularisers


def test_evaluation_measures_the_plain_token_loss_whatever_the_label_smoothing(tmp_path):
    train_loader = token_loaders()[0]  # evaluated on the sequences it memorises: a peaked model, where smoothing shows
    config = token_config(tmp_path, max_steps=60, learning_rate=3e-2, label_smoothing_factor=0.1)
    result = train(token_train.tiny_lm(), train_loader, eval_loader=token_loaders()[0], config=config,
                   loss_fn=default_loss(0.1))
    batch = token_train.collate()(token_train.sequences(8, 0))
    model = result.model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    plain, smoothed = (torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, label_smoothing=s).item()
                       for s in (0.0, 0.1))
    assert result.metrics["eval_loss"] == pytest.approx(plain, abs=1e-5), "eval_loss must be the plain NLL"
    assert smoothed > plain + 0.05  # the two differ on this model: the assertion above tells them apart


def test_a_loss_with_training_only_terms_declares_the_one_evaluations_use():
    plain, smoothed = default_loss(), default_loss(0.1)
    assert evaluation_loss(plain) is plain and evaluation_loss(smoothed) is not smoothed
    reset_accelerate()
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(token_loaders()[1])
    model = token_train.tiny_lm()
    assert evaluate_model(accelerator, model, loader, evaluation_loss(smoothed))["eval_loss"] == pytest.approx(
        evaluate_model(accelerator, model, loader, plain)["eval_loss"], abs=1e-7)


def test_evaluations_leave_the_training_draws_alone(tmp_path):
    # each iter() of a DataLoader without a generator of its own draws its worker base seed from torch's global
    # generator: an evaluation every step moved every later dropout mask, so how often a run was evaluated changed
    # what it trained (the main job evaluated per epoch ended 1 point off the same run evaluated every 32 steps)
    def dropout_run(out, shuffled=False, **changes):
        reset_accelerate()
        model = token_train.tiny_lm()
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.3
        train_loader, eval_loader = token_loaders()
        if shuffled:  # its RandomSampler's order: a generator of its own from accelerator.prepare
            eval_loader = DataLoader(eval_loader.dataset, batch_size=4, shuffle=True, collate_fn=eval_loader.collate_fn)
        result = train(model, train_loader, eval_loader=eval_loader,
                       config=token_config(out, max_steps=4, num_train_epochs=2, **changes))
        return dict(result.model.named_parameters()), [r["loss"] for r in read_jsonl(out / "metrics.jsonl")
                                                         if "loss" in r]

    plain, plain_losses = dropout_run(tmp_path / "plain")
    evaluated, evaluated_losses = dropout_run(tmp_path / "evaluated", eval_strategy="steps", eval_steps=1)
    assert evaluated_losses == plain_losses and len(plain_losses) == 4
    assert all(torch.equal(plain[name], value) for name, value in evaluated.items())
    shuffled, shuffled_losses = dropout_run(tmp_path / "shuffled", True, eval_strategy="steps", eval_steps=1)
    assert shuffled_losses == plain_losses
    assert all(torch.equal(plain[name], value) for name, value in shuffled.items())


def test_the_overfit_check_judges_the_unsmoothed_loss(tmp_path):
    # smoothed cross-entropy over a 32-word vocabulary cannot fall below ~0.5 nats: the check judged a floor
    config = token_config(tmp_path, overfit_batches=1, max_steps=300, learning_rate=3e-2, lr_scheduler_type="constant",
                          label_smoothing_factor=0.1)
    result = train(token_train.tiny_lm(), token_loaders()[0], config=config, loss_fn=default_loss(0.1))
    assert result.metrics["overfit_passed"] == 1.0
    assert result.metrics["overfit_final_loss"] <= 0.05 * result.metrics["overfit_initial_loss"]


# ------------------------------------------------------------------------------------------ resume, per group


def grouped_run(out, rates, **changes):
    """A toy job whose two layers train at their own rates (explicit param groups)."""
    reset_accelerate()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    groups = [{"params": model[0].parameters(), "lr": rates[0]}, {"params": model[2].parameters(), "lr": rates[1]}]

    def loss_fn(model, batch):
        losses = torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"], reduction="none")
        return {"loss": losses.mean(), "per_sample_loss": losses}

    config = TrainConfig(**{**dict(output_dir=str(out), report_to=["none"], disable_tqdm=True, run_report=False,
                                   optim="sgd", lr_scheduler_type="constant", learning_rate=rates[0], max_steps=6,
                                   save_strategy="steps", save_steps=2, eval_strategy="no", logging_steps=1,
                                   per_device_train_batch_size=8), **changes})
    result = train(model, DataLoader(toy_train.Points(48, 0), batch_size=8), config=config, loss_fn=loss_fn,
                   optimizer=groups, end_training=True)
    return [group["lr"] for group in result.accelerator._optimizers[0].param_groups]


class StopAtSave:
    def __init__(self, step):
        self.step = step

    def on_save(self, state, path):
        return state.step == self.step


def test_a_changed_rate_of_one_param_group_is_applied_to_that_group_only(tmp_path, capsys, monkeypatch):
    # the run is cut at step 4, then resumed with the second group's rate doubled: before this rule the change
    # was silently ignored (only --learning_rate was compared, and it rescaled every group)
    reset_accelerate()
    torch.manual_seed(0)
    assert grouped_run(tmp_path, (0.1, 0.2), max_steps=4) == [0.1, 0.2]
    resumed = grouped_run(tmp_path, (0.1, 0.4), resume_from_checkpoint="latest")
    assert resumed == pytest.approx([0.1, 0.4])
    out = capsys.readouterr().out
    assert "param group 1: peak learning rate 0.2 -> 0.4, weight decay 0 -> 0: applied" in out
    assert "param group 0" not in out


def test_a_best_checkpoint_of_another_run_is_not_kept_when_resuming_from_it(tmp_path, capsys):
    common = ["--report_to", "none", "--disable_tqdm", "--save_strategy", "steps", "--save_steps", "2",
              "--eval_strategy", "steps", "--eval_steps", "2", "--load_best_model_at_end"]
    reset_accelerate()
    toy_train.main(["--output_dir", str(tmp_path / "a"), *common, "--max_steps", "4"])
    source = list_checkpoints(tmp_path / "a")[-1]
    reset_accelerate()
    toy_train.main(["--output_dir", str(tmp_path / "b"), *common, "--max_steps", "8", "--resume_from_checkpoint",
                    str(source)])
    out = capsys.readouterr().out
    assert "is in " + str(source.parent) in out and "the best is tracked afresh" in out
    assert "restored the best checkpoint " + str(tmp_path / "b" / "checkpoints") in out


@pytest.mark.parametrize("change", [["--per_device_eval_batch_size", "5"], ["--eval_samples", "20"]],
                         ids=["eval_batch", "eval_set"])
def test_a_run_resumed_at_its_last_step_reuses_its_evaluation_only_where_its_own_would_be_the_same(tmp_path, change):
    """Step 8 is evaluated before its checkpoint, which stores that evaluation; the run resumed from it has no step
    left, and its final evaluation reused the stored numbers whatever it would evaluate now: with another evaluation
    batch (verify's evaluation check: its world size never measured) or set, the old numbers were the results. Those
    evaluate again (a final record logged); the same setup reuses (test_rescue: logged once)."""
    out = tmp_path / "run"
    flags = ["--output_dir", str(out), "--eval_strategy", "steps", "--eval_steps", "4", "--max_steps", "8",
             "--save_steps", "8", "--per_device_eval_batch_size", "8"]
    reset_accelerate()
    toy_train.main(flags)
    before = json.loads((out / "all_results.json").read_text())
    reset_accelerate()
    toy_train.main([*flags, "--resume_from_checkpoint", "latest", *change])
    after = json.loads((out / "all_results.json").read_text())
    finals = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("final")]
    assert len(finals) == 1 and finals[0]["eval_samples"] == after["eval_samples"]
    assert after["eval_samples"] == (20 if "--eval_samples" in change else before["eval_samples"])


def test_a_metric_no_evaluation_reports_is_refused_before_training(tmp_path):
    train_loader, eval_loader = token_loaders()
    with pytest.raises(ConfigError, match=r"--metric_for_best_model rougeL: the evaluations of this run report only "
                                          r"eval_loss, eval_perplexity"):
        train(token_train.tiny_lm(), train_loader, eval_loader=eval_loader,
              config=token_config(tmp_path, max_steps=1, metric_for_best_model="rougeL", eval_strategy="steps",
                                  eval_steps=1))
    assert not (tmp_path / "metrics.jsonl").exists()


# ------------------------------------------------------------------------ what a loss declares, the session does


class BatchLoss:
    """A loss that declares what it needs: a clock hook, no accumulation, unused parameters under DDP."""

    leaves_parameters_unused = True

    def __init__(self):
        self.seen_steps = []
        self.hooks = (self,)
        self.state = None

    def on_train_start(self, state):
        self.state = state

    def refuse_accumulation(self, steps):
        return f"--gradient_accumulation_steps {steps}: this loss couples the whole batch."

    def __call__(self, model, batch):
        self.seen_steps.append(self.state.step)  # the clock was registered without the caller passing it
        losses = torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"], reduction="none")
        return {"loss": losses.mean(), "per_sample_loss": losses}


def test_the_session_registers_a_losss_hooks_refuses_accumulation_and_expects_unused_parameters(tmp_path):
    loader = DataLoader(toy_train.Points(16, 0), batch_size=4)
    config = token_config(tmp_path / "a", max_steps=3)
    loss_fn = BatchLoss()
    result = train(torch.nn.Linear(6, 2), loader, config=config, loss_fn=loss_fn)
    assert loss_fn.seen_steps == [0, 1, 2]
    assert result.accelerator.ddp_handler.find_unused_parameters is True
    reset_accelerate()
    with pytest.raises(ConfigError, match="--gradient_accumulation_steps 2: this loss couples the whole batch"):
        train(torch.nn.Linear(6, 2), loader, config=token_config(tmp_path / "b", max_steps=3,
                                                                 gradient_accumulation_steps=2), loss_fn=BatchLoss())
    assert not (tmp_path / "b" / "metrics.jsonl").exists()


def test_a_loader_accelerate_did_not_prepare_is_evaluated_whole_even_at_a_training_loaders_last_batch():
    """gather_for_metrics reads the state of the loader Accelerate is iterating: at the last batch of a prepared
    training loader (10 rows in 4s: remainder 2) it cut every batch of an unprepared evaluation loader to 2 rows (a
    Trainer's evaluation at its last step scored 32 of 200 items). A prepared evaluation loader keeps its own state."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    reset_accelerate()
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    rows = [{"x": torch.full((3,), float(i))} for i in range(8)]

    def step(m, batch):
        return {"y": m(batch["x"]), "x": batch["x"][:, 0]}

    train_loader = accelerator.prepare(DataLoader(torch.zeros(10, 3), batch_size=4))
    seen = []
    for i, _ in enumerate(train_loader):
        if i == 2:
            assert accelerator.gradient_state.end_of_dataloader and accelerator.gradient_state.remainder == 2
            for loader in (DataLoader(rows, batch_size=4), accelerator.prepare(DataLoader(rows, batch_size=4))):
                seen.append(gather_outputs(accelerator, model, loader, step)["x"].tolist())
    assert seen == [[float(i) for i in range(8)]] * 2
    two = SimpleNamespace(num_processes=2, prepare=lambda loader: loader)  # a stand-in: the refusals need no peer
    with pytest.raises(ConfigError, match=r"accelerator.prepare\(loader\)"):  # two processes: each would see all
        gather_outputs(two, model, DataLoader(rows, batch_size=4), step)
    with pytest.raises(ConfigError, match="every process would evaluate every item"):  # train(): before training
        prepare_for_evaluation(two, [rows[:4], rows[4:]])  # a list of batches: prepare returns it unchanged
    assert prepare_for_evaluation(two, None) is None


def test_a_multi_label_model_gets_per_sample_losses_so_evaluation_drops_the_repeats():
    """Float multi-hot labels: the default loss gave no per-sample loss, so an evaluation on several processes spread
    the batch mean (the repeats that even out the last batch included) over its samples, as regression did. Each
    sample's binary cross-entropy, the mean over its labels: their mean is the model's own loss."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        num_labels=3, problem_type="multi_label_classification"))
    batch = {"input_ids": torch.randint(5, 30, (5, 7)), "attention_mask": torch.ones(5, 7, dtype=torch.long),
             "labels": torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0], [1, 0, 0]], dtype=torch.float)}
    out = default_loss()(model, batch)
    assert out["per_sample_loss"].shape == (5,)
    assert out["per_sample_loss"].mean().item() == pytest.approx(out["loss"].item(), rel=1e-6)
