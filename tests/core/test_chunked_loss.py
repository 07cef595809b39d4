"""Chunked cross-entropy (accel_train.core.chunked_loss, --loss_chunk_size): the same losses and gradients as the
full logits, inside the sum-and-count contract (accumulation and processes exact), and refused where it would be
wrong."""

from __future__ import annotations

import pytest
import token_train
import torch
from accelerate import Accelerator
from conftest import reset_accelerate, token_main
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from accel_train import ConfigError, default_loss
from accel_train.core.chunked_loss import HeadInput, check_chunked_loss, chunked_causal_loss
from accel_train.core.loss import token_loss
from accel_train.tasks.text.generation import GenerationModelArguments, loss_chunk

pytestmark = pytest.mark.usefixtures("one_thread")
ONE_SGD_STEP = ["--optim", "sgd", "--sgd_momentum", "0", "--learning_rate", "1", "--max_grad_norm", "0",
                "--max_steps", "1", "--lr_scheduler_type", "constant", "--weight_decay", "0", "--eval_strategy", "no",
                "--save_initial", "true"]


def llama(vocab=1000, tied=False):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=tied))


def batch(vocab=1000):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 30:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, :10] = -100  # a prompt: not learned
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def gradients(model, loss_fn, data):
    model.zero_grad()
    out = loss_fn(model, data)
    (out["loss_sum"].sum() / out["num_items"].sum()).backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_chunked_gradients_equal_the_full_logits_gradients(tied, smoothing):
    model, data = llama(tied=tied), batch()
    full, expected = gradients(model, lambda m, b: token_loss(m, b, smoothing), data)
    chunked, got = gradients(model, default_loss(smoothing, chunk_size=16), data)  # 16 does not divide 120
    assert float(chunked["loss_sum"].detach()) == pytest.approx(float(full["loss_sum"].sum().detach()), rel=1e-6)
    assert int(chunked["num_items"]) == int(full["num_items"].sum())
    assert max((expected[n] - got[n]).abs().max().item() for n in expected) < 1e-6


def test_evaluation_gets_per_sample_sums_without_the_logits():
    model, data = llama(), batch()
    with torch.no_grad():
        full, chunked = token_loss(model, data), default_loss(0.0, 7)(model, data)
    assert torch.allclose(full["loss_sum"], chunked["loss_sum"], rtol=1e-6)
    assert torch.equal(full["num_items"], chunked["num_items"])
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    with torch.no_grad(), HeadInput(model.lm_head):
        model(input_ids=data["input_ids"])
    assert seen == [(3, 0, 1000)]  # the output layer computed no logits


def test_a_step_is_the_token_mean_gradient_with_accumulation(tmp_path):
    reset_accelerate()
    token_train.main(["--output_dir", str(tmp_path), *ONE_SGD_STEP, "--loss_chunk_size", "8",
                      "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4"])
    assert step_error(tmp_path) < 1e-6


def test_a_step_on_two_processes_is_the_token_mean_gradient(tmp_path, ranks):
    """On the session's two gloo ranks."""
    ranks.run(token_main, ["--output_dir", str(tmp_path), *ONE_SGD_STEP, "--loss_chunk_size", "8",
                           "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"])
    assert step_error(tmp_path) < 1e-6


def step_error(out):
    initial, final = load_file(out / "initial.safetensors"), load_file(out / "model.safetensors")
    reference = token_train.reference_gradient(token_train.tiny_lm(), token_train.sequences(16, 0))
    return max((initial[name] - final[name] - reference[name]).abs().max().item() for name in final)


class Doubled(LlamaForCausalLM):
    """Scales its logits after the output layer, with no config field that says so."""

    def forward(self, **kwargs):
        out = super().forward(**kwargs)
        out.logits = out.logits * 2
        return out


def test_a_model_that_changes_its_logits_after_the_output_layer_is_refused():
    with pytest.raises(ConfigError, match="differ from the model.s own"):
        check_chunked_loss(Doubled(llama().config), batch())
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    with pytest.raises(ConfigError, match="final_logit_softcapping=30"):
        check_chunked_loss(gemma, batch())
    with pytest.raises(ConfigError, match="final_logit_softcapping=30"):
        loss_chunk(GenerationModelArguments(loss_chunk_size=64), gemma, "NO")
    assert loss_chunk(GenerationModelArguments(), gemma, "NO")[0] == 0  # the default: the full logits, said why


def test_the_default_chunks_large_vocabularies_and_never_under_sharded_engines():
    small, large = llama(vocab=1000), llama(vocab=32000)
    assert loss_chunk(GenerationModelArguments(), small, "NO") == (0, "")
    chunk, note = loss_chunk(GenerationModelArguments(), large, "MULTI_CPU")
    assert chunk > 0 and "vocabulary of 32000" in note
    assert loss_chunk(GenerationModelArguments(loss_chunk_size=0), large, "NO")[0] == 0
    chunk, note = loss_chunk(GenerationModelArguments(), large, "FSDP")
    assert chunk == 0 and "under FSDP" in note
    with pytest.raises(ConfigError, match="under FSDP.*sharded"):
        loss_chunk(GenerationModelArguments(loss_chunk_size=256), large, "FSDP")
    with pytest.raises(ConfigError, match="--loss_chunk_size -1"):
        GenerationModelArguments(loss_chunk_size=-1)


# ------------------------------------------------------------------ mixed precision: the loss as the loop runs it
# Accelerate autocasts the prepared model's forward only; the loop calls the loss function outside any autocast.


def prepared(precision, seed=0, tied=False):
    reset_accelerate()
    accelerator = Accelerator(mixed_precision=precision, cpu=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=tied))
    return accelerator, accelerator.prepare(model)


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_chunked_loss_and_gradients_equal_the_full_logits_within_bf16(tied):
    """As the loop calls the loss on a bf16-prepared model: the chunks compute the same bf16 logits as the full loss
    (the losses agree to fp32 summation, 1e-6; with fp32 chunks they differed by up to 1e-5), and gradients within
    4 x bf16's eps of each parameter's largest (bf16 products rounded per chunk instead of once; measured <= 2.2)."""
    for seed in range(3):
        _, model = prepared("bf16", seed, tied)
        data = batch()
        full, expected = gradients(model, token_loss, data)
        chunked, got = gradients(model, default_loss(0.0, chunk_size=16), data)
        assert float(chunked["loss_sum"].detach()) == pytest.approx(float(full["loss_sum"].sum().detach()), rel=1e-6)
        for name in expected:
            error, scale = (expected[name] - got[name]).abs().max(), expected[name].abs().max()
            assert error <= 4 * torch.finfo(torch.bfloat16).eps * scale, name
        with torch.no_grad():
            per_sample = token_loss(model, data)["loss_sum"], chunked_causal_loss(model, data, 7)["loss_sum"]
        assert torch.allclose(*per_sample, rtol=1e-6)


def test_the_probe_accepts_a_bf16_llama_outside_and_inside_autocast():
    """One check, one answer: where the pre-flight calls the loss (under accelerator.autocast()) and where the loop
    does (outside it), for every seed."""
    for seed in range(6):
        accelerator, model = prepared("bf16", seed)
        check_chunked_loss(model, batch())
        with accelerator.autocast():
            check_chunked_loss(model, batch())


class Scaled(LlamaForCausalLM):
    """Scales its logits after the output layer by `factor`, with no config field that says so."""

    factor = 1.0

    def forward(self, **kwargs):
        out = super().forward(**kwargs)
        out.logits = out.logits * self.factor
        return out


@pytest.mark.parametrize("precision, factor", [("no", 1.0005), ("bf16", 2.0)])
def test_the_probe_tolerance_is_the_dtypes(precision, factor):
    """A change of the logits above the dtype's resolution is refused: 5e-4 in fp32 (far above fp32's rounding),
    a factor 2 under bf16."""
    reset_accelerate()
    accelerator = Accelerator(mixed_precision=precision, cpu=True)
    model = Scaled(llama().config)
    model.factor = factor
    model = accelerator.prepare(model)
    with pytest.raises(ConfigError, match="differ from the model.s own"):
        check_chunked_loss(model, batch())


def test_the_probe_runs_without_dropout_and_draws_no_random_number():
    """In the loop the model is in training mode: the probe's two forwards must not draw two dropout masks (a GPT-2
    with its default dropout was refused), nor move the run's random numbers."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0)).train()
    assert model.config.resid_pdrop > 0
    before = torch.random.get_rng_state()
    check_chunked_loss(model, batch())
    assert torch.equal(before, torch.random.get_rng_state()) and model.training


class MatmulDtypes(TorchDispatchMode):
    """The operand dtypes of every matrix product with a dimension of `width` (the vocabulary), as it runs: after
    autocast has cast its operands."""

    def __init__(self, width):
        super().__init__()
        self.width, self.seen = width, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            operands = [a for a in args if isinstance(a, torch.Tensor)]
            if all(a.numel() for a in operands) and any(self.width in a.shape for a in operands):
                self.seen.append({a.dtype for a in operands})
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("no", torch.float32)])
def test_the_chunk_matmuls_run_in_the_forwards_precision(precision, dtype):
    """Logits, and the gradients of hidden states and weight, of each chunk in the dtype the model's own output layer
    computes in: bf16 in a bf16 run, as the loop calls the loss (outside autocast)."""
    _, model = prepared(precision)
    with MatmulDtypes(1000) as products:
        chunked_causal_loss(model, batch(), 16)
    assert len(products.seen) == 3 * 8  # 120 tokens in 8 chunks: logits, grad of hidden, grad of weight
    assert all(seen == {dtype} for seen in products.seen), products.seen
