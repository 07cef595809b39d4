"""The final model, saved into output_dir with safetensors at the end of a run, and the transformers files that make a
checkpoint folder loadable with `from_pretrained`. Saving only: converting a run into deployable artifacts
(TorchScript, ExportedProgram, ONNX) is `accel_train.deploy` — "export" means that, and only that."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from accelerate import Accelerator

from .layout import FINAL_WEIGHTS, WEIGHTS


def save_final_model(accelerator: Accelerator, model: torch.nn.Module, output_dir: str | Path,
                 processing_class=None) -> None:
    """Save the final weights with safetensors: `save_pretrained` for transformers models (so `from_pretrained`
    and `pipeline` load the directory), `accelerator.save_model` otherwise. Wrappers (DDP, torch.compile's
    `_orig_mod.`) never reach the file; FSDP / ZeRO-3 shards are gathered. Collective: every rank calls it."""
    from accelerate.utils import DistributedType

    output_dir = Path(output_dir)
    bare = accelerator.unwrap_model(model, keep_torch_compile=False)
    # DeepSpeed gathers its shards from the engine; everything else from the bare module.
    source = model if accelerator.distributed_type == DistributedType.DEEPSPEED else bare
    if hasattr(bare, "save_pretrained"):  # transformers 5 always writes safetensors
        state_dict = accelerator.get_state_dict(source)
        bare.save_pretrained(output_dir, is_main_process=accelerator.is_main_process, state_dict=state_dict)
    else:
        accelerator.save_model(source, output_dir, safe_serialization=True)
    if processing_class is not None and accelerator.is_main_process:
        processing_class.save_pretrained(output_dir)
    accelerator.wait_for_everyone()


def final_model_names(model: torch.nn.Module, processing_class=None) -> list[str]:
    """The names (globs: the weights may be sharded) that `save_final_model` writes at the top of output_dir for
    `model` and `processing_class`, so that a directory holding files by those names that no run wrote is refused
    before training instead of written over. The processing class's names are what its save_pretrained writes
    (saved into a temporary folder to see them)."""
    names = list(FINAL_WEIGHTS)
    if hasattr(model, "save_pretrained") and hasattr(model, "config"):
        names += ["config.json", "generation_config.json"]
    if is_adapter_model(model):  # peft writes the adapter and a model card (and --merge_lora the merged model)
        names += ["adapter_config.json", "adapter_model.safetensors", "README.md"]
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        with tempfile.TemporaryDirectory() as folder:
            processing_class.save_pretrained(folder)
            names += sorted(os.listdir(folder))
    return names


def write_pretrained_files(accelerator: Accelerator, model: torch.nn.Module, folder: str | Path,
                           processing_class=None, weights_follow: bool = False) -> bool:
    """Make a checkpoint folder a model folder for transformers: write config.json (and generation_config.json,
    the tokenizer / processor files) beside the model.safetensors Accelerate saved there, whose names are the bare
    model's, so `AutoModel*.from_pretrained(checkpoint)` and `pipeline(model=checkpoint)` load it. Only for
    transformers models whose weights sit whole in that file (not FSDP / DeepSpeed shards); True when written.
    A LoRA (peft) model writes its adapter instead (adapter_config.json, adapter_model.safetensors): the checkpoint
    then loads with `peft.PeftModel.from_pretrained(base_model, checkpoint)`; no config.json is written, so that
    `AutoModel*.from_pretrained(checkpoint)` never builds a model with fresh weights from it.
    Main process only; call it before the checkpoint's manifest is written, so the files are covered by it.
    `weights_follow`: the whole model.safetensors is written into `folder` later (a background save: its copy is
    being written; a LoRA adapter is written here, at the step)."""
    folder = Path(folder)
    bare = accelerator.unwrap_model(model, keep_torch_compile=False)
    if not weights_follow and not (folder / WEIGHTS).is_file():
        return False
    if is_adapter_model(bare):  # a LoRA (peft) run: the checkpoint loads with PeftModel.from_pretrained(base, it)
        bare.save_pretrained(folder)  # adapter_config.json + adapter_model.safetensors; the base config untouched
        if processing_class is not None:
            processing_class.save_pretrained(folder)
        return True
    config = getattr(bare, "config", None)
    if not hasattr(config, "save_pretrained"):
        return False
    config.architectures = [type(bare).__name__]  # what save_pretrained records: pipeline() picks the class by it
    config.save_pretrained(folder)
    generation = getattr(bare, "generation_config", None)
    if generation is not None and getattr(bare, "can_generate", lambda: False)():
        generation.save_pretrained(folder)
    if processing_class is not None:
        processing_class.save_pretrained(folder)
    return True


def is_adapter_model(model: torch.nn.Module) -> bool:
    """A peft model (LoRA): what it saves is an adapter, and its `config` attribute is the base model's, which
    must never be rewritten as the adapter's (a config.json naming PeftModelForCausalLM loads fresh weights)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")
