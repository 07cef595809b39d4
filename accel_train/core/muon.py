"""--optim muon: torch.optim.Muon for the hidden weight matrices, torch.optim.AdamW for everything else, stepped as
one optimizer (the split nanochat and torchtitan use; Muon is an optimizer for 2-D hidden layers only).

Which parameters Muon takes: every 2-D parameter except the embeddings and the output head, which AdamW takes with
the biases, norms and every tensor that is not 2-D (convolution kernels, position tables, class tokens). The AdamW
part takes torch's fused kernel where `--optim adamw` does (core/fused.py).

* embeddings: the parameters of every `nn.Embedding` module (a tied output head shares its tensor);
* the output head: the module the model's `get_output_embeddings()` returns (a transformers language model's
  lm_head), else the last `nn.Linear` in module order (a classifier: BERT's `classifier`, a plain `nn.Sequential`'s
  last layer); a model of several heads names them in `muon_adamw_modules` (the multimodal encoders' projections and
  ITM head). The start-up report names the tensors chosen.

Learning rate: Muon runs with torch's `adjust_lr_fn="match_rms_adamw"` (Moonshot, "Muon is Scalable for LLM
Training"): each matrix's orthogonalised update is scaled by 0.2 * sqrt(max(rows, cols)), the RMS of an AdamW update,
so AdamW's learning rate and weight decay carry over. A Muon group's peak rate is its source group's rate
(--learning_rate, or a group's own) times --muon_lr_ratio (1 by default); the schedule, --scale_lr and the resume
comparisons treat the Muon groups as any other group. Momentum 0.95 with Nesterov (torch's defaults).

Under FSDP and DeepSpeed it is refused before training (`refuse_sharded_muon`): Muon orthogonalises each whole matrix.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..config import TrainConfig
from ..errors import ConfigError
from .sharded import SHARDED_TYPES

ADJUST_LR = "match_rms_adamw"  # Muon's update RMS matched to AdamW's: the same learning rate serves both


class MuonWithAdamW(torch.optim.Optimizer):
    """A `torch.optim.Muon` and a `torch.optim.AdamW` over disjoint parameters, as one torch optimizer.

    `param_groups` holds Muon's groups, then AdamW's: the same dicts the two step with, so a schedule (or a hook)
    that sets a group's "lr" sets it where it is used. `state` is one dict both keep their per-parameter state in, so
    `state_dict()` / `load_state_dict()` are torch's own format and Accelerate saves and loads it as any optimizer;
    a loaded state's new groups and state are handed back to the two. `optimizers` is (muon, adamw).

        optimizer = MuonWithAdamW(torch.optim.Muon(matrices, lr=3e-4, adjust_lr_fn="match_rms_adamw"),
                                  torch.optim.AdamW(others, lr=3e-4), labels=["Muon", "AdamW"])
    """

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW | None, labels: list[str]):
        self.muon, self.adamw = muon, adamw
        self.optimizers = (muon,) if adamw is None else (muon, adamw)  # AdamW is absent when nothing is left for it
        self._labels = list(labels)  # one line per group for the start-up report and config.yaml (group_labels)
        self._sizes = [len(part.param_groups) for part in self.optimizers]
        # torch's add_param_group appends the very dicts given: these groups are the two optimizers' own
        super().__init__([group for part in self.optimizers for group in part.param_groups], defaults={})
        self._share()

    @property
    def group_labels(self) -> list[str]:
        """The report's line per group; an AdamW group says it runs the fused kernel when its dict does (read from
        the groups: a resumed run steps with the checkpoint's choice)."""
        return [label.replace("AdamW:", "AdamW (fused kernel):", 1) if group.get("fused") else label
                for label, group in zip(self._labels, self.param_groups, strict=False)]

    def _share(self) -> None:
        start = 0
        for part, size in zip(self.optimizers, self._sizes, strict=True):
            part.param_groups = self.param_groups[start:start + size]
            part.state = self.state  # the parameters are disjoint: one dict holds every state
            start += size

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.optimizers:
            part.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch's load builds new group dicts and a new state dict on this object: share them with the parts again
        super().load_state_dict(state_dict)
        self._share()


def kept_from_muon(model: torch.nn.Module) -> dict[int, str]:
    """{id(parameter): "embedding" | "head"} for the 2-D parameters AdamW takes although Muon could (module
    docstring)."""
    kept: dict[int, str] = {}
    named = getattr(model, "muon_adamw_modules", ())  # a model of several heads names them (DualEncoder's projections)
    heads = [model.get_submodule(name) for name in named]
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if not heads and not isinstance(head, torch.nn.Module):
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        head = linears[-1] if linears else None
    for module in heads or ([head] if head is not None else []):
        kept.update({id(p): "head" for p in module.parameters()})
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            kept.update({id(p): "embedding" for p in module.parameters()})
    return kept


def as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Param groups as dicts whose "params" are lists (torch takes one tensor, or any iterable: a generator is read
    once): a plain list of parameters is one group."""
    items = list(params)
    if items and not isinstance(items[0], dict):
        return [{"params": items}]
    return [dict(group, params=[group["params"]] if isinstance(group["params"], torch.Tensor)
                 else list(group["params"])) for group in items]


def refuse_low_rank_adapters(names, model: torch.nn.Module) -> None:
    """--optim muon on a model with LoRA adapters (or any peft model's adapters): a ConfigError. Muon
    orthogonalises each matrix's whole update; LoRA trains two rank-r factors of one update (lora_A, lora_B), which
    Muon would orthogonalise apart, so the update it makes is no orthogonalised update of the adapted matrix, and no
    setting of it is known good."""
    adapters = [n for n in names if ".lora_A." in n or ".lora_B." in n or ".lora_embedding_" in n]
    if adapters or getattr(model, "peft_config", None):
        which = f"{len(adapters)} factor(s), e.g. {adapters[0]}" if adapters else "a peft model's adapters"
        raise ConfigError(f"--optim muon with LoRA adapters ({which}): Muon orthogonalises a matrix's whole "
                          "update, and LoRA trains two low-rank factors of it, which Muon would orthogonalise one "
                          "by one. Train LoRA with --optim adamw, or train the model's own weights with Muon (no "
                          "--lora_r).")


def build_muon(model: torch.nn.Module, config: TrainConfig, groups: list[Any], fused: bool = False) -> MuonWithAdamW:
    """Each of `groups` split into its Muon part (hidden 2-D matrices, at the group's rate x --muon_lr_ratio) and
    its AdamW part (the rest, at the group's rate); Muon's groups first, then AdamW's, in the order given. `fused`:
    the AdamW part with torch's fused kernel (where `--optim adamw` would take it: core/fused.py)."""
    kept, names = kept_from_muon(model), {id(p): n for n, p in model.named_parameters()}
    refuse_low_rank_adapters(names.values(), model)
    muon_groups, adamw_groups, muon_labels, adamw_labels = [], [], [], []
    for group in as_groups(groups):
        matrices = [p for p in group["params"] if p.ndim == 2 and id(p) not in kept]
        others = [p for p in group["params"] if not (p.ndim == 2 and id(p) not in kept)]
        options = {k: v for k, v in group.items() if k != "params"}
        rate = options.get("lr", config.learning_rate)
        if matrices:
            muon_groups.append({**options, "params": matrices, "lr": rate * config.muon_lr_ratio})
            muon_labels.append(f"Muon ({ADJUST_LR}): {len(matrices)} hidden matrix(es)")
        if others:
            adamw_groups.append({**options, "params": others})
            special = [f"{kept[id(p)]} {names.get(id(p), '?')}" for p in others if p.ndim == 2 and id(p) in kept]
            more = ", ..." if len(special) > 3 else ""
            named = f" ({', '.join(special[:3])}{more})" if special else ""
            adamw_labels.append(f"AdamW: {len(others)} tensor(s){named}")
    if not muon_groups:
        raise ConfigError("--optim muon: the model has no hidden 2-D weight matrix for Muon (only embeddings, the "
                          "output head, biases, norms or tensors of other shapes, which AdamW trains): use --optim "
                          "adamw.")
    muon = torch.optim.Muon(muon_groups, lr=config.learning_rate * config.muon_lr_ratio,
                            weight_decay=config.weight_decay, adjust_lr_fn=ADJUST_LR)
    adamw = torch.optim.AdamW(adamw_groups, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                              eps=config.adam_epsilon, weight_decay=config.weight_decay,
                              **({"fused": True} if fused else {})) if adamw_groups else None
    return MuonWithAdamW(muon, adamw, muon_labels + adamw_labels)


def refuse_sharded_muon(accelerator) -> None:
    """--optim muon under FSDP or DeepSpeed: a ConfigError naming why and what to do, before anything is built."""
    running = getattr(getattr(accelerator, "distributed_type", None), "value", None)
    if running not in SHARDED_TYPES:
        return
    if running == "FSDP":
        why = ("FSDP2 shards every weight matrix across the processes (a DTensor per parameter), so no process holds a "
               "whole matrix, and Muon orthogonalises each whole matrix (Newton-Schulz on the full gradient); "
               "torch.optim.Muon does not gather them")
    else:
        why = ("DeepSpeed builds and steps its own optimizer inside its engine (ZeRO partitions the optimizer state "
               "and the gradients), and it has no Muon")
    engine = "FSDP" if running == "FSDP" else "DeepSpeed"
    raise ConfigError(f"--optim muon cannot run under {engine}: {why}. Train with Muon on one device or under DDP "
                      "(accelerate_configs/multi_gpu.yaml, cpu_multiprocess.yaml), where every process holds the whole "
                      "model, or keep the sharded preset with --optim adamw.")
