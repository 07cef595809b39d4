"""Speed features keep the run the same: automatic batch size, gradient checkpointing, torch.compile, TF32."""

import json

import pytest
import toy_train
from conftest import printed_per_rank, printing_fresh_dynamo, read_jsonl, reset_accelerate, toy_main, toy_on
from safetensors import safe_open
from safetensors.torch import load_file

from accel_train import ConfigError, run_cli
from accel_train.rundir.checkpoint import list_checkpoints

QUIET = ["--report_to", "none", "--disable_tqdm", "--num_train_epochs", "2", "--logging_steps", "1",
         "--eval_strategy", "no", "--save_strategy", "no", "--dropout", "0.2", "--learning_rate", "0.05"]


def run_toy(out, *args):
    reset_accelerate()
    toy_train.main(["--output_dir", str(out), *QUIET, *args])
    return load_file(out / "model.safetensors")


def test_auto_batch_size_keeps_the_global_batch_and_schedule(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ACCEL_TRAIN_FAULT", "oom_above:2")
    auto = run_toy(tmp_path / "auto", "--per_device_train_batch_size", "8", "--auto_find_batch_size")
    assert "auto batch size: micro-batch 8 -> 2" in capsys.readouterr().out
    monkeypatch.delenv("ACCEL_TRAIN_FAULT")
    explicit = run_toy(tmp_path / "explicit", "--per_device_train_batch_size", "2",
                       "--gradient_accumulation_steps", "4")
    run_toy(tmp_path / "big", "--per_device_train_batch_size", "8")
    assert all((auto[k] == explicit[k]).all() for k in auto)  # the same run as asking for 2 x 4 directly
    lr = {name: [(r["step"], r["learning_rate"]) for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "loss" in r]
          for name in ("auto", "big")}
    assert lr["auto"] == lr["big"] and len(lr["auto"]) == 24  # same steps, same schedule as batch 8


def test_auto_batch_size_gives_up_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ACCEL_TRAIN_FAULT", "oom_above:0")
    reset_accelerate()
    with pytest.raises(SystemExit):
        run_cli(toy_train.main, ["--output_dir", str(tmp_path), *QUIET, "--auto_find_batch_size"])
    assert "even the smallest micro-batch" in capsys.readouterr().err


def test_auto_batch_size_refuses_a_batch_sampler_of_yours_and_keeps_the_loaders_settings(tmp_path):
    """A smaller micro-batch rebuilt the loader from its dataset and sampler: a batch_sampler of one's own was dropped
    (the run trained in another order, without a word), and so were the loader's timeout, prefetch factor,
    multiprocessing context and pin-memory device."""
    import torch
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

    from accel_train import TrainConfig, train
    from accel_train.core.batch_size import with_micro_batch

    data = TensorDataset(torch.randn(16, 2), torch.randn(16, 1))
    config = TrainConfig(output_dir=str(tmp_path), report_to=["none"], disable_tqdm=True, run_report=False,
                         per_device_train_batch_size=4, auto_find_batch_size=True, max_steps=1, save_strategy="no")
    reset_accelerate()
    with pytest.raises(ConfigError, match=r"batched by a batch_sampler of your own \(BatchSampler\)"):
        train(torch.nn.Linear(2, 1), DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 4, False)),
              config=config, loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=1, timeout=30, prefetch_factor=3,
                        multiprocessing_context="spawn")
    derived, rebuilt = with_micro_batch(config, loader, 2)
    assert (rebuilt.batch_size, derived.gradient_accumulation_steps, rebuilt.sampler) == (2, 2, loader.sampler)
    assert (rebuilt.timeout, rebuilt.prefetch_factor, rebuilt.multiprocessing_context) == (
        30, 3, loader.multiprocessing_context)


def test_the_batch_size_probe_leaves_the_models_running_statistics_as_they_were():
    """The probe runs forward and backward in training mode before step 0: a BatchNorm's running mean, variance and
    batch count moved with each probed size, so the run started from other statistics than without the flag."""
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    from accel_train import TrainConfig
    from accel_train.core.batch_size import find_micro_batch

    reset_accelerate()
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    data = TensorDataset(torch.randn(16, 3) * 5 + 2, torch.randn(16, 1))
    size = find_micro_batch(Accelerator(cpu=True), model, DataLoader(data, batch_size=8),
                            lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                            TrainConfig(per_device_train_batch_size=8, report_to=["none"]),
                            torch.optim.AdamW(model.parameters()))
    assert size == 8
    assert all(torch.equal(before[name], buffer) for name, buffer in model.named_buffers())


def test_gradient_checkpointing_changes_memory_not_results(tiny_bert, sst_like, tmp_path, capsys):

    import nlp_finetune

    results = {}
    for value in ("true", "false"):
        out = tmp_path / value
        reset_accelerate()
        nlp_finetune.main(["--model_name_or_path", str(tiny_bert), "--train_file", str(sst_like["train"]),
                           "--output_dir", str(out), "--report_to", "none", "--disable_tqdm", "--max_steps", "6",
                           "--max_seq_length", "32", "--eval_strategy", "no", "--save_strategy", "no",
                           "--load_best_model_at_end", "false", "--gradient_checkpointing", value])
        results[value] = json.loads((out / "all_results.json").read_text())
        assert f"gradient checkpointing {'on' if value == 'true' else 'off'}" in capsys.readouterr().out
        # the MFU's input: model FLOPs per real token (model FLOP/s over tokens/s on one process)
        logged = [r for r in read_jsonl(out / "metrics.jsonl") if "model_tflops" in r]
        results[value]["flops_per_token"] = [r["model_tflops"] * 1e12 / r["tokens_per_second"] for r in logged]
    assert results["true"]["train_loss"] == pytest.approx(results["false"]["train_loss"], abs=1e-5)
    # the forward that checkpointing recomputes is hardware work, not model work: the same FLOPs per token
    assert results["true"]["flops_per_token"] == pytest.approx(results["false"]["flops_per_token"], rel=1e-9)
    assert results["true"]["flops_per_token"]


def test_gradient_checkpointing_needs_a_model_that_supports_it(tmp_path):
    reset_accelerate()
    with pytest.raises(ConfigError, match="no gradient_checkpointing_enable"):
        toy_train.main(["--output_dir", str(tmp_path), *QUIET, "--gradient_checkpointing"])


def test_tf32_needs_an_ampere_gpu(tmp_path):
    reset_accelerate()
    with pytest.raises(ConfigError, match="--tf32 true needs an Ampere"):
        toy_train.main(["--output_dir", str(tmp_path), *QUIET, "--tf32", "true"])


@pytest.mark.slow
def test_torch_compile_leaks_no_prefix_and_resumes(tmp_path):
    """In this process: compiled, cut at step 7 (inside the first epoch of 12 steps; checkpoints every 5; logging
    every step, where --stop_at_step acts) and resumed with latest, against the eager run. Dynamo's caches are
    process-wide: they are reset before and after, so that another test's compiles (its recompilation limit) cannot
    leave this one eager."""
    import torch._dynamo

    common = ["--report_to", "none", "--disable_tqdm", "--num_train_epochs", "2", "--save_strategy", "steps",
              "--save_steps", "5", "--eval_strategy", "no", "--logging_steps", "1", "--torch_compile"]
    torch._dynamo.reset()
    try:
        toy_main([*common, "--output_dir", str(tmp_path / "c"), "--stop_at_step", "7"])
        assert list_checkpoints(tmp_path / "c")[-1].name == "step-00000007"
        toy_main([*common, "--output_dir", str(tmp_path / "c"), "--resume_from_checkpoint", "latest"])
    finally:
        torch._dynamo.reset()
    saved = [*(p / "model.safetensors" for p in list_checkpoints(tmp_path / "c")), tmp_path / "c" / "model.safetensors"]
    for path in saved:
        keys = list(safe_open(str(path), "pt").keys())
        assert keys and not any("_orig_mod" in k or k.startswith("module.") for k in keys), (path, keys)
    toy_main([*common[:-1], "--output_dir", str(tmp_path / "eager")])
    a, b = load_file(tmp_path / "c" / "model.safetensors"), load_file(tmp_path / "eager" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4  # compiled kernels round differently


def test_a_compile_that_compiles_nothing_is_said_at_the_first_log(tmp_path, ranks):
    """On 2 processes Accelerate compiles the DDP wrapper, and dynamo compiles nothing of a bare nn.Sequential
    (pytorch/pytorch#140416): the run trained eager while its start-up report said compile, and only the finish's
    count (0 graphs) showed it. The first log two training steps in (the first micro-batch runs eager: the FLOP count)
    says so, with what to do; the same toy in a model class of its own compiles and has no such line."""
    compile_flags = [*QUIET, "--max_steps", "3", "--eval_strategy", "no", "--save_strategy", "no", "--torch_compile",
                     "true", "--torch_compile_backend", "aot_eager"]
    printed = {}
    for name, extra in (("bare", []), ("own", ["--own_module", "true"])):
        out = tmp_path / name
        ranks.run(printing_fresh_dynamo, toy_main, [*compile_flags, *extra, "--output_dir", str(out)])
        printed[name] = printed_per_rank(out)[0]
        graphs = json.loads((out / "all_results.json").read_text())["train_compiled_graphs"]
        assert (graphs == 0) == (name == "bare"), (name, graphs)
    assert "torch.compile: no graph compiled in 2 training step(s): the model trains uncompiled" in printed["bare"]
    assert "a bare nn.Sequential: pytorch/pytorch#140416" in printed["bare"]
    assert "no graph compiled" not in printed["own"]


def test_auto_batch_size_agrees_across_processes(tmp_path, ranks):
    """On the session's two gloo ranks; only rank 1 runs out of memory above 2: both ranks must use 2, with
    accumulation 4."""
    args = [*QUIET, "--dropout", "0", "--per_device_train_batch_size", "8", "--auto_find_batch_size"]
    ranks.run(toy_main, [*args, "--output_dir", str(tmp_path / "auto")], env={"ACCEL_TRAIN_FAULT": "oom_above:2@1"})
    toy_on(ranks, [*QUIET, "--dropout", "0", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4",
                   "--output_dir", str(tmp_path / "explicit")], 2)
    a, b = load_file(tmp_path / "auto" / "model.safetensors"), load_file(tmp_path / "explicit" / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a)


def test_mfu_counts_forward_and_backward_flops(tmp_path):
    """6 x in x out FLOPs per sample for a Linear layer (2 forward, 4 backward); MFU = that x samples/s / peak."""
    import torch
    from accelerate import Accelerator

    from accel_train.core.meter import FlopCount

    flops = FlopCount(Accelerator(cpu=True))
    assert flops.peak > 1e9  # a CPU's measured fp32 matmul peak (well above 1 GFLOP/s)
    flops.peak = 1e9  # pretend a device with a 1 GFLOP/s peak (a peak is known: the first batch is counted)
    layer = torch.nn.Linear(16, 8, bias=False)
    with flops.measure(batch_samples=4):
        layer(torch.randn(4, 16, requires_grad=True)).sum().backward()
    with flops.measure(batch_samples=4):  # counts only once
        layer(torch.randn(4, 16)).sum().backward()
    assert flops.mfu(samples_per_second=1000) == pytest.approx(6 * 16 * 8 * 1000 / 1e9)
    # text: FLOPs per token position of the counted batch x the REAL tokens per second (padding is not model work)
    text = FlopCount(Accelerator(cpu=True))
    text.peak = 1e9
    with text.measure(batch_samples=2, batch_positions=8):  # 2 rows x 4 positions, whatever their padding
        layer(torch.randn(2, 4, 16, requires_grad=True)).sum().backward()
    assert text.model_flops(samples_per_second=10, tokens_per_second=30) == pytest.approx(6 * 16 * 8 * 30)


def test_the_matmul_peak_is_measured_per_precision_once_and_cached(tmp_path, monkeypatch):
    """Measured per precision and thread count, once per process: a second call reads the file (which another
    process may have raised) and times nothing (core/test_peak.py: the cache is only ever raised)."""
    import json

    import torch

    from accel_train.core import peak

    monkeypatch.setenv("ACCEL_TRAIN_CACHE", str(tmp_path))
    fp32 = peak.measured_peak(torch.device("cpu"), "fp32", side=256)
    bf16 = peak.measured_peak(torch.device("cpu"), "bf16", side=256)
    cached = json.loads((tmp_path / "matmul_peak.json").read_text())
    assert sorted(v for v in cached.values()) == sorted([fp32, bf16]) and fp32 > 1e8 and bf16 > 1e8
    assert all(f"{torch.get_num_threads()} threads" in key for key in cached)
    cached = {k: 1e15 for k in cached}  # raised by another process: a second call reads the file
    (tmp_path / "matmul_peak.json").write_text(json.dumps(cached))
    monkeypatch.setattr(peak, "time_matmul", None)  # and does not time again (calling None would raise)
    assert peak.measured_peak(torch.device("cpu"), "fp32", side=256) == 1e15


def test_a_cpu_run_reports_its_mfu_against_the_measured_peak(tmp_path, capsys):
    import toy_train

    from accel_train.core.peak import measured_peak

    reset_accelerate()
    toy_train.main(["--output_dir", str(tmp_path), *QUIET, "--max_steps", "4", "--logging_steps", "2",
                             "--per_device_train_batch_size", "8"])
    import torch

    peak = measured_peak(torch.device("cpu"), "fp32")
    assert f"  mfu peak         {peak / 1e12:.3g} TFLOP/s, the measured fp32 matmul peak of this cpu" \
           in capsys.readouterr().out  # the start-up report
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    metrics = json.loads((tmp_path / "all_results.json").read_text())
    assert all(0 < r["mfu"] < 1 and r["model_tflops"] > 0 for r in records)
    assert metrics["train_peak_tflops"] == pytest.approx(measured_peak(torch.device("cpu"), "fp32") / 1e12, rel=1e-3)
    assert metrics["train_mfu"] == pytest.approx(sum(r["mfu"] for r in records) / len(records), rel=1e-3)


def tiny_bert_classifier():
    """Every weight trainable: its backward is exactly twice its forward (each matmul's input and weight grads)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64,
                                                    max_position_embeddings=32)).train()


def test_mfu_counts_model_flops_whatever_gradient_checkpointing_recomputes():
    """Model FLOPs (forward + backward = 3 x forward here), not hardware FLOPs: the forward that activation
    checkpointing recomputes during backward (+33% on this model) is not model work. Both of torch's checkpoint
    flavours: the non-reentrant one --gradient_checkpointing asks for, and the reentrant one."""
    import torch
    from accelerate import Accelerator
    from torch.utils.flop_counter import FlopCounterMode

    from accel_train.core.meter import FlopCount

    model = tiny_bert_classifier()
    ids = torch.randint(1, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1])
    with FlopCounterMode(display=False) as forward:
        model(input_ids=ids, labels=labels)
    counts = {}
    for setting in ("off", "non-reentrant", "reentrant"):
        if setting == "off":
            model.gradient_checkpointing_disable()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": setting == "reentrant"})
        flops = FlopCount(Accelerator(cpu=True))
        with flops.measure(batch_samples=2, batch_positions=32):
            model(input_ids=ids, labels=labels).loss.backward()
        counts[setting] = flops.counts()
    assert counts["off"]["per_sample"] == 3 * forward.get_total_flops() / 2
    assert counts["off"]["per_token"] == 3 * forward.get_total_flops() / 32
    assert counts["non-reentrant"] == counts["off"]
    assert counts["reentrant"] == counts["off"]


# Names as torch.cuda.get_device_name (and nvidia-smi) report them, the precision in effect, and the dense datasheet
# peak in TFLOP/s; None: no peak known, so no MFU rather than a wrong one.
DEVICE_PEAKS = [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),  # the SXM5 part
    ("NVIDIA H100 PCIe", "bf16", 756.5),  # not the SXM peak: fewer SMs, lower clocks
    ("NVIDIA H100 NVL", "bf16", 835.5),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA H200 NVL", "bf16", 835.5),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100 80GB PCIe", "fp16", 312.0),
    ("NVIDIA A100-PCIE-40GB", "bf16", 312.0),
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA L40", "bf16", 181.05),  # not the L4's (a substring of it) nor the L40S's
    ("NVIDIA L40S", "bf16", 362.05),
    ("Tesla V100-SXM2-32GB", "fp16", 125.0),
    ("Tesla T4", "fp16", 65.0),
    ("NVIDIA A10G", "bf16", None),  # AWS's part: NVIDIA publishes no datasheet for it, and it is no A10
    ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "bf16", None),  # a slice of the GPU: the whole GPU's peak is wrong
    ("Tesla V100-SXM2-16GB", "bf16", None),  # Volta has no bf16 tensor cores
    ("NVIDIA GeForce RTX 4090", "bf16", None),
    ("AMD Instinct MI300X", "bf16", None),
]


@pytest.mark.parametrize(("name", "precision", "tflops"), DEVICE_PEAKS)
def test_the_gpu_peak_is_the_datasheet_figure_of_that_exact_device(monkeypatch, name, precision, tflops):
    import types

    import torch

    from accel_train.core.meter import FlopCount

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    gpu = types.SimpleNamespace(device=torch.device("cuda", 0), mixed_precision=precision)  # what the meter reads
    flops = FlopCount(gpu)
    if tflops is None:
        assert flops.peak is None
        assert flops.peak_source.startswith(f"peak unknown: {name} has no dense {precision} datasheet peak")
    else:
        assert flops.peak == pytest.approx(tflops * 1e12)
        assert flops.peak_source == f"{tflops:g} TFLOP/s, the dense {precision} datasheet peak of the {name}"


def test_a_device_without_a_known_peak_logs_no_mfu(monkeypatch):
    """No peak, no MFU figure (and no FLOP count: nothing would use it); the start-up report prints the
    'peak unknown' line (`peak_source`) as it prints a known peak (test_a_cpu_run_reports_...)."""
    import types

    import torch

    from accel_train.core.meter import StepMeter

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10G")
    gpu = types.SimpleNamespace(device=torch.device("cuda", 0), mixed_precision="bf16", num_processes=1)
    meter = StepMeter(gpu)
    with meter.flops.measure(batch_samples=4):
        torch.nn.Linear(16, 8)(torch.randn(4, 16)).sum().backward()
    assert meter.flops.mfu(samples_per_second=1000) is None and meter.flops.counts() == {}
    assert meter.flops.peak_source == ("peak unknown: NVIDIA A10G has no dense bf16 datasheet peak in "
                                       "accel_train.core.peak.PEAK_TFLOPS, so no MFU is logged")


def test_mfu_is_per_device_and_the_count_per_sample_under_accumulation_and_processes(tmp_path):
    """The invariant "MFU counts model FLOPs": the FLOPs per sample do not depend on how a step's batch is split
    into micro-batches, and with N processes the model FLOP/s is per device (the FLOPs per sample x the samples
    every process trained per second / N). The toy MLP's count is known: Linear(6, 32) forward 2 x 6 x 32 and
    its weight gradient as much (its input needs none), Linear(32, 2) forward 2 x 32 x 2 and backward twice that."""
    import types

    import torch
    from accelerate import Accelerator

    from accel_train.core.meter import StepMeter

    per_sample = {}
    for name, args in {"8": ["--per_device_train_batch_size", "8"],
                       "2x4": ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4"]}.items():
        run_toy(tmp_path / name, "--max_steps", "3", *args)
        logged = [r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "model_tflops" in r]
        per_sample[name] = [r["model_tflops"] * 1e12 / r["samples_per_second"] for r in logged]
    assert len(per_sample["8"]) == 3 and per_sample["2x4"] == pytest.approx(per_sample["8"], rel=1e-9)
    assert per_sample["8"] == pytest.approx([4 * 6 * 32 + 6 * 32 * 2] * 3, rel=1e-9)
    # 2 processes, in-process: the other rank's interval equal to this one's, as the all-reduce would sum it
    real = Accelerator(cpu=True)
    two = types.SimpleNamespace(device=real.device, mixed_precision="no", num_processes=2,
                                reduce=lambda tensor, reduction: tensor * 2)
    meter = StepMeter(two)
    model = torch.nn.Linear(16, 8, bias=False)
    for _ in range(3):
        with meter.flops.measure(batch_samples=4):
            model(torch.randn(4, 16, requires_grad=True)).sum().backward()
        meter.add_micro_batch({"loss": torch.tensor(1.0)}, samples=4, tokens=0, waited=0.0)
    record = meter.record()
    assert meter.flops.per_sample == 6 * 16 * 8
    assert record["model_tflops"] * 1e12 == pytest.approx(6 * 16 * 8 * record["samples_per_second"] / 2, rel=1e-9)
    assert record["mfu"] == pytest.approx(record["model_tflops"] * 1e12 / meter.flops.peak, rel=1e-9)


def test_a_compiled_runs_weight_average_is_saved_by_the_bare_models_names_and_resumes_without_compile(tmp_path):
    """The average was taken of the compiled module (unwrap_model keeps torch.compile), so the checkpoint's
    weight_average_rank0.safetensors held `_orig_mod.` names: they load into no bare model, and a resume that turns
    compile off (or on) was refused ("does not match this model"). The compiled module's parameters are the bare
    module's tensors: the average is kept by the bare names, and a resume without --torch_compile continues it bitwise
    as the compiled run's own resume does (the eager backend computes what eager does). Dynamo's caches are reset
    before and after (process-wide: another test's compiles could leave this one eager)."""
    import shutil

    import torch
    import torch._dynamo

    common = ["--report_to", "none", "--disable_tqdm", "--max_steps", "8", "--save_strategy", "steps",
              "--save_steps", "4", "--eval_strategy", "no", "--logging_steps", "1", "--ema_decay", "0.9"]
    compiled = ["--torch_compile", "--torch_compile_backend", "eager"]
    torch._dynamo.reset()
    try:
        toy_main([*common, *compiled, "--output_dir", str(tmp_path / "c"), "--stop_at_step", "4"])
        shutil.copytree(tmp_path / "c", tmp_path / "e")
        toy_main([*common, *compiled, "--output_dir", str(tmp_path / "c"), "--resume_from_checkpoint", "latest"])
    finally:
        torch._dynamo.reset()
    toy_main([*common, "--output_dir", str(tmp_path / "e"), "--resume_from_checkpoint", "latest"])
    for folder in list_checkpoints(tmp_path / "c"):
        keys = list(load_file(folder / "weight_average_rank0.safetensors"))
        assert keys and not any("_orig_mod" in key for key in keys), (folder, keys)
    for name in ("model.safetensors", "checkpoints/step-00000008/weight_average_rank0.safetensors"):
        c, e = load_file(tmp_path / "c" / name), load_file(tmp_path / "e" / name)
        assert c.keys() == e.keys() and all(torch.equal(c[k], e[k]) for k in c), name
