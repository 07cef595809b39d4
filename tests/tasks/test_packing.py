"""Packed and padding-free batches (accel_train.tasks.text.generation.packing, the text-generation recipe's
--packing and --padding_free): the same logits, the same step gradient and the same labels as padded batches of the
same examples, every example isolated from the others, and exact resume. Every run is in this process (`main(argv)`)
or, for 2 processes, on the session's spawned gloo ranks (conftest's `ranks`): the launcher is not what they test."""

from __future__ import annotations

import json

import datasets
import pytest
import text_generation
import token_train
import torch
from conftest import reset_accelerate
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from accel_train import ConfigError, DataError, Preempted, run_cli
from accel_train.tasks.text.generation import (
    IGNORE_INDEX,
    GenerationDataArguments,
    ModelFacts,
    PackedCollator,
    TrainCollator,
    best_fit_decreasing,
    check_isolation,
    load_raw_data,
    pack_examples,
    resolve_columns,
    tokenize_splits,
    train_bpe_tokenizer,
    training_set,
)

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 64
ONE_SGD_STEP = ["--optim", "sgd", "--sgd_momentum", "0", "--learning_rate", "1", "--max_grad_norm", "0",
                "--max_steps", "1", "--lr_scheduler_type", "constant", "--weight_decay", "0", "--eval_strategy", "no",
                "--save_initial", "true"]


def tiny(family: str, attention: str):
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                            attn_implementation=attention)).eval()
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                                      eos_token_id=2, attn_implementation=attention)).eval()


def examples(n: int, seed: int = 0) -> datasets.Dataset:
    """Prompt + completion examples of 3 to 40 tokens, the prompt's labels -100 (completion-only training)."""
    g = torch.Generator().manual_seed(seed)
    ids, labels = [], []
    for _ in range(n):
        length = int(torch.randint(3, 41, (1,), generator=g))
        row = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        prompt = int(torch.randint(0, length - 1, (1,), generator=g))
        ids.append(row)
        labels.append([IGNORE_INDEX] * prompt + row[prompt:])
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})


def model_inputs(batch):
    return {k: v for k, v in batch.items() if k not in ("labels", "real_tokens")}


def packed_logits(model, packed, rows=None):
    rows = rows if rows is not None else [packed.rows[i] for i in range(len(packed.rows))]
    with torch.no_grad():
        return model(**model_inputs(PackedCollator(0)(rows))).logits


def spans(packed, data):
    """(row, start, example) of every example in the packed rows."""
    out = []
    for row, members in enumerate(packed.groups):
        start = 0
        for m in members:
            out.append((row, start, m))
            start += len(data[m]["input_ids"])
    return out


def test_best_fit_decreasing_places_every_item_once_within_capacity():
    assert best_fit_decreasing([5, 4, 3, 3, 2, 2, 1], 10) == [[0, 1, 6], [2, 3, 4, 5]]  # 1 fits the first
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 61, (500,), generator=g).tolist()
    bins = best_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= 11 / 9 * -(-sum(lengths) // 64) + 1  # BFD's bound against the optimum
    with pytest.raises(ValueError, match="capacity"):
        best_fit_decreasing([65], 64)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logits_equal_each_examples_logits_alone(family, attention):
    model, data = tiny(family, attention), examples(24)
    packed = pack_examples(data, 64)
    assert len(packed.rows) < 24 and packed.padding_share < 0.2
    logits = packed_logits(model, packed)
    padded = TrainCollator(0)([data[i] for i in range(len(data))])
    with torch.no_grad():
        alone = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
    errors = [(logits[row, start:start + len(data[i]["input_ids"])] - alone[i, :len(data[i]["input_ids"])]).abs().max()
              for row, start, i in spans(packed, data)]
    assert len(errors) == 24 and max(errors) < 1e-5


def test_changing_one_example_leaves_every_other_examples_logits_unchanged():
    model, data = tiny("llama", "sdpa"), examples(24)
    packed = pack_examples(data, 64)
    row, start, changed = next((r, s, i) for r, s, i in spans(packed, data) if len(packed.groups[r]) > 2)
    rows = [dict(packed.rows[i]) for i in range(len(packed.rows))]
    length = len(data[changed]["input_ids"])
    rows[row]["input_ids"] = [*rows[row]["input_ids"][:start], *[(t % (VOCAB - 1)) + 1 for t in range(length)],
                              *rows[row]["input_ids"][start + length:]]
    before, after = packed_logits(model, packed), packed_logits(model, packed, rows)
    others = torch.ones(before.shape[:2], dtype=torch.bool)
    others[row, start:start + length] = False
    assert (before - after).abs()[others].max() < 1e-6  # every other example, its own row included
    assert (before - after).abs()[~others].max() > 1e-2  # the probe does reach the changed one


def test_packing_keeps_the_completion_only_and_chat_labels(tmp_path):
    pairs = [{"p": f"the {d} of march, 2021", "c": f"{d} march 2021"} for d in range(1, 25)]
    chat = [{"messages": [{"role": "user", "content": r["p"]}, {"role": "assistant", "content": "ok"},
                          {"role": "user", "content": "again"}, {"role": "assistant", "content": r["c"]}]}
            for r in pairs]
    bpe = train_bpe_tokenizer([r["p"] + r["c"] for r in pairs], 300)
    bpe.chat_template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}<|pad|>{% endfor %}"
                         "{% if add_generation_prompt %}<|endoftext|>assistant: {% endif %}")
    facts = ModelFacts(seq2seq=False, positions=512)
    for rows, columns in ((pairs, {"prompt_column": "p", "completion_column": "c"}),
                          (chat, {"messages_column": "messages"})):
        path = tmp_path / "data.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        args = GenerationDataArguments(train_file=str(path), validation_split=4, **columns)
        raw = load_raw_data(args, 0)
        tokens = tokenize_splits(raw, bpe, args, resolve_columns(args, False, raw["train"].column_names),
                                 facts)["train"].tokens
        packed = pack_examples(tokens, 128)
        assert sum(len(g) for g in packed.groups) == len(tokens) and len(packed.rows) <= len(tokens) / 2
        for row, start, i in spans(packed, tokens):
            ids, labels = tokens[i]["input_ids"], tokens[i]["labels"]
            assert packed.rows[row]["input_ids"][start:start + len(ids)] == ids
            # what is scored: the same targets, the first one never (the causal shift does not score it unpacked)
            assert packed.rows[row]["labels"][start:start + len(ids)] == [IGNORE_INDEX, *labels[1:]]
            assert packed.rows[row]["position_ids"][start:start + len(ids)] == list(range(len(ids)))


def test_a_long_example_is_refused_or_split_and_bad_flags_are_refused():
    data = examples(6)
    longest = max(len(i) for i in data["input_ids"])
    with pytest.raises(DataError, match="longer than --max_seq_length 16.*--packing_split"):
        pack_examples(data, 16)
    split = pack_examples(data, 16, split=True)
    assert split.examples == sum(-(-len(i) // 16) for i in data["input_ids"]) and longest > 16
    assert split.real_tokens == sum(len(i) for i in data["input_ids"])
    with pytest.raises(ConfigError, match="--max_seq_length shapes the rows of --packing"):
        GenerationDataArguments(max_seq_length=64)
    with pytest.raises(ConfigError, match="give one"):
        GenerationDataArguments(packing=True, padding_free=True)


def test_the_padding_share_recorded_is_the_packed_rows_and_zero_padding_free():
    """training_set's padding_ratio, which the finish seam writes to all_results.json as train_padding_ratio."""
    data, model = examples(24), tiny("llama", "sdpa")
    packed = training_set(data, GenerationDataArguments(packing=True), 64, 0, None, model)
    expected = pack_examples(data, 64).padding_share
    assert packed.padding_ratio == expected and 0 < expected < 0.2
    assert f"padding {100 * expected:.1f}%" in packed.summary
    assert training_set(data, GenerationDataArguments(padding_free=True), 64, 0, None, model).padding_ratio == 0.0
    assert training_set(data, GenerationDataArguments(), 64, 0, None, model).padding_ratio is None  # padded batches


class SeesEverything(torch.nn.Module):
    """A 'causal LM' whose every position sees the mean of all tokens before it, whatever the position ids."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)
        self.config = LlamaConfig(vocab_size=VOCAB)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, position_ids=None, use_cache=None, **kwargs):
        hidden = self.embed(input_ids).cumsum(1) / torch.arange(1, input_ids.shape[1] + 1)[:, None]
        return type("Out", (), {"logits": self.head(hidden)})


def test_a_model_that_lets_packed_examples_see_each_other_is_refused():
    with pytest.raises(ConfigError, match="does not keep packed examples apart.*--attn_implementation"):
        check_isolation(SeesEverything(), VOCAB, "--packing")
    check_isolation(tiny("llama", "sdpa"), VOCAB, "--packing")  # isolated: no error


# ------------------------------------------------------------------------------------------------ step gradient


def rows_divisible_by(multiple: int) -> tuple[int, int]:
    """A count of token_train sequences whose packed rows (width 64) divide into `multiple` micro-batches."""
    for n in range(16, 64):
        rows = len(token_train.packed_rows(token_train.sequences(n, 0), 64).rows)
        if rows % multiple == 0:
            return n, rows
    raise AssertionError("no such count")


def step_error(out, n):
    initial, final = load_file(out / "initial.safetensors"), load_file(out / "model.safetensors")
    reference = token_train.reference_gradient(token_train.tiny_lm(), token_train.sequences(n, 0))
    return max((initial[name] - final[name] - reference[name]).abs().max().item() for name in final)


@pytest.mark.parametrize("layout", ["packing", "padding_free"])
def test_a_packed_step_is_the_padded_steps_gradient_with_accumulation(tmp_path, layout):
    n, rows = rows_divisible_by(4) if layout == "packing" else (16, 16)  # rows: one window of 4 micro-batches
    flags = ["--pack_width", "64"] if layout == "packing" else ["--padding_free", "true"]
    batch = rows // 4
    reset_accelerate()
    token_train.main(["--output_dir", str(tmp_path), "--num_sequences", str(n), *ONE_SGD_STEP, *flags,
                      "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", "4"])
    assert step_error(tmp_path, n) < 1e-5


def test_a_packed_step_on_two_processes_is_the_padded_steps_gradient(tmp_path, ranks):
    """tests/scripts/token_train.py on the session's 2 spawned gloo ranks: 2 processes x 2 micro-batches."""
    n, rows = rows_divisible_by(4)
    ranks.run(token_train.main, ["--output_dir", str(tmp_path), "--num_sequences", str(n), *ONE_SGD_STEP,
                                 "--pack_width", "64", "--per_device_train_batch_size", str(rows // 4),
                                 "--gradient_accumulation_steps", "2"])
    assert step_error(tmp_path, n) < 1e-5


# ------------------------------------------------------------------------------------------------ the recipe


LLAMA = ["--model_type", "llama", "--train_tokenizer_vocab_size", "300", "--config_overrides",
         "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2,"
         "max_position_embeddings=128"]


def recipe(out, data, *extra):
    """recipes/text_generation.py's main in this process: a tiny Llama trained on packed rows, checkpoints every 2."""
    reset_accelerate()
    text_generation.main(["--train_file", data, "--text_column", "text", "--summary_column", "summary",
                          "--validation_split", "8", *LLAMA, "--output_dir", str(out), "--report_to", "none",
                          "--disable_tqdm", "--cpu_threads", "1", "--no_run_report", "--no_preflight",
                          "--max_generate_samples", "0", "--per_device_train_batch_size", "4", "--num_train_epochs",
                          "2", "--save_strategy", "steps", "--save_steps", "2", "--max_source_length", "24",
                          "--max_target_length", "12", "--packing", "--max_seq_length", "64", *extra])


def test_a_packed_run_cut_by_sigterm_and_resumed_ends_with_the_same_weights_bitwise(tmp_path, capsys, monkeypatch):
    """The whole run, the cut and the resume in this process. The cut: a SIGTERM after step 6, so the loop
    checkpoints step 7 (between the every-2-steps saves, inside epoch 2 of 5 steps each) and stops; a SIGKILL is the
    reliability tests' subject (tests/rundir/test_reliability.py)."""
    from accel_train.tasks.text.generation.demo import date_pairs

    d = date_pairs(72, 1)
    data = tmp_path / "dates.jsonl"
    data.write_text("".join(json.dumps({"text": t, "summary": s}) + "\n"
                            for t, s in zip(d["text"], d["summary"], strict=True)))
    monkeypatch.delenv("ACCEL_TRAIN_FAULT", raising=False)
    recipe(tmp_path / "full", str(data))
    started = capsys.readouterr().out
    assert "packed: 64 examples into" in started
    padding = float(started.split("tokens, padding ")[1].split("%")[0])  # the start-up line's share
    with monkeypatch.context() as env, pytest.raises(Preempted):
        env.setenv("ACCEL_TRAIN_FAULT", "sigterm_after_step:6")
        recipe(tmp_path / "cut", str(data))
    newest = sorted((tmp_path / "cut" / "checkpoints").glob("step-*"))[-1]
    state = json.loads((newest / "train_state.json").read_text())
    assert newest.name == "step-00000007" and state["batch_in_epoch"] > 0  # cut inside an epoch
    assert not (tmp_path / "cut" / "model.safetensors").exists()  # the cut run did not finish
    recipe(tmp_path / "cut", str(data), "--resume_from_checkpoint", "latest")
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # all_results.json: the rows' padding share (as the classification recipe records its own) and the round-trip
    # check of the targets (a byte-level BPE writes every date back), the same in the resumed run
    full, resumed = (json.loads((tmp_path / run / "all_results.json").read_text()) for run in ("full", "cut"))
    keys = ("train_padding_ratio", "data_train_targets_round_trip_pct", "data_train_targets_round_trip_checked")
    assert [full[k] for k in keys] == [resumed[k] for k in keys]
    assert full["train_padding_ratio"] == pytest.approx(padding / 100, abs=5e-4) and full["train_padding_ratio"] > 0
    assert full["data_train_targets_round_trip_pct"] == 100.0 and full["data_train_targets_round_trip_checked"] == 64


def test_packing_a_seq2seq_model_is_refused(tmp_path, capsys, monkeypatch):
    """recipes/text_generation.py through run_cli in this process: the message and exit code 2, no traceback."""
    monkeypatch.delenv("ACCEL_TRAIN_TRACEBACK", raising=False)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "a b", "summary": "c"}) + "\n" for _ in range(12)))
    reset_accelerate()
    with pytest.raises(SystemExit) as stop:
        run_cli(text_generation.main, ["--train_file", str(data), "--text_column", "text", "--summary_column",
                                       "summary", "--model_type", "t5", "--train_tokenizer_vocab_size", "300",
                                       "--packing", "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--packing is for causal LMs" in err and "Traceback" not in err
