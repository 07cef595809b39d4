"""benchmarks/matmul_ceiling.py's list of a step's matmuls is the step's: its FLOPs equal torch's FLOP counter on a
BERT encoder's forward and backward, so the MFU ceiling it reports weighs each shape as the step does."""

import importlib.util
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import BertConfig, BertModel

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "matmul_ceiling.py"


def load_script():
    spec = importlib.util.spec_from_file_location("matmul_ceiling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_listed_matmuls_are_the_encoders_forward_and_backward_flops():
    script = load_script()
    hidden, intermediate, heads, layers, sequences, length = 64, 256, 4, 2, 3, 10
    config = BertConfig(vocab_size=100, hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                        num_hidden_layers=layers, max_position_embeddings=32, attn_implementation="eager")
    model = BertModel(config, add_pooling_layer=False)
    ids = torch.randint(0, 100, (sequences, length), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids).last_hidden_state.float().pow(2).mean().backward()
    counted = sum(counter.get_flop_counts()["Global"].get(op, 0) for op in (
        torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm))
    listed = script.step_matmuls(sequences * length, length, hidden, intermediate, heads, layers)
    assert sum(script.flops(left, right) * count for _, left, right, count in listed) == counted
    assert {name for name, *_ in listed} >= {"MLP up weight grad", "attention q/k/v/o forward"}
