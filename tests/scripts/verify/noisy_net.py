"""The model of export_noise.py, in a module of its own: the exporter rebuilds it from the run's model_factory.json
(`noisy_net:NoisyNet`), which names an importable module (a script's own classes live in `__main__`)."""

import torch


class NoisyNet(torch.nn.Module):
    """A small classifier with noise on its hidden layer, a regulariser meant for training. `fixed`: the noise is
    drawn in training only; without it, in evaluation and inference too (the bug)."""

    def __init__(self, fixed: bool = False, noise: float = 0.5):
        super().__init__()
        self.factory_kwargs = {"fixed": fixed, "noise": noise}  # how accel_train.deploy rebuilds it
        self.fixed, self.noise = fixed, noise
        self.hidden, self.head = torch.nn.Linear(6, 16), torch.nn.Linear(16, 2)

    def forward(self, x):
        h = torch.tanh(self.hidden(x))
        if self.training or not self.fixed:
            h = h + self.noise * torch.randn_like(h)
        return self.head(h)
