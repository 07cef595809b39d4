"""Seeded bug: the loss divided by the accumulation count by hand (the loop already averages the micro-batches), so
accumulated steps take 1/k of the gradient one batch of kB gives. verify's accumulation check flags it."""

import torch
from common import Points, parse, run

from accel_train import run_cli


def main(argv=None):
    config, bug = parse(argv)

    def loss_fn(model, batch):
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"])
        return loss if bug.fixed else loss / config.gradient_accumulation_steps  # the bug: divided twice

    run(config, bug, Points(bug.num_samples), loss_fn)


if __name__ == "__main__":
    run_cli(main)
