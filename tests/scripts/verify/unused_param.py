"""Seeded bug: a module whose parameters never get a gradient (an auxiliary head built and never called in forward,
as a head kept from another task, or a branch a flag turned off, is). On 1 process nothing fails: the head simply
never trains. Under DDP (2 processes) the gradient all-reduce waits for every trainable parameter, so the first step
never finishes its reduction and the next forward fails ("Expected to have finished reduction in the prior
iteration"). verify's world-size check names it: an unused parameter, which one, and what to change. The twin
removes the head.
"""

import torch
from common import Points, parse, run

from accel_train import run_cli


class WithUnusedHead(torch.nn.Module):
    def __init__(self, fixed: bool):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        if not fixed:
            self.aux_head = torch.nn.Linear(16, 2)  # the bug: built, trainable, never called

    def forward(self, x):
        return self.body(x)


def main(argv=None):
    config, bug = parse(argv)
    run(config, bug, Points(bug.num_samples), make_model=lambda: WithUnusedHead(bug.fixed))


if __name__ == "__main__":
    run_cli(main)
