"""Seeded bug: noise meant as a training regulariser, drawn whatever the mode (not gated on self.training), so the
trained model's outputs are random at inference too. An exported artifact draws its own noise: loaded back, it
differs from the model on every input. verify's export check flags it (the evaluation check would see the eval
metrics move between two evaluations as well).

The twin draws the noise in training only. Both keep example inputs beside the run
(RUN_DIR/export/example_inputs.safetensors, what --export_formats keeps): a plain module's run has no tokenizer or
image processor to make them from.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from common import Points, parse, run
from noisy_net import NoisyNet

from accel_train import run_cli
from accel_train.deploy import sample_from_batch
from accel_train.deploy.api import SAMPLE_FILE
from accel_train.rundir.layout import EXPORT_DIR


@dataclass(frozen=True)
class NoiseArgs:
    fixed: bool = False  # the twin: noise in training only
    num_samples: int = 64


def main(argv=None):
    config, args = parse(argv, NoiseArgs)
    points = Points(args.num_samples)
    run(config, args, points, make_model=lambda: NoisyNet(args.fixed))
    batch = {"x": torch.stack([points[i]["x"] for i in range(8)])}
    kept = Path(config.output_dir) / EXPORT_DIR / SAMPLE_FILE
    sample_from_batch(batch, source="the run's training points").save(kept)


if __name__ == "__main__":
    run_cli(main)
