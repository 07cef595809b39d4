"""--optim muon (core/muon.py): torch's Muon for the hidden weight matrices, AdamW for embeddings, the head, biases and
norms, as one optimizer. Which tensors each part takes, the state_dict round trip, the schedule moving both parts,
the Muon rate (--muon_lr_ratio) in the start-up report and config.yaml, accumulation, bf16, the spike rollback with a
weight average beside it, and the refusal under FSDP / DeepSpeed. Resume (bitwise, cut by a stop and by SIGTERM),
2 processes and the other promises are the feature x invariant matrix's Muon rows (tests/core/test_matrix.py).
Everything runs in this process on tiny models."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch
import toy_train
import yaml
from conftest import read_jsonl, reset_accelerate
from safetensors.torch import load_file
from test_spike_guard import assert_rolled_back_to_the_run_without_the_batch, rollback_then_reference

from accel_train import ConfigError, TrainConfig, build_optimizer, no_decay_param_groups, run_cli
from accel_train.core.muon import MuonWithAdamW

pytestmark = pytest.mark.usefixtures("one_thread")

QUIET = ["--report_to", "none", "--disable_tqdm", "--run_report", "false"]
MUON = TrainConfig(optim="muon", learning_rate=0.01, weight_decay=0.1, report_to=["none"])


def run(out, *args):
    reset_accelerate()
    run_cli(toy_train.main, ["--output_dir", str(out), *QUIET, *args])
    return load_file(out / "model.safetensors")


def parts(optimizer: MuonWithAdamW, model: torch.nn.Module) -> tuple[set[str], set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return tuple({names[id(p)] for g in part.param_groups for p in g["params"]} for part in optimizer.optimizers)


def test_muon_takes_the_hidden_matrices_and_adamw_the_embeddings_head_biases_and_norms():
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    plain = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 3))
    muon, adamw = parts(build_optimizer(plain, MUON), plain)
    assert muon == {"1.weight", "3.weight"}  # the last Linear (4) is the head
    assert adamw == {"0.weight", "1.bias", "2.weight", "2.bias", "4.weight", "4.bias"}

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32))
    muon, adamw = parts(build_optimizer(gpt2, MUON), gpt2)
    # GPT-2's Conv1D blocks are 2-D hidden matrices; the tied lm_head is wte, an embedding: AdamW (once)
    assert muon == {f"transformer.h.{i}.{m}.weight" for i in range(2)
                    for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight"} <= adamw
    assert not any(name.endswith(".weight") and "ln_" not in name for name in adamw - {"transformer.wte.weight",
                                                                                      "transformer.wpe.weight"})

    bert = BertForSequenceClassification(BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                                    intermediate_size=32, vocab_size=50, num_labels=3))
    muon, adamw = parts(build_optimizer(bert, MUON), bert)
    assert "classifier.weight" in adamw and "bert.pooler.dense.weight" in muon  # no output embeddings: last Linear
    assert {"bert.embeddings.word_embeddings.weight", "bert.embeddings.position_embeddings.weight"} <= adamw
    assert all(p.ndim == 2 for g in build_optimizer(bert, MUON).muon.param_groups for p in g["params"])


def test_a_model_of_several_heads_keeps_each_of_them_for_adamw():
    """The multimodal DualEncoder's two towers end in a projection each; by the last-Linear rule one went to Muon and
    the other to AdamW. It names both (`muon_adamw_modules`), as FusionEncoder adds its ITM head."""
    from transformers import BertConfig, BertModel

    from accel_train.tasks.multimodal.dual_encoder import DualEncoder
    from accel_train.tasks.multimodal.fusion_model import FusionEncoder

    class Vision(torch.nn.Module):
        num_features = 8

        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(8, 8)

    text = BertModel(BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                vocab_size=50))
    dual = DualEncoder(text, Vision(), embed_dim=8)
    muon, adamw = parts(build_optimizer(dual, MUON), dual)
    assert {"text_projection.weight", "vision_projection.weight"} <= adamw and "vision.body.weight" in muon
    fusion = FusionEncoder(text, Vision(), embed_dim=8, fusion_dim=8, fusion_heads=2, fusion_layers=1)
    muon, adamw = parts(build_optimizer(fusion, MUON), fusion)
    assert {"text_projection.weight", "vision_projection.weight", "fusion.itm_head.weight"} <= adamw
    assert "fusion.text_in.0.weight" in muon


def test_lora_adapters_are_refused_with_why():
    """LoRA's two rank-r factors of one update would be orthogonalised one by one: refused, naming a factor."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32))
    lora = get_peft_model(gpt2, LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    with pytest.raises(ConfigError, match=r"--optim muon with LoRA adapters \(2 factor\(s\), e.g. .*c_attn.lora_A."
                                          r".*Train LoRA with --optim adamw"):
        build_optimizer(lora, MUON)


def test_groups_keep_their_rates_and_decay_and_muon_gets_the_ratio():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    config = TrainConfig(optim="muon", learning_rate=0.01, weight_decay=0.1, muon_lr_ratio=3.0, report_to=["none"])
    optimizer = build_optimizer(model, config)
    # Muon; AdamW with decay (the head's weight); AdamW without (the biases)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.03, 0.01, 0.01])
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.1, 0.0]
    assert optimizer.muon.defaults["adjust_lr_fn"] == "match_rms_adamw" and optimizer.muon.defaults["nesterov"]
    assert optimizer.adamw.defaults["fused"], "the AdamW part takes torch's fused kernel where --optim adamw does"
    # a group of the user's with its own rate: both of its parts start from it
    own = build_optimizer(model, config, [{"params": list(model[0].parameters()), "lr": 0.5},
                                         {"params": list(model[1].parameters())}])
    assert [g["lr"] for g in own.param_groups] == pytest.approx([1.5, 0.5, 0.01])


def test_the_state_dict_round_trip_continues_bitwise_and_shares_the_loaded_groups():
    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Tanh(),
                                    torch.nn.Linear(6, 2))
        return model, build_optimizer(model, MUON)

    def steps(model, optimizer, seeds):
        for seed in seeds:
            x = torch.randn(8, 5, generator=torch.Generator().manual_seed(seed))
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    a, opt_a = model_and_optimizer()
    steps(a, opt_a, range(3))
    buffer = io.BytesIO()
    torch.save(opt_a.state_dict(), buffer)
    b, opt_b = model_and_optimizer()
    b.load_state_dict(a.state_dict())
    buffer.seek(0)
    opt_b.load_state_dict(torch.load(buffer, weights_only=True))
    assert opt_b.muon.param_groups[0] is opt_b.param_groups[0] and opt_b.adamw.param_groups[-1] is \
        opt_b.param_groups[-1], "the loaded groups are the ones Muon and AdamW step with"
    assert opt_b.muon.state is opt_b.state and opt_b.adamw.state is opt_b.state
    assert "momentum_buffer" in opt_b.state[b[0].weight] and "exp_avg" in opt_b.state[b[4].weight]
    steps(a, opt_a, range(3, 6))
    steps(b, opt_b, range(3, 6))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


class InnerRates:
    """Records, at every logged step (--logging_steps 1), the rate Muon and AdamW each step with next (their own
    groups)."""

    def __init__(self):
        self.rates: list[tuple[float, float]] = []

    def attach(self, run):
        self.run = run

    def on_log(self, state, logs):
        inner = self.run.optimizer.optimizer  # Accelerate's wrapper holds MuonWithAdamW
        self.rates.append((inner.muon.param_groups[0]["lr"], inner.adamw.param_groups[0]["lr"]))


def test_the_report_reads_the_adamw_kernel_from_the_groups_a_resume_restores():
    """A checkpoint saved when Muon's AdamW part looped over its tensors resumes with that kernel (torch restores each
    group's `fused`): the report line follows the groups, not what was built."""
    from accel_train.core.muon import build_muon

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    looped = build_muon(model, MUON, no_decay_param_groups(model, 0.1))
    fused = build_muon(model, MUON, no_decay_param_groups(model, 0.1), fused=True)
    assert [label.startswith("AdamW (fused kernel):") for label in fused.group_labels] == [False, True, True]
    fused.load_state_dict(looped.state_dict())
    assert not fused.adamw.param_groups[0].get("fused")
    assert [label.startswith("AdamW:") for label in fused.group_labels] == [False, True, True]


def test_the_schedule_moves_both_parts_and_the_muon_rate_is_reported_and_recorded(tmp_path, capsys):
    hook = InnerRates()
    reset_accelerate()
    out = tmp_path / "run"
    toy_train.main(["--output_dir", str(out), *QUIET, "--optim", "muon", "--muon_lr_ratio", "2", "--learning_rate",
                    "0.01", "--max_steps", "8", "--warmup_steps", "4", "--logging_steps", "1", "--lr_scheduler_type",
                    "linear", "--save_strategy", "no", "--eval_strategy", "no"], hooks=[hook])
    adamw = [0.01 * k / 4 if k <= 4 else 0.01 * (8 - k) / 4 for k in range(1, 9)]  # the rate after step k
    assert [r[1] for r in hook.rates] == pytest.approx(adamw)
    assert [r[0] for r in hook.rates] == pytest.approx([2 * r for r in adamw])
    printed = capsys.readouterr().out
    assert "MuonWithAdamW (built from the config): Muon (match_rms_adamw): 1 hidden matrix(es): lr 0.02" in printed
    assert "the schedule peaks at" not in printed, "the pre-flight expects the Muon groups' peak, 2 x --learning_rate"
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["optim"] == "muon" and saved["muon_lr_ratio"] == 2.0
    groups = saved["what_ran"]["optimizer"]["groups"]
    assert [g["lr"] for g in groups] == pytest.approx([0.02, 0.01, 0.01])
    assert groups[0]["params"].startswith("Muon")
    assert groups[1]["params"] == "AdamW (fused kernel): 1 tensor(s) (head 3.weight)"  # as --optim adamw on a CPU


# AdamW's tensors: test_loop.py::test_accumulation_equals_one_big_batch's 1e-5. Muon's matrices: torch's Muon runs
# Newton-Schulz in bf16, so a float32 rounding difference in the summed gradient (another order of summation) can
# flip one bf16 rounding of the update, a step of 2^-8 of it: 0.2 * lr * sqrt(32) * ~0.18 * 2^-8 = 1.6e-5 at lr
# 0.02 on toy_train's 32 x 6 matrix (measured: 0 after 12 steps, 1.2e-5 after 36; AdamW alone 1.3e-7).
TOLERANCE = {"adamw": 1e-5, "muon": 4e-5}


def test_accumulation_equals_one_big_batch(tmp_path):
    """2 micro-batches of 4 = 1 of 8, over 3 epochs of 12 Muon + AdamW steps."""
    common = ["--optim", "muon", "--learning_rate", "0.02", "--num_train_epochs", "3", "--save_strategy", "no",
              "--eval_strategy", "no"]
    small = run(tmp_path / "acc", *common, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2")
    big = run(tmp_path / "big", *common, "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1")
    for name in small:  # toy_train's 0.weight is the hidden matrix Muon steps
        part = "muon" if name == "0.weight" else "adamw"
        assert (small[name] - big[name]).abs().max().item() < TOLERANCE[part], name


def test_bf16_runs_and_learns(tmp_path):
    out = tmp_path / "bf16"
    run(out, "--optim", "muon", "--mixed_precision", "bf16", "--learning_rate", "0.02", "--num_train_epochs", "3",
        "--logging_steps", "1", "--save_strategy", "no", "--eval_strategy", "no")
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert sum(losses[-4:]) < 0.6 * sum(losses[:4]), losses
    assert yaml.safe_load((out / "config.yaml").read_text())["mixed_precision"] == "bf16"


def test_rollback_restores_muon_and_the_weight_average_beside_it(tmp_path):
    """The spike guard's rollback (core/guard.py) with Muon's momentum and an average as the final model: bitwise the
    run whose data never held the spiked batch (test_spike_guard.py's check)."""
    runs = rollback_then_reference(tmp_path, extra=["--optim", "muon", "--ema_decay", "0.9", "--save_ema_as_final"])
    assert_rolled_back_to_the_run_without_the_batch(*runs, positions=[5])


@pytest.mark.parametrize("engine, reason", [("FSDP", "no process holds a whole matrix"),
                                            ("DEEPSPEED", "builds and steps its own optimizer")])
def test_sharded_engines_are_refused_before_anything_is_built(engine, reason):
    from accelerate.utils import DistributedType

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    accelerator = SimpleNamespace(distributed_type=DistributedType[engine], state=SimpleNamespace())
    with pytest.raises(ConfigError, match=f"--optim muon cannot run under .*{reason}.*DDP.*--optim adamw"):
        build_optimizer(model, MUON, no_decay_param_groups(model, 0.0), accelerator)


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match="--muon_lr_ratio 2.0 sets the Muon groups' rate, and --optim is 'adamw'"):
        TrainConfig(muon_lr_ratio=2.0, report_to=["none"])
    with pytest.raises(ConfigError, match="--muon_lr_ratio=0.0"):
        TrainConfig(optim="muon", muon_lr_ratio=0.0, report_to=["none"])
    with pytest.raises(ConfigError, match="no hidden 2-D weight matrix"):
        build_optimizer(torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 2)), MUON)


class GroupSettings:
    """Records each part's group settings at every logged step."""

    def attach(self, run):
        self.run = run
        self.seen: list[dict] = []

    def on_log(self, state, logs):
        inner = self.run.optimizer.optimizer
        self.seen.append({"muon": [(g["momentum"], g["eps"]) for g in inner.muon.param_groups],
                          "adamw": [g["eps"] for g in inner.adamw.param_groups]})


def test_a_resume_with_other_adam_and_sgd_settings_leaves_muons_momentum_and_eps_alone(tmp_path, capsys):
    """Muon's groups hold "momentum" and "eps" too (Newton-Schulz's); --adam_epsilon changed on resume is AdamW's,
    --sgd_momentum SGD's."""
    out = tmp_path / "run"
    common = ["--output_dir", str(out), *QUIET, "--optim", "muon", "--max_steps", "4", "--logging_steps", "1",
              "--save_strategy", "steps", "--save_steps", "2", "--eval_strategy", "no"]
    reset_accelerate()
    toy_train.main([*common, "--stop_at_step", "2"])
    hook = GroupSettings()
    reset_accelerate()
    toy_train.main([*common, "--resume_from_checkpoint", "latest", "--adam_epsilon", "1e-6", "--sgd_momentum", "0.5"],
                   hooks=[hook])
    assert "adam_epsilon 1e-08 -> 1e-06: applied" in capsys.readouterr().out
    assert hook.seen and all(s["muon"] == [(0.95, 1e-7)] and s["adamw"] == [1e-6, 1e-6] for s in hook.seen), hook.seen
