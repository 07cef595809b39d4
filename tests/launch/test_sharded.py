"""FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 through the shipped presets, on 2 CPU processes over gloo.

Accelerate enables FSDP and DeepSpeed only on GPU-like devices, so on CPU the presets are refused (tested here
without the shim, on the session's spawned gloo ranks); with tests/scripts/sharded_cpu.py (test-only) Accelerate takes
its real sharded code paths on CPU tensors.
For each back-end, one tiny BERT run of the NLP recipe in two launches, SIGKILLed after step 11 and resumed from its
step-6 checkpoint: the start-up report names the back-end, the steps the resumed run replays equal the killed run's
bitwise (optimizer state included: Adam's moments decide the next steps), the final parameters equal 2-process DDP,
the checkpoints are sharded and covered by the manifest, and the exported model loads with `from_pretrained`. The
FSDP2 run also keeps a weight average (--ema_decay), sharded with the model: its evaluations and its final model
(--save_ema_as_final) equal DDP's average, and it resumes bitwise from its shards. The default AdamW is torch's
fused kernel (FSDP2, ZeRO-2, and ZeRO-3's preset JSON AdamW told to fuse by --optim adamw_torch_fused); a second
FSDP2 run takes torch's loop kernel (--optim adamw_torch); each against DDP with the same flags.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    ACCELERATE_CONFIGS,
    RECIPES,
    SCRIPTS,
    free_port,
    make_rows,
    nlp_main,
    read_jsonl,
    run_process_tree,
    subprocess_env,
)
from safetensors.torch import load_file

from accel_train import LaunchError, TrainConfig, build_accelerator
from accel_train.core.deepspeed_json import fill_deepspeed_config
from accel_train.core.optim import make_plan
from accel_train.core.sharded import carve_out_embedding, check_engine
from accel_train.rundir.checkpoint import list_checkpoints, read_manifest, verify_checkpoint

RECIPE = RECIPES / "nlp_finetune.py"
SHIM = SCRIPTS / "sharded_cpu.py"
LAUNCH_TIMEOUT = 420  # seconds per launch: a hung collective fails, never hangs CI
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

# back-end -> (preset, distributed type in the start-up report, sharded checkpoint files, tolerance against DDP,
# flags of both runs: under FSDP2 a weight average, sharded with the model, evaluated between steps, is the final
# model). The default --optim adamw runs torch's fused AdamW kernel on CPU: on FSDP2's DTensors and on ZeRO-2's flat
# partitions; a second FSDP2 run takes torch's loop kernel (--optim adamw_torch) and the NLP recipes' default batching,
# a token budget (auto; the rows here are of one length, so its plan has the 12 steps of batches of 4), and ZeRO-3 the
# preset JSON's AdamW, told to fuse by --optim adamw_torch_fused.
EMA = ("--ema_decay", "0.8", "--save_ema_as_final", "--eval_strategy", "steps", "--eval_steps", "4")
LOOP = ("--optim", "adamw_torch", "--max_tokens_per_batch", "auto")
BACKENDS = {
    "fsdp2": ("fsdp.yaml", "FSDP", "pytorch_model_fsdp_0/*.distcp", 1e-6, EMA),
    "fsdp2_loop_adamw": ("fsdp.yaml", "FSDP", "pytorch_model_fsdp_0/*.distcp", 1e-6, LOOP),
    "zero2": ("deepspeed_zero2.yaml", "DEEPSPEED", "pytorch_model/zero_pp_rank_*_optim_states.pt", 1e-6, ()),
    "zero3": ("deepspeed_zero3.yaml", "DEEPSPEED", "pytorch_model/zero_pp_rank_*_model_states.pt", 1e-4,
              ("--optim", "adamw_torch_fused")),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_data")
    files = {}
    for split, n, seed in (("train", 96, 0), ("dev", 40, 1)):
        files[split] = root / f"toy.{split}"
        files[split].write_text("".join(f"{y} {t}\n" for y, t in make_rows(n, seed)))
    return files


def recipe_args(tiny_bert, data, out: Path) -> list[str]:
    """12 optimizer steps of 2 x 4 samples (batches of examples: DeepSpeed refuses a token budget; the FSDP2 run of
    LOOP asks for the default budget again, its DDP reference too); checkpoints every 6 steps."""
    return ["--model_name_or_path", str(tiny_bert), "--train_file", str(data["train"]), "--validation_file",
            str(data["dev"]), "--num_train_epochs", "1", "--per_device_train_batch_size", "4",
            "--max_tokens_per_batch", "0",
            "--learning_rate", "3e-3", "--warmup_steps", "0.1", "--max_seq_length", "32", "--save_strategy", "steps",
            "--save_steps", "6", "--eval_strategy", "epoch", "--logging_steps", "1", "--report_to", "none",
            "--disable_tqdm", "--cpu_threads", "1", "--mixed_precision", "no", "--output_dir", str(out)]


@pytest.fixture(scope="module")
def extensions(tmp_path_factory) -> Path:
    """An empty TORCH_EXTENSIONS_DIR for the launches: the shim keeps DeepSpeed from building its CPU collectives op,
    so nothing may appear in it."""
    return tmp_path_factory.mktemp("torch_extensions")


def sharded_launch(preset: str, args: list[str], extensions: Path, fault: str | None = None):
    """`accelerate launch` of the recipe with a shipped preset on 2 processes, in fp32 (the presets' bf16 would not
    compare with DDP), through the shim."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIGS / preset),
           "--num_processes", "2", "--main_process_port", str(free_port()), "--mixed_precision", "no", str(SHIM),
           str(RECIPE), *args]
    env = subprocess_env(TORCH_EXTENSIONS_DIR=str(extensions), **({"ACCEL_TRAIN_FAULT": fault} if fault else {}))
    return run_process_tree(cmd, env, LAUNCH_TIMEOUT)


def ok(proc) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return output


@pytest.fixture(scope="module")
def ddp_references(tiny_bert, data, tmp_path_factory, ranks):
    """reference(flags): the 2-process DDP run with those flags, once per module, on the session's spawned gloo ranks
    (plain DDP: the launcher is not what it is compared for)."""
    made: dict[tuple[str, ...], Path] = {}

    def reference(flags: tuple[str, ...]) -> Path:
        if flags not in made:
            out = tmp_path_factory.mktemp("ddp") / "run"
            ranks.run(nlp_main, [*recipe_args(tiny_bert, data, out), *flags], timeout=LAUNCH_TIMEOUT)
            made[flags] = out
        return made[flags]

    return reference


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def exported(out: Path) -> dict[str, torch.Tensor]:
    """The exported model as `from_pretrained` loads it (transformers may save LayerNorm weights under their
    original gamma / beta names and renames them on load)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(out)
    return {k: v.detach() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------ in-process: refusals and fills


def test_fsdp_asked_on_cpu_is_refused_not_run_as_ddp(monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(LaunchError, match=r"FSDP was requested .* but this run would be NO .* only on GPU-like"):
        build_accelerator(TrainConfig(output_dir=str(tmp_path)))


def test_fsdp1_is_refused_with_the_reason():
    from accelerate.utils import DistributedType

    fake = SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(
        fsdp_plugin=SimpleNamespace(fsdp_version=1)))
    with pytest.raises(LaunchError, match="silently drops the optimizer state"):
        check_engine(fake)


def test_fsdp2_wraps_the_layers_but_not_the_module_holding_the_embedding(tiny_bert):
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert)
    assert set(model._no_split_modules) == {"BertEmbeddings", "BertLayer"}
    plugin = SimpleNamespace(auto_wrap_policy=transformer_auto_wrap_policy, transformer_cls_names_to_wrap=None)
    assert carve_out_embedding(plugin, model) == ["BertLayer"]
    assert plugin.transformer_cls_names_to_wrap == ["BertLayer"]
    size_based = SimpleNamespace(auto_wrap_policy=None, transformer_cls_names_to_wrap=None)
    assert carve_out_embedding(size_based, model) is None and size_based.transformer_cls_names_to_wrap is None


def test_deepspeed_auto_values_come_from_the_config_and_span_the_whole_run():
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    ds = json.loads((ACCELERATE_CONFIGS / "deepspeed" / "zero3.json").read_text())
    ds["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto",
                                                           "total_num_steps": "auto"}}
    ds["optimizer"]["params"]["eps"] = 1e-6  # set explicitly: kept
    plugin = SimpleNamespace(hf_ds_config=HfDeepSpeedConfig(ds))
    config = TrainConfig(learning_rate=2e-4, adam_beta2=0.98, max_grad_norm=0.5, warmup_steps=10, output_dir="x")
    plan = make_plan(config, batches_per_epoch=50, num_processes=8)
    fill_deepspeed_config(plugin, config, plan)
    ds = plugin.hf_ds_config.config
    assert ds["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.0,
                                         "torch_adam": True}
    assert ds["scheduler"]["params"] == {"warmup_max_lr": 2e-4, "warmup_num_steps": 10, "total_num_steps": 150}
    assert ds["gradient_clipping"] == 0.5
    assert ds["train_batch_size"] == "auto"  # Accelerate's to fill, from the prepared loader


def test_an_optim_the_deepspeed_json_would_replace_is_refused_and_fused_is_passed_on():
    """A DeepSpeed JSON's optimizer is built by DeepSpeed in place of --optim's: the same update runs (fused when
    asked, through torch.optim.AdamW's `fused`, which DeepSpeed passes on with `torch_adam`), another is refused by
    name before anything is built; the default --optim asks for nothing, so the JSON's choice stands (and is said)."""
    from accel_train import ConfigError
    from accel_train.core.deepspeed_json import use_json_optimizer

    def preset() -> dict:
        return json.loads((ACCELERATE_CONFIGS / "deepspeed" / "zero3.json").read_text())["optimizer"]

    for optim in ("adamw", "adamw_torch"):
        ds = preset()
        use_json_optimizer(ds, optim)
        assert ds == preset()  # nothing added
    ds = preset()
    use_json_optimizer(ds, "adamw_torch_fused")
    assert ds["params"]["fused"] is True and ds["params"]["torch_adam"] is True
    for optim, kind in (("sgd", "AdamW"), ("adam", "AdamW"), ("adamw_torch", "Lamb")):
        with pytest.raises(ConfigError, match=rf"--optim {optim} asks for another update than the DeepSpeed JSON "
                                              rf"config's optimizer, {kind}.*Remove the \"optimizer\" section"):
            use_json_optimizer({**preset(), "type": kind}, optim)
    use_json_optimizer({"type": "Lamb", "params": {}}, "adamw")  # the default: DeepSpeed's Lamb, said in the report
    use_json_optimizer({"type": "Adam", "params": {"adam_w_mode": False}}, "adam")  # Adam without decoupled decay
    with pytest.raises(ConfigError, match='sets "fused": false'):
        use_json_optimizer({"type": "AdamW", "params": {"torch_adam": True, "fused": False}}, "adamw_torch_fused")
    kernels = {"type": "AdamW", "params": {}}  # without torch_adam DeepSpeed builds its own (fused) Adam kernels
    use_json_optimizer(kernels, "adamw_torch_fused")
    assert kernels == {"type": "AdamW", "params": {}}


def test_a_schedule_the_deepspeed_json_would_replace_is_refused():
    """A DeepSpeed JSON's scheduler is stepped by DeepSpeed in place of the one accel_train builds: the default
    --lr_scheduler_type with no arguments asks for nothing (the JSON's stands, said in the report); a schedule named
    or given arguments is refused, naming both and what to do."""
    from accel_train import ConfigError, TrainConfig
    from accel_train.core.deepspeed_json import use_json_scheduler

    ds = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}}
    use_json_scheduler(ds, TrainConfig(report_to=["none"]))
    for asked, config in (("--lr_scheduler_type cosine", TrainConfig(lr_scheduler_type="cosine", report_to=["none"])),
                          ("--lr_scheduler_kwargs", TrainConfig(lr_scheduler_kwargs='{"num_cycles": 2}',
                                                                lr_scheduler_type="linear", report_to=["none"]))):
        with pytest.raises(ConfigError, match=rf"{asked} \(given, or the recipe's or its config's default\) asks "
                                              r"for a schedule, and the DeepSpeed JSON config has a scheduler, "
                                              r"WarmupDecayLR.*Remove the \"scheduler\" section.*pass "
                                              r"--lr_scheduler_type linear"):
            use_json_scheduler(ds, config)
    assert ds == {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}}


def built_as(out: Path, json_config: dict | None = None, kind: str = "DEEPSPEED", **flags):
    """build_accelerator(TrainConfig(output_dir=out, **flags)) as under DeepSpeed with `json_config` as its JSON (or
    FSDP: `kind`). Accelerate runs both only on GPU-like devices: here a CPU accelerator reports `kind`, and the JSON
    as its DeepSpeed config, once check_engine has returned."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    from accel_train.core import accelerator as module

    check = module.check_engine
    with pytest.MonkeyPatch.context() as patch:
        def then_sharded(accelerator) -> None:
            check(accelerator)
            patch.setattr(Accelerator, "distributed_type", property(lambda _: DistributedType[kind]))
            patch.setattr(AcceleratorState, "deepspeed_plugin",
                          property(lambda _: SimpleNamespace(deepspeed_config=json_config or {})))

        patch.setattr(module, "check_engine", then_sharded)
        return build_accelerator(TrainConfig(output_dir=str(out), report_to=["none"], **flags))


def zero3_json(**changes) -> dict:
    """The shipped ZeRO-3 preset's JSON, with `changes` (a value None: the key left out)."""
    ds = json.loads((ACCELERATE_CONFIGS / "deepspeed" / "zero3.json").read_text())
    ds.update(changes)
    return {key: value for key, value in ds.items() if value is not None}


def test_deepspeed_json_refusals_come_when_the_accelerator_is_built(tmp_path):
    """An --optim or a schedule that a DeepSpeed JSON would replace, a token budget and Muon are refused by
    build_accelerator, which a recipe calls before it loads data or builds a model (the refusals need only the config
    and the JSON), with nothing written; `adamw_torch_fused` is passed on there (`built_as`: the preset's JSON with a
    scheduler added; for Muon, a JSON without an optimizer: with one, the JSON's refusal comes first)."""
    from accel_train import ConfigError

    ds = zero3_json(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}})
    out = tmp_path / "run"
    for flags, refusal in (({"optim": "sgd"}, "--optim sgd asks for another update than the DeepSpeed JSON"),
                           ({"lr_scheduler_type": "cosine"}, "--lr_scheduler_type cosine .* scheduler, WarmupLR"),
                           ({"max_tokens_per_batch": 64}, "--max_tokens_per_batch 64 under DeepSpeed: its micro-"),
                           ({"optim": "muon", "json_config": {}}, "--optim muon cannot run under DeepSpeed")):
        with pytest.raises(ConfigError, match=refusal):
            built_as(out, **{"json_config": ds, **flags})
        assert not out.exists()
    assert "fused" not in ds["optimizer"]["params"]
    built_as(out, ds, optim="adamw_torch_fused")
    assert ds["optimizer"]["params"]["fused"] is True


def test_an_accumulation_count_other_than_the_flags_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """The loop plans its steps from --gradient_accumulation_steps and steps on the accelerator's count: Accelerate
    takes the launcher's ACCELERATE_GRADIENT_ACCUMULATION_STEPS (`accelerate launch --gradient_accumulation_steps`,
    a DeepSpeed YAML's) over the count it is given, and under DeepSpeed the JSON's explicit value (a JSON without the
    key counts as 1). Either would train another number of epochs at another global batch than planned and reported:
    refused when the accelerator is built, naming both counts, with nothing written; "auto" takes the flag's."""
    from accel_train import ConfigError

    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
        with pytest.raises(ConfigError, match=r"--gradient_accumulation_steps 1, but the launcher set "
                                              r"ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4.*drop "
                                              r"--gradient_accumulation_steps from `accelerate launch`"):
            build_accelerator(TrainConfig(output_dir=str(out), report_to=["none"]))
    assert not out.exists()
    for ds, says in ((zero3_json(gradient_accumulation_steps=1), "the DeepSpeed JSON config says 1"),
                     (zero3_json(gradient_accumulation_steps=None), r"the DeepSpeed JSON config has no "
                                                                    r"\"gradient_accumulation_steps\", which "
                                                                    r"Accelerate reads as 1")):
        with pytest.raises(ConfigError, match=rf"--gradient_accumulation_steps 4, but {says}.*the loop's plan and "
                                              r"the engine would disagree.*\"gradient_accumulation_steps\": \"auto\""):
            built_as(out, ds, gradient_accumulation_steps=4)
        assert not out.exists()
    assert built_as(out, zero3_json(), gradient_accumulation_steps=4).gradient_accumulation_steps == 4  # "auto"
    built_as(out, zero3_json(gradient_accumulation_steps=4), gradient_accumulation_steps=4)  # the same count


def test_an_accelerator_of_ones_own_with_another_accumulation_count_is_refused(tmp_path):
    """train(accelerator=Accelerator(gradient_accumulation_steps=4)) beside a config of 1: the plan (steps, schedule,
    global batch) would count 1 micro-batch a step and the loop step every 4th: refused before anything is written."""
    from accelerate import Accelerator

    from accel_train import ConfigError, train

    out = tmp_path / "run"
    config = TrainConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=4, report_to=["none"],
                         disable_tqdm=True, run_report=False, preflight=False, eval_strategy="no", save_strategy="no")
    with pytest.raises(ConfigError, match=r"--gradient_accumulation_steps 1, but the Accelerator passed to train\(\) "
                                          r"accumulates 4 micro-batches.*Accelerator\(gradient_accumulation_steps=1\)"):
        train(torch.nn.Linear(4, 1), torch.utils.data.DataLoader(points(), batch_size=4), config=config,
              loss_fn=mean_loss, accelerator=Accelerator(gradient_accumulation_steps=4))
    assert not out.exists() or not any(out.iterdir())


def test_deepspeeds_float_grad_norm_is_judged_and_a_spike_it_has_applied_is_not_said_dropped(tmp_path):
    """DeepSpeed steps inside backward and returns the gradient norm as a Python float (inf where its fp32/bf16
    engine skipped a non-finite step): the guard judges that float as it judges a tensor, so --on_nonfinite applies
    (the norm of DeepSpeed's fp16 loss scaler, which owns overflows, is left to it). The spiked update is in the
    weights before the loop sees the step's loss: --on_spike skip, which would say it dropped it, is refused when the
    accelerator is built, and --on_spike stop says the update was applied (rollback returns to the checkpoint)."""
    from accelerate.utils import DistributedType

    from accel_train import ConfigError, TrainingDiverged
    from accel_train.core.guard import StepGuard, Verdict, on_spike

    def judged(norm, **engine) -> Verdict:
        guard = StepGuard(SimpleNamespace(device=torch.device("cpu"), num_processes=1, **engine), check_gradients=True)
        guard.watch(torch.tensor(0.5))
        return guard.verdict(norm)

    assert judged(float("inf")).nonfinite_grad and judged(float("nan")).nonfinite_grad
    assert not judged(0.5).nonfinite_grad and not judged(torch.tensor(0.5)).nonfinite_grad
    assert judged(float("inf"), distributed_type=DistributedType.DEEPSPEED, mixed_precision="bf16").nonfinite_grad
    assert not judged(float("inf"), distributed_type=DistributedType.DEEPSPEED, mixed_precision="fp16").nonfinite_grad

    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"--on_spike skip under DeepSpeed: DeepSpeed applies the update inside "
                                          r"backward.*--on_spike rollback"):
        built_as(out, {}, spike_window=3, spike_threshold=10, on_spike="skip")
    assert not out.exists()
    built_as(out, {}, spike_window=3, spike_threshold=10, on_spike="rollback", save_steps=2)

    config = TrainConfig(output_dir=str(out), spike_window=3, spike_threshold=10, report_to=["none"])
    state = SimpleNamespace(step=6, epoch=0, batch_in_epoch=7, spike_skips=0, spike_rollbacks=0)
    for kind, said in (("DEEPSPEED", "DeepSpeed applied the update inside backward"),
                       ("MULTI_CPU", "The update was not applied")):
        session = SimpleNamespace(config=config, log=None, settle_writes=lambda _: False,
                                  control=SimpleNamespace(pending=[]), train_loader=[],
                                  accelerator=SimpleNamespace(num_processes=1, process_index=0,
                                                              distributed_type=DistributedType[kind]))
        with pytest.raises(TrainingDiverged, match=said):
            on_spike(session, state, Verdict(spike=True, loss=50.0, reference=1.0),
                     SimpleNamespace(hold=lambda: None, release=lambda: None))


def prepared_under_deepspeed(ds: dict, batches_per_epoch: int | None = 12, given: tuple[str, ...] = (), **flags):
    """prepare_engine under DeepSpeed with `ds` as its JSON config, for a run of `flags` (`given`: the ones the user
    set, as parse_config records them) on 2 processes; the accelerator (a stub) reports what the engine reads."""
    from accelerate.utils import DistributedType
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    from accel_train.core.sharded import prepare_engine

    config = TrainConfig(output_dir="x", report_to=["none"], **flags)
    object.__setattr__(config, "given", frozenset(given))
    hf = HfDeepSpeedConfig(ds)
    engine = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED,
                             gradient_accumulation_steps=config.gradient_accumulation_steps,
                             state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(hf_ds_config=hf,
                                                                                    deepspeed_config=hf.config)))
    prepare_engine(engine, torch.nn.Linear(4, 1), config, make_plan(config, batches_per_epoch, num_processes=2))
    return engine


def test_deepspeed_refuses_an_epoch_whose_last_accumulation_window_is_short():
    """Accelerate steps at the end of the loader, so an epoch of 12 micro-batches per process with accumulation 5 ends
    in a window of 2: the loop makes it the mean of its 2 by rescaling the gradients after backward, but DeepSpeed
    divides every micro-batch by its count (5) and steps inside backward, so that step would weigh 2/5. Refused before
    prepare, naming the divisors; a count that divides the epoch, a run that ends before the epoch's last window, and
    accumulation 1 train; a stream (whose last window is unknown) is refused with accumulation."""
    from accel_train import ConfigError

    def prepared(batches_per_epoch: int | None, **flags) -> None:
        prepared_under_deepspeed(zero3_json(), batches_per_epoch, **flags)

    with pytest.raises(ConfigError, match=r"--gradient_accumulation_steps 5 under DeepSpeed: an epoch has 12 "
                                          r"micro-batches per process, so its last step has 2.*would weigh 2/5.*"
                                          r"--gradient_accumulation_steps 1, 2, 3, 4, 6 or 12"):
        prepared(12, gradient_accumulation_steps=5)
    with pytest.raises(ConfigError, match=r"--gradient_accumulation_steps 2 under DeepSpeed: the training set is a "
                                          r"stream.*--gradient_accumulation_steps 1"):
        prepared(None, gradient_accumulation_steps=2, max_steps=10)
    prepared(12, gradient_accumulation_steps=4)
    prepared(12, gradient_accumulation_steps=5, max_steps=2)  # ends before the epoch's short window
    prepared(7)
    prepared(None, max_steps=10)


def test_auto_find_batch_size_is_refused_under_fsdp_and_deepspeed(tmp_path):
    """--auto_find_batch_size probes the bare model, with the whole model and two optimizer slots per parameter on
    each process, before the engine shards them: it measures DDP's memory (a micro-batch that fits sharded is
    halved, or refused with wrong advice) and crashes on ZeRO-3's empty partitions. Refused when the accelerator is
    built, with nothing written, and by the probe itself for an Accelerator of one's own."""
    from accelerate.utils import DistributedType

    from accel_train import ConfigError
    from accel_train.core.batch_size import fit_micro_batch

    out = tmp_path / "run"
    for kind, name in (("DEEPSPEED", "DeepSpeed"), ("FSDP", "FSDP")):
        with pytest.raises(ConfigError, match=rf"--auto_find_batch_size under {name}: the probe runs the whole model"
                                              r".*set --per_device_train_batch_size and --gradient_accumulation_steps"):
            built_as(out, {}, kind=kind, auto_find_batch_size=True)
        assert not out.exists()
    engine = SimpleNamespace(distributed_type=DistributedType.FSDP)
    with pytest.raises(ConfigError, match="--auto_find_batch_size under FSDP"):
        fit_micro_batch(engine, torch.nn.Linear(4, 1), torch.utils.data.DataLoader(points(), batch_size=4), mean_loss,
                        TrainConfig(output_dir=str(out), auto_find_batch_size=True), None)


def test_a_deepspeed_checkpoint_resumed_on_another_number_of_processes_is_refused_before_it_is_loaded(
        tmp_path, monkeypatch):
    """ZeRO partitions the optimizer state by process, and DeepSpeed cannot load it on another number (it raises
    inside load_state, or misses a per-rank file): a resume on another world size is refused by name, before
    load_state is called; DDP and FSDP (DCP reshards) move between world sizes."""
    from accelerate.utils import DistributedType

    from accel_train import CheckpointError
    from accel_train.core import restore
    from accel_train.rundir.checkpoint import MANIFEST

    path = tmp_path / "checkpoints" / "step-00000006"
    path.mkdir(parents=True)
    (path / MANIFEST).write_text(json.dumps({"format": 1, "step": 6, "world_size": 2, "files": {}, "shapes": {}}))
    monkeypatch.setattr(restore, "load_saved_state", lambda *_: pytest.fail("load_state was called"))
    session = SimpleNamespace(accelerator=SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=1),
                              config=TrainConfig(output_dir=str(tmp_path), report_to=["none"]), plan=None,
                              resume_path=path, shapes={})
    with pytest.raises(CheckpointError, match=r"step-00000006 was written by DeepSpeed on 2 process\(es\), this run "
                                              r"has 1: ZeRO partitions the optimizer state by process.*Resume on 2 "
                                              r"processes"):
        restore.resume(session)


def test_zero3_partitioned_parameters_are_read_at_their_full_shape_and_size():
    """Under ZeRO-3 (zero3_init_flag) a model built after the accelerator holds empty partitions, their full shape and
    size in `ds_shape` / `ds_numel`: the checkpoints' architecture fingerprint (which a resume with another model is
    refused by) and the run info's parameter count read those, not the empty tensors ([0] and 0 before)."""
    from accelerate import Accelerator

    from accel_train.observe.observer import Observer
    from accel_train.rundir.checkpoint import parameter_shapes

    model = torch.nn.Linear(4, 3)
    for p in model.parameters():  # as deepspeed.zero.Init leaves them on a process
        p.ds_shape, p.ds_numel, p.data = p.shape, p.numel(), torch.empty(0)
    model.bias.requires_grad_(False)
    assert parameter_shapes(model) == {"weight": [3, 4], "bias": [3]}
    config = TrainConfig(output_dir="x", report_to=["none"])
    observer = SimpleNamespace(accelerator=Accelerator(cpu=True), model=model, preflight=None,
                               session=SimpleNamespace(plan=make_plan(config, 4, 1), train_loader=None))
    assert Observer.run_info(observer, SimpleNamespace(step=0))["model"] == {"class": "Linear", "parameters": 15,
                                                                              "trainable": 12}


def test_explicit_deepspeed_json_values_that_contradict_a_given_flag_are_refused_and_others_said():
    """DeepSpeed runs the values its JSON sets explicitly (accel_train fills only "auto"), so a JSON gradient_clipping
    of 1.0 beside --max_grad_norm 0.5 clipped at 1.0 while the report said 0.5. A flag the user gave that the JSON
    contradicts is refused before prepare, naming both; an explicit value beside a flag left at its default runs,
    and the start-up report says so."""
    from accel_train import ConfigError
    from accel_train.core.sharded import engine_notes

    clipped = zero3_json(gradient_clipping=1.0)
    with pytest.raises(ConfigError, match=r"--max_grad_norm 0.5, but the DeepSpeed JSON config sets "
                                          r"\"gradient_clipping\": 1.0, which DeepSpeed would run instead.*"
                                          r"Set \"gradient_clipping\" to \"auto\" in the JSON"):
        prepared_under_deepspeed(clipped, given=("max_grad_norm",), max_grad_norm=0.5)
    optimizer = zero3_json()["optimizer"]
    optimizer["params"] = {**optimizer["params"], "lr": 1e-4, "eps": 1e-6}
    with pytest.raises(ConfigError, match=r"--learning_rate 0.003, but the DeepSpeed JSON config sets "
                                          r"\"optimizer.params.lr\": 0.0001"):
        prepared_under_deepspeed(zero3_json(optimizer=optimizer), given=("learning_rate",), learning_rate=3e-3)
    prepared_under_deepspeed(clipped, given=("max_grad_norm",), max_grad_norm=1.0)  # the same value
    engine = prepared_under_deepspeed(zero3_json(optimizer=optimizer, gradient_clipping=0.5), learning_rate=3e-3)
    notes = [n for n in engine_notes(engine) if "explicitly" in n]
    assert notes == ['the DeepSpeed JSON config sets "optimizer.params.lr": 0.0001, "optimizer.params.eps": 1e-06, '
                     '"gradient_clipping": 0.5 explicitly: DeepSpeed runs them, not --learning_rate, --adam_epsilon, '
                     '--max_grad_norm at their defaults (set them to "auto" in the JSON to take the flags)']


def with_betas(betas: list[float]) -> dict:
    optimizer = zero3_json()["optimizer"]
    optimizer["params"] = {**optimizer["params"], "betas": betas}
    return zero3_json(optimizer=optimizer)


def test_explicit_deepspeed_betas_are_compared_with_each_given_flag_on_its_own_element():
    """"optimizer.params.betas" stands for two flags, one per element: a given --adam_beta1 equal to the JSON's first
    beta runs (refused before: the pair was compared whole, --adam_beta2 at its default included), a given flag that
    differs from its own element is refused, and the start-up note names only the flags whose elements the JSON
    replaces (it named --adam_beta1 for any betas)."""
    from accel_train import ConfigError
    from accel_train.core.sharded import engine_notes

    def explicit_notes(engine) -> list[str]:
        return [n for n in engine_notes(engine) if "explicitly" in n]

    engine = prepared_under_deepspeed(with_betas([0.8, 0.99]), given=("adam_beta1",), adam_beta1=0.8)
    assert explicit_notes(engine) == [
        'the DeepSpeed JSON config sets "optimizer.params.betas": [0.8, 0.99] explicitly: DeepSpeed runs them, not '
        '--adam_beta2 at their defaults (set them to "auto" in the JSON to take the flags)']
    both = ("adam_beta1", "adam_beta2")
    assert explicit_notes(prepared_under_deepspeed(with_betas([0.8, 0.99]), given=both, adam_beta1=0.8,
                                                   adam_beta2=0.99)) == []
    with pytest.raises(ConfigError, match=r"--adam_beta2 0.95, but the DeepSpeed JSON config sets "
                                          r"\"optimizer.params.betas\": \[0.8, 0.99\]"):
        prepared_under_deepspeed(with_betas([0.8, 0.99]), given=both, adam_beta1=0.8, adam_beta2=0.95)
    with pytest.raises(ConfigError, match=r"--adam_beta1 0.7, but the DeepSpeed JSON config sets "
                                          r"\"optimizer.params.betas\": \[0.8, 0.99\]"):
        prepared_under_deepspeed(with_betas([0.8, 0.99]), given=("adam_beta1",), adam_beta1=0.7)
    assert "not --adam_beta2 at their defaults" in explicit_notes(prepared_under_deepspeed(with_betas([0.9, 0.99])))[0]


def ds_optimizer(engine, config: TrainConfig):
    """The prepared optimizer as the record reads it under DeepSpeed: Accelerate's wrapper, which carries its state
    (AcceleratedOptimizer.accelerator_state), around the torch optimizer DeepSpeed built."""
    from accelerate.utils import DistributedType

    wrapper = type("DeepSpeedOptimizerWrapper", (), {})()
    wrapper.optimizer = torch.optim.AdamW(torch.nn.Linear(2, 1).parameters(), lr=config.learning_rate)
    wrapper.accelerator_state = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED,
                                                deepspeed_plugin=engine.state.deepspeed_plugin)
    return wrapper


def test_zero3_without_the_gather_key_is_filled_and_an_explicit_false_refused_before_training(tmp_path):
    """ZeRO-3 saves the final model by gathering its shards, which DeepSpeed does only with
    "stage3_gather_16bit_weights_on_model_save" true; its default (and `accelerate config`'s) is false, and
    Accelerate fills nothing, so a JSON without the key trained the whole run and failed in the final save ("Cannot
    get 16bit model weights"). Left out or "auto": set true before prepare and said in the start-up report; an
    explicit false: refused when the accelerator is built, nothing written; ZeRO-2 (nothing to gather) is left as is."""
    from accel_train import ConfigError
    from accel_train.core.sharded import engine_notes

    key = "stage3_gather_16bit_weights_on_model_save"
    for value in (None, "auto"):
        zero = {k: v for k, v in zero3_json()["zero_optimization"].items() if k != key}
        zero = zero if value is None else {**zero, key: value}
        engine = prepared_under_deepspeed(zero3_json(zero_optimization=zero))
        assert engine.state.deepspeed_plugin.deepspeed_config["zero_optimization"][key] is True
        assert any(f'"zero_optimization.{key}" unset' in note for note in engine_notes(engine))
    assert not any(key in note for note in engine_notes(prepared_under_deepspeed(zero3_json())))  # set true: no note
    zero2 = prepared_under_deepspeed(zero3_json(zero_optimization={"stage": 2})).state.deepspeed_plugin
    assert key not in zero2.deepspeed_config["zero_optimization"]
    refused = zero3_json(zero_optimization={**zero3_json()["zero_optimization"], key: False})
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=rf'"zero_optimization.{key}": false under ZeRO-3.*fail after training.*'
                                          r"Set it to true.*zero3_save_16bit_model: true"):
        built_as(out, refused)
    assert not out.exists()
    with pytest.raises(ConfigError, match="false under ZeRO-3"):
        prepared_under_deepspeed(refused)


def test_the_record_states_the_clipping_and_schedule_deepspeed_runs_where_its_json_sets_them():
    """A DeepSpeed engine clips at its config's "gradient_clipping" and steps from its JSON's rates: with a JSON that
    sets them explicitly beside flags at their defaults, what_ran (config.yaml) and the start-up report's clipping
    and schedule lines state the engine's values (they stated --max_grad_norm's 1.0 and --learning_rate's); a JSON
    without "gradient_clipping" is filled from --max_grad_norm (DeepSpeed clipped at its default, 1.0, beside a given
    --max_grad_norm 0.5), and a flag that runs is recorded as before."""
    from accel_train.core.objects import report_lines, what_ran

    def recorded(engine, **flags) -> tuple[dict, str]:
        config = TrainConfig(output_dir="x", **flags)
        ran = what_ran(ds_optimizer(engine, config), None, config, own_optimizer=False, own_scheduler=False)
        return ran["clipping"], report_lines(ran, config)[1][1]

    by_json = 'DeepSpeed\'s config ("gradient_clipping")'
    assert recorded(prepared_under_deepspeed(zero3_json(gradient_clipping=0.5))) == (
        {"max_grad_norm": 0.5, "set_by": by_json},
        f"  clipping         global grad norm clipped to 0.5 ({by_json}; --max_grad_norm 1 does not apply)")
    assert recorded(prepared_under_deepspeed(zero3_json(gradient_clipping=0.0))) == (
        {"max_grad_norm": None, "set_by": by_json},
        f"  clipping         none ({by_json}; --max_grad_norm 1 does not apply)")
    engine = prepared_under_deepspeed(zero3_json(gradient_clipping=None), given=("max_grad_norm",), max_grad_norm=0.5)
    assert engine.state.deepspeed_plugin.deepspeed_config["gradient_clipping"] == 0.5
    assert recorded(engine, max_grad_norm=0.5) == ({"max_grad_norm": 0.5},
                                                   "  clipping         global grad norm clipped to 0.5")
    assert recorded(prepared_under_deepspeed(zero3_json()))[0] == {"max_grad_norm": 1.0}  # "auto": the flag's

    from accel_train.core.deepspeed_json import json_schedule_line

    optimizer = zero3_json()["optimizer"]
    optimizer["params"] = {**optimizer["params"], "lr": 1e-4}
    config = TrainConfig(output_dir="x", warmup_steps=3)
    engine = prepared_under_deepspeed(zero3_json(optimizer=optimizer), warmup_steps=3)
    assert json_schedule_line(engine, config, make_plan(config, 12, 2)) == (
        'linear, peak lr 0.0001 (the DeepSpeed JSON config\'s "optimizer.params.lr"; --learning_rate does not apply), '
        "3 warmup step(s)")
    scheduler = {"type": "WarmupLR", "params": {"warmup_max_lr": 2e-3, "warmup_num_steps": "auto"}}
    engine = prepared_under_deepspeed(zero3_json(scheduler=scheduler), warmup_steps=3)
    assert json_schedule_line(engine, config, make_plan(config, 12, 2)) == (
        "DeepSpeed's WarmupLR (its JSON config's scheduler), peak lr 0.002, 3 warmup step(s)")
    assert json_schedule_line(prepared_under_deepspeed(zero3_json()), config, make_plan(config, 12, 2)) is None


def points(n: int = 16) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(4, generator=generator), "y": torch.randn((), generator=generator)} for _ in range(n)]


def sum_loss(model, batch):
    """A per-item sum and its count: the loop scales the step's gradients by the window's items (core/loss.py)."""
    errors = (model(batch["x"]).squeeze(-1) - batch["y"]) ** 2
    return {"loss_sum": errors, "num_items": torch.ones_like(errors)}


def mean_loss(model, batch):
    return sum_loss(model, batch)["loss_sum"].mean()


def test_deepspeed_refuses_a_sum_loss_before_anything_is_written(tmp_path, monkeypatch):
    """DeepSpeed steps inside backward, so a sum loss's gradients cannot be scaled by the window's item count: it is
    refused before the run directory is written, not at the first micro-batch after it. Accelerate runs DeepSpeed
    only on GPU-like devices; here a CPU accelerator reports DEEPSPEED from the moment `prepare` has returned (so that
    prepare itself stays plain), and the notes of a DeepSpeed JSON, which this run has none of, are left out."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from accel_train import ConfigError, train
    from accel_train.core import session

    prepare = Accelerator.prepare

    def prepare_then_deepspeed(self, *args, **kwargs):
        prepared = prepare(self, *args, **kwargs)
        monkeypatch.setattr(Accelerator, "distributed_type", property(lambda _: DistributedType.DEEPSPEED))
        return prepared

    monkeypatch.setattr(Accelerator, "prepare", prepare_then_deepspeed)
    monkeypatch.setattr(session, "engine_notes", lambda accelerator: [])
    out = tmp_path / "run"
    config = TrainConfig(output_dir=str(out), max_steps=2, per_device_train_batch_size=4, report_to=["none"],
                         disable_tqdm=True, run_report=False, preflight=False, eval_strategy="no", save_strategy="no")
    with pytest.raises(Exception) as refused:  # noqa: PT011 - which error, and when, is what is tested below
        train(torch.nn.Linear(4, 1), torch.utils.data.DataLoader(points(), batch_size=4), config=config,
              loss_fn=sum_loss)
    written = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert written == []  # the run started (config.yaml, metrics.jsonl, ...) before the first micro-batch refused it
    assert isinstance(refused.value, ConfigError) and "DeepSpeed steps inside backward" in str(refused.value)


def test_the_sum_loss_check_reads_one_batch_and_changes_nothing():
    import contextlib

    from accelerate.utils import DistributedType

    from accel_train import ConfigError
    from accel_train.core.sharded import refuse_sum_loss

    def engine(kind):
        return SimpleNamespace(distributed_type=kind, device=torch.device("cpu"), autocast=contextlib.nullcontext)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    loader = torch.utils.data.DataLoader(points(), batch_size=4, shuffle=True)
    calls = []

    def counted(loss_fn):
        def call(model, batch):
            calls.append((model.training, len(batch["x"])))
            return loss_fn(model, batch)
        return call

    with pytest.raises(ConfigError, match="returns sums"):
        refuse_sum_loss(engine(DistributedType.DEEPSPEED), model, counted(sum_loss), loader)
    rng = torch.get_rng_state()
    refuse_sum_loss(engine(DistributedType.DEEPSPEED), model, counted(mean_loss), loader)  # a mean trains
    assert calls == [(False, 4), (False, 4)]  # one batch, in evaluation mode
    assert model.training and torch.equal(torch.get_rng_state(), rng)  # the run's random numbers are untouched
    refuse_sum_loss(engine(DistributedType.MULTI_GPU), model, counted(sum_loss), loader)  # sums are exact with DDP
    assert len(calls) == 2


def test_preflight_simulates_a_deepspeed_json_schedule_as_the_engine_steps_it():
    """DeepSpeed's WarmupDecayLR trains its first two steps at warmup_min_lr and stops short of 0; the pre-flight
    shows that, not the config's schedule (a 2-process ZeRO-2 run logged exactly these rates)."""
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    from accel_train.observe.preflight.model_checks import simulate_schedule

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=3e-3)
    schedule = lr_schedules.WarmupDecayLR(optimizer, total_num_steps=12, warmup_min_lr=0, warmup_max_lr=3e-3,
                                          warmup_num_steps=2, warmup_type="linear")
    lrs = simulate_schedule(schedule, 12)[0]
    assert lrs[:5] == pytest.approx([0.0, 0.0, 0.0015, 0.003, 0.0027]) and lrs[12] == pytest.approx(0.0003)
    assert schedule.last_batch_iteration == -1  # simulated on a copy: the schedule itself has not moved


# ------------------------------------------------------------------------------ real launches on 2 gloo processes


def refused_on_cpu_ranks(args: list[str], env: dict[str, str]) -> None:
    """On each spawned gloo rank: the recipe with the launcher's FSDP request must be refused by name (ranks.run
    reports a rank whose function raises, so the refusal itself is what passes)."""
    with pytest.raises(LaunchError) as refused:
        nlp_main(args)
    message = str(refused.value)
    assert "FSDP was requested by the launcher (ACCELERATE_USE_FSDP), but this run would be MULTI_CPU" in message
    assert "(2 process(es)" in message and "only on GPU-like devices" in message and "cpu_multiprocess.yaml" in message
    assert os.environ["ACCELERATE_USE_FSDP"] == env["ACCELERATE_USE_FSDP"]


def test_presets_are_refused_on_cpu_instead_of_training_ddp(tiny_bert, data, tmp_path, ranks):
    """Without the shim, the fsdp preset on 2 CPU processes would be plain DDP: a LaunchError names why, on every
    rank, before any file is written. The two processes are the session's spawned gloo ranks, given what the preset
    makes the launcher export (ACCELERATE_USE_FSDP, FSDP_VERSION); the real launcher of the preset exporting it is
    what the sharded launches below prove (their start-up report names FSDP)."""
    from accelerate.commands.config.config_args import load_config_from_file

    preset = load_config_from_file(str(ACCELERATE_CONFIGS / "fsdp.yaml"))
    assert preset.distributed_type.value == "FSDP"
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": str(preset.fsdp_config["fsdp_version"])}
    out = tmp_path / "run"
    ranks.run(refused_on_cpu_ranks, recipe_args(tiny_bert, data, out), env, env=env, timeout=LAUNCH_TIMEOUT)
    assert not (out / "metrics.jsonl").exists() and not (out / "config.yaml").exists()


EXACT = ("step", "loss", "grad_norm", "learning_rate", "epoch")  # a metrics.jsonl row less its timings


def exact_rows(rows: list[dict], first: int, last: int) -> list[dict]:
    return [{k: v for k, v in r.items() if k in EXACT or k.startswith("eval_") and "runtime" not in k
             and "per_second" not in k} for r in rows if first <= r["step"] <= last]


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_sharded_backend_resumes_exactly_after_sigkill_equals_ddp_and_exports(backend, tiny_bert, data, tmp_path,
                                                                               ddp_references, extensions):
    """Two launches per back-end: the run SIGKILLed after step 11 (its newest checkpoint is step 6's), then resumed
    with `latest` to the end. The resumed run replays steps 7-10, which the killed one logged: their losses, gradient
    norms, learning rates and (FSDP2) the average's evaluation at step 8 are bitwise the same, and they follow from
    the restored parameters, Adam's moments, schedule, data position and average. The resumed run, whole, equals
    2-process DDP (parameters through the exported model, every step's learning rate, the evaluations). No DeepSpeed
    op was compiled for it (the shim sends DeepSpeed's collectives through torch.distributed, as on GPUs)."""
    preset, distributed_type, shards, tolerance, flags = BACKENDS[backend]
    if distributed_type == "DEEPSPEED" and not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed (the [test] extra installs it: DS_BUILD_OPS=0 pip install deepspeed)")
    ddp_reference = ddp_references(flags)
    run = tmp_path / "run"
    args = [*recipe_args(tiny_bert, data, run), *flags]

    # SIGKILL after step 11: steps 1-10 logged, checkpoints every 6 steps (and, with evaluations every 4 steps, the
    # best model's at step 4 kept beside them)
    killed = sharded_launch(preset, args, extensions, fault="kill_after_step:11")
    killed_output = killed.stdout + killed.stderr
    assert killed.returncode != 0 and f"world size       2 process(es), {distributed_type}, device cpu" in \
        killed_output, killed_output[-6000:]
    before_kill = read_jsonl(run / "metrics.jsonl")
    assert max(r["step"] for r in before_kill) == 10, killed_output[-3000:]
    average = "--ema_decay" in flags
    assert [p.name for p in list_checkpoints(run)] == [*(["step-00000004"] if average else []), "step-00000006"]
    assert ("AdamW (built from the config, fused kernel)" in killed_output) == (flags != LOOP), killed_output[-6000:]
    assert ("padded tokens per micro-batch" in killed_output) == (flags == LOOP)  # the token budget's plan ran
    if backend == "zero3":  # the preset's JSON names the optimizer: DeepSpeed builds it, told to fuse by --optim
        assert "the optimizer is DeepSpeed's AdamW, torch's fused kernel, from its JSON config" in killed_output
    verify_checkpoint(list_checkpoints(run)[-1])
    output = ok(sharded_launch(preset, [*args, "--resume_from_checkpoint", "latest"], extensions))
    assert f"world size       2 process(es), {distributed_type}, device cpu" in output
    assert "resumed from" in output and "step-00000006" in output
    assert json.loads((run / "all_results.json").read_text())["train_steps"] == 12

    # exact resume: the replayed steps as the killed run took them, bitwise
    after = read_jsonl(run / "metrics.jsonl")
    replayed = exact_rows(after, 7, 10)
    assert replayed == exact_rows(before_kill, 7, 10) and [r["step"] for r in replayed if "loss" in r] == [7, 8, 9, 10]
    assert all("grad_norm" in r and "learning_rate" in r for r in replayed if "loss" in r)
    assert exact_rows(after, 1, 6) == exact_rows(before_kill, 1, 6)  # the killed run's record up to the checkpoint
    assert [r["step"] for r in after if "loss" in r] == list(range(1, 13))  # each step once
    assert [r["step"] for r in replayed if "eval_ema_loss" in r] == ([8] if average else [])

    equals_ddp(after, run, ddp_reference, tolerance)
    checkpoint = list_checkpoints(run)[-1]
    assert checkpoint.name == "step-00000012"
    sharded_and_listed(checkpoint, shards, average=average)
    assert list(extensions.iterdir()) == []  # nothing compiled


def equals_ddp(after: list[dict], run: Path, ddp_reference: Path, tolerance: float) -> None:
    """The resumed run, whole, against 2-process DDP: the parameters through the exported model, each step's
    learning rate, and the average's evaluations where there is one."""
    model = exported(run)
    assert max_diff(model, exported(ddp_reference)) <= tolerance
    assert set(model) >= set(load_file(ddp_reference / "model.safetensors"))
    ddp = read_jsonl(ddp_reference / "metrics.jsonl")
    lr_run, lr_ddp = ([(r["step"], r["learning_rate"]) for r in rows if "learning_rate" in r] for rows in (after, ddp))
    assert [s for s, _ in lr_run] == [s for s, _ in lr_ddp] == list(range(1, 13))  # the schedule spans the run
    assert [lr for _, lr in lr_run] == pytest.approx([lr for _, lr in lr_ddp], abs=1e-12)
    evals = [[(r["step"], r["eval_ema_loss"], r["eval_loss"]) for r in rows if "eval_ema_loss" in r]
             for rows in (after, ddp)]
    assert evals[0] == [(s, pytest.approx(a, abs=1e-7), pytest.approx(b, abs=1e-7)) for s, a, b in evals[1]]
    assert all(abs(a - b) > 1e-6 for _, a, b in evals[0]), "the average is not the live weights"


def sharded_and_listed(checkpoint: Path, shards: str, average: bool) -> None:
    """One shard per process (and of the average, when the run keeps one), every file in the manifest."""
    sharded = sorted(checkpoint.glob(shards))
    assert len(sharded) == 2, sorted(p.name for p in checkpoint.rglob("*"))
    files = read_manifest(checkpoint)["files"]
    assert {str(p.relative_to(checkpoint)) for p in sharded} <= set(files)
    verify_checkpoint(checkpoint)
    if average:
        assert {f"weight_average_rank{r}.safetensors" for r in (0, 1)} <= set(files)


def test_an_explicit_deepspeed_weight_decay_that_the_param_groups_override_is_refused():
    """Accelerate gives DeepSpeed accel_train's param groups, each carrying its weight decay (--weight_decay, 0.0 for
    biases and norms), and a group's own value wins over the JSON's optimizer params: a JSON "weight_decay": 0.01
    beside --weight_decay left at 0.0 trained with 0.0 while the start-up note said DeepSpeed ran 0.01. Refused with
    what to do; the JSON's value equal to the flag's runs."""
    from accel_train import ConfigError

    optimizer = zero3_json()["optimizer"]
    optimizer["params"] = {**optimizer["params"], "weight_decay": 0.01}
    with pytest.raises(ConfigError, match=r"sets \"optimizer.params.weight_decay\": 0.01, which would not run: "
                                          r"accel_train's param groups carry --weight_decay \(0.0;.*give "
                                          r"--weight_decay 0.01"):
        prepared_under_deepspeed(zero3_json(optimizer=optimizer))
    prepared_under_deepspeed(zero3_json(optimizer=optimizer), given=("weight_decay",), weight_decay=0.01)


def test_an_explicit_deepspeed_micro_batch_other_than_the_loaders_is_refused():
    """DeepSpeed never batches the data here: each process trains the prepared loader's batches of
    --per_device_train_batch_size, and the JSON's "train_micro_batch_size_per_gpu" only sizes DeepSpeed's sample
    counts (train_batch_size = micro x accumulation x processes, its throughput). A JSON micro-batch of 4 beside the
    flag's 8 trained 8 while the start-up note said DeepSpeed ran 4: refused whether the flag was given or not."""
    from accel_train import ConfigError
    from accel_train.core.sharded import engine_notes

    with pytest.raises(ConfigError, match=r"sets \"train_micro_batch_size_per_gpu\": 4, which would not run: each "
                                          r"process trains the loader's batches of --per_device_train_batch_size "
                                          r"\(8\).*give --per_device_train_batch_size 4"):
        prepared_under_deepspeed(zero3_json(train_micro_batch_size_per_gpu=4))
    engine = prepared_under_deepspeed(zero3_json(train_micro_batch_size_per_gpu=4), per_device_train_batch_size=4)
    assert not [note for note in engine_notes(engine) if "explicitly" in note]


def test_a_given_scale_lr_beside_an_explicit_deepspeed_json_rate_is_refused():
    """--scale_lr scales the peak rate with the global batch: filled into the JSON's "auto" rates, but an explicit
    optimizer "lr" (or scheduler "warmup_max_lr") ran unscaled beside a given --scale_lr, which the check did not
    compare (it stood for --learning_rate only). Refused as a given --learning_rate is; --scale_lr none asks for
    nothing, and the scaled value in the JSON runs."""
    from accel_train import ConfigError

    optimizer = zero3_json()["optimizer"]
    optimizer["params"] = {**optimizer["params"], "lr": 1e-4}
    with pytest.raises(ConfigError, match=r"--scale_lr linear, but the DeepSpeed JSON config sets "
                                          r"\"optimizer.params.lr\": 0.0001, which DeepSpeed would run instead"):
        prepared_under_deepspeed(zero3_json(optimizer=optimizer), given=("scale_lr",), scale_lr="linear")
    scheduler = {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-4}}
    with pytest.raises(ConfigError, match=r"--scale_lr sqrt, but .* \"scheduler.params.warmup_max_lr\": 0.0001"):
        prepared_under_deepspeed(zero3_json(scheduler=scheduler), given=("scale_lr",), scale_lr="sqrt")
    prepared_under_deepspeed(zero3_json(optimizer=optimizer), given=("scale_lr",), scale_lr="none")
    optimizer["params"]["lr"] = 5e-5 * 16 / 256  # 8 per device x 2 processes against the reference batch of 256
    prepared_under_deepspeed(zero3_json(optimizer=optimizer), given=("scale_lr",), scale_lr="linear")


def filled_json(section: str, type_: str, params: dict | None = None, given: tuple[str, ...] = (), **flags) -> dict:
    """The preset's JSON with `section` ("optimizer" or "scheduler") of `type_` and `params` (None: no "params"),
    as prepare_engine leaves it for a run of `flags`."""
    part = {"type": type_, **({"params": params} if params is not None else {})}
    engine = prepared_under_deepspeed(zero3_json(**{section: part}), given=given, **flags)
    return engine.state.deepspeed_plugin.deepspeed_config[section]


def test_deepspeed_json_params_left_out_are_filled_from_the_flags_where_the_type_takes_them():
    """A DeepSpeed JSON's optimizer or scheduler without a param DeepSpeed builds it with ran DeepSpeed's (or torch's)
    default whatever the flags said: an AdamW without "betas" beside --adam_beta1 0.8 ran (0.9, 0.999), a WarmupLR
    without "warmup_num_steps" warmed up over 1000 steps beside --warmup_steps 3, a WarmupDecayLR without
    "warmup_max_lr" peaked at 0.001 beside --learning_rate 3e-3. Where the type takes the param it is filled as "auto"
    is (and returned as filled); WarmupLR's peak is left out, its default being each group's own rate."""
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    adamw = filled_json("optimizer", "AdamW", {"lr": "auto", "torch_adam": True}, given=("adam_beta1", "adam_epsilon"),
                        adam_beta1=0.8, adam_epsilon=1e-6)
    assert adamw["params"] == {"lr": 5e-5, "betas": [0.8, 0.999], "eps": 1e-6, "torch_adam": True}
    assert filled_json("optimizer", "SGD", {}, given=("sgd_momentum",), sgd_momentum=0.5)["params"] == {
        "lr": 5e-5, "momentum": 0.5}
    assert filled_json("optimizer", "Lamb", None)["params"] == {"lr": 5e-5}  # every optimizer takes a rate
    warmup = filled_json("scheduler", "WarmupLR", None, given=("warmup_steps",), warmup_steps=3)
    assert warmup["params"] == {"warmup_num_steps": 3}
    decay = filled_json("scheduler", "WarmupDecayLR", {"warmup_type": "linear"}, given=("learning_rate",),
                        learning_rate=3e-3)
    assert decay["params"] == {"warmup_type": "linear", "warmup_max_lr": 3e-3, "warmup_num_steps": 1,
                               "total_num_steps": 36}
    cosine = filled_json("scheduler", "WarmupCosineLR", {}, warmup_steps=3)
    assert cosine["params"] == {"warmup_num_steps": 3, "total_num_steps": 36}
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=3e-3)  # as DeepSpeed builds them
    assert lr_schedules.WarmupLR(optimizer, **warmup["params"]).warmup_num_steps == 3
    assert lr_schedules.WarmupDecayLR(optimizer, **decay["params"]).max_lrs == [3e-3]

    config = TrainConfig(output_dir="x", adam_beta2=0.98)
    plugin = SimpleNamespace(hf_ds_config=HfDeepSpeedConfig({"optimizer": {"type": "Adam"}}))
    assert fill_deepspeed_config(plugin, config, make_plan(config, 12, 2)) == {
        "optimizer.params.lr": 5e-5, "optimizer.params.betas": [0.9, 0.98], "optimizer.params.eps": 1e-8,
        "gradient_clipping": 1.0}


def test_a_given_flag_that_a_deepspeed_json_type_would_not_take_is_refused():
    """Where accel_train does not fill a param the JSON leaves out, a flag the user gave for it would not run: an
    optimizer other than Adam, AdamW or SGD (whose params accel_train cannot name) without "betas" beside --adam_beta1,
    a scheduler that has no warmup to fill beside --warmup_steps, one that sets every rate from its own params beside
    --learning_rate. Refused before anything is built, naming the flag and what to do; the flags left at their
    defaults, or asking for nothing, run."""
    from accel_train import ConfigError

    with pytest.raises(ConfigError, match=r"--adam_beta1 0.8, but the DeepSpeed JSON config's optimizer, Lamb, has "
                                          r"no \"betas\".*Set \"betas\" in its params \(\"auto\" takes the flag's "
                                          r"value\)"):
        filled_json("optimizer", "Lamb", {"lr": "auto"}, given=("adam_beta1",), adam_beta1=0.8)
    filled_json("optimizer", "Lamb", {"lr": "auto", "betas": "auto"}, given=("adam_beta1",), adam_beta1=0.8)
    filled_json("optimizer", "AdamW", {}, given=("sgd_momentum",), sgd_momentum=0.5)  # SGD's flag: not for AdamW
    one_cycle = {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3}
    with pytest.raises(ConfigError, match=r"--warmup_steps 3, but the DeepSpeed JSON config's scheduler, OneCycle, "
                                          r"has no warmup accel_train can set.*or drop --warmup_steps"):
        filled_json("scheduler", "OneCycle", one_cycle, given=("warmup_steps",), warmup_steps=3)
    with pytest.raises(ConfigError, match=r"--learning_rate 0.003, but the DeepSpeed JSON config's scheduler, "
                                          r"OneCycle, sets every rate from its own params"):
        filled_json("scheduler", "OneCycle", one_cycle, given=("learning_rate",), learning_rate=3e-3)
    with pytest.raises(ConfigError, match=r"--warmup_ratio 0.1, but .* scheduler, StepLR, has no warmup"):
        filled_json("scheduler", "StepLR", {"step_size": 4}, given=("warmup_ratio",), warmup_ratio=0.1)
    filled_json("scheduler", "StepLR", {"step_size": 4}, given=("warmup_steps", "learning_rate"), warmup_steps=0,
                learning_rate=3e-3)  # no warmup asked for; StepLR multiplies the optimizer's rate
    assert filled_json("scheduler", "OneCycle", one_cycle)["params"] == one_cycle  # the flags at their defaults


def test_the_record_states_a_deepspeed_json_scheduler_and_its_peak_rate():
    """DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR set every group's rate to the warmup's start (0) when
    they are built and keep no `initial_lr`: what_ran recorded lr 0 and "built: --lr_scheduler_type linear" though the
    JSON's scheduler ran. The record names the JSON's scheduler and each group's peak, as the scheduler holds it."""
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    from accel_train.core.objects import report_lines, what_ran

    config = TrainConfig(output_dir="x")
    for scheduler, peak in (({"type": "WarmupLR", "params": {"warmup_max_lr": 2e-3}}, 2e-3),
                            ({"type": "WarmupCosineLR", "params": {}}, 5e-5)):
        engine = prepared_under_deepspeed(zero3_json(scheduler=scheduler))
        optimizer = ds_optimizer(engine, config)
        params = engine.state.deepspeed_plugin.deepspeed_config["scheduler"]["params"]
        wrapper = type("DeepSpeedSchedulerWrapper", (), {})()
        wrapper.scheduler = getattr(lr_schedules, scheduler["type"])(optimizer.optimizer, **params)
        assert optimizer.optimizer.param_groups[0]["lr"] == 0.0  # as DeepSpeed leaves it before the first step
        ran = what_ran(optimizer, wrapper, config, own_optimizer=False, own_scheduler=False)
        assert ran["scheduler"] == {"class": scheduler["type"], "stepped": "each optimizer step",
                                    "given": "DeepSpeed's JSON config (\"scheduler\"; --lr_scheduler_type does not "
                                             "apply)"}
        assert ran["optimizer"]["groups"] == [{"lr": peak, "weight_decay": 0.01}]  # torch's AdamW default decay
        assert report_lines(ran, config)[1][0] == (f"  optimizer        AdamW (built from the config): lr {peak:g}, "
                                                   "weight decay 0.01")
