"""`--optim adamw` (the default) runs torch's fused AdamW kernel where the device has one (core/fused.py), as
transformers' Trainer defaults to: the same update as torch's default kernels up to rounding, named in the start-up
report; `adamw_torch` keeps torch's default kernels; `adam` takes the fused kernel where `adamw` does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from accel_train import TrainConfig, build_optimizer
from accel_train.core.fused import fused_adamw_runs

pytestmark = pytest.mark.usefixtures("one_thread")


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))


def kernel(optimizer) -> bool:
    return bool(optimizer.defaults.get("fused"))


def test_the_default_adamw_is_fused_on_a_cpu_and_adamw_torch_is_not():
    net = model()
    assert kernel(build_optimizer(net, TrainConfig(output_dir="unused")))
    assert kernel(build_optimizer(net, TrainConfig(output_dir="unused", optim="adamw_torch_fused")))
    assert not kernel(build_optimizer(net, TrainConfig(output_dir="unused", optim="adamw_torch")))
    adam = build_optimizer(net, TrainConfig(output_dir="unused", optim="adam"))  # Adam (L2 decay) the same way
    assert type(adam) is torch.optim.Adam and kernel(adam)
    for optim in ("adam", "adamw", "sgd"):  # a group without its own decay takes --weight_decay (L2 for adam, sgd)
        groups = [{"params": net.parameters()}]
        built = build_optimizer(net, TrainConfig(output_dir="unused", optim=optim, weight_decay=0.1), groups)
        assert built.param_groups[0]["weight_decay"] == 0.1, optim
    # groups whose params are a generator: read to choose the kernel and still all given to the optimizer
    built = build_optimizer(net, TrainConfig(output_dir="unused"), [{"params": net.parameters(), "lr": 0.1}])
    assert kernel(built) and len(built.param_groups[0]["params"]) == len(list(net.parameters()))


def test_the_kernel_follows_the_device_training_uses():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert fused_adamw_runs(params) and fused_adamw_runs([{"params": params}])
    assert fused_adamw_runs(params, SimpleNamespace(device=torch.device("cuda", 0)))
    assert not fused_adamw_runs(params, SimpleNamespace(device=torch.device("mps")))  # no bf16 there: torch's own
    assert not fused_adamw_runs(params, SimpleNamespace(device=torch.device("meta")))
    assert not fused_adamw_runs([{"params": []}])  # nothing to step: nothing to choose


def test_the_fused_default_takes_the_steps_torchs_default_kernel_takes_up_to_rounding():
    """Five steps of the same model, data and settings: the parameters within float rounding of each other, for
    AdamW (`adamw` against `adamw_torch`) and Adam (`adam` against torch.optim.Adam's default kernel)."""
    torch.manual_seed(1)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    initial = torch.cat([p.detach().flatten() for p in model().parameters()])
    for optim, loop in (("adamw", "adamw_torch"), ("adam", None)):
        trained = []
        for name in (optim, loop):
            net = model()
            optimizer = build_optimizer(net, TrainConfig(output_dir="unused", optim=name or optim,
                                                         learning_rate=1e-2, weight_decay=0.1))
            if name is None:  # torch's Adam with its default kernel, the same groups
                optimizer = torch.optim.Adam([{"params": g["params"], "weight_decay": g["weight_decay"]}
                                              for g in optimizer.param_groups], lr=1e-2)
                assert not any(g["fused"] for g in optimizer.param_groups)
            for _ in range(5):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
                optimizer.step()
            trained.append(torch.cat([p.detach().flatten() for p in net.parameters()]))
        assert (trained[0] - initial).abs().max().item() > 1e-3  # it trained
        assert (trained[0] - trained[1]).abs().max().item() < 1e-6, optim


def test_a_checkpoint_of_the_loop_kernel_resumes_on_it_and_the_record_says_so():
    """torch restores each param group's `fused` from a loaded state: a run checkpointed before the fused default
    goes on with torch's loop kernel, and what_ran (the start-up report, config.yaml) reads the groups, not the
    optimizer's construction."""
    from accel_train.core.objects import what_ran

    config = TrainConfig(output_dir="unused")
    net = model()
    old = build_optimizer(net, TrainConfig(output_dir="unused", optim="adamw_torch"))
    net(torch.randn(4, 8)).sum().backward()
    old.step()
    resumed = build_optimizer(net, config)
    assert what_ran(resumed, None, config, own_optimizer=False, own_scheduler=False)["optimizer"]["fused"] is True
    resumed.load_state_dict(old.state_dict())
    assert not any(g["fused"] for g in resumed.param_groups)
    assert "fused" not in what_ran(resumed, None, config, own_optimizer=False, own_scheduler=False)["optimizer"]
