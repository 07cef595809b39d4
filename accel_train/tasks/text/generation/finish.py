"""The text-generation recipe's finish seam, as hooks: generation at the end of the run, scored and written to
predictions.jsonl, with the checks of checks.py; and the LoRA merge.

Both run after the final model is written (core/session.py), so an error here loses nothing trained.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from ....config import TrainConfig
from ....errors import ConfigError
from ....rundir.layout import PREDICTIONS
from .checks import collapse_warning, output_diversity, source_reliance
from .eval import GenerationArguments, Generator, evaluate_generation, write_predictions
from .model import GenerationModelArguments
from .packing import TrainingSet
from .roundtrip import round_trip_metrics, round_trip_warning
from .tokens import TokenizedSplit, TrainCollator

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "README.md")  # what peft's save_pretrained writes


class GenerationFinish:
    """Generate for the validation items (with --overfit_batches, the memorised training items), score them into
    the run's metrics ({prefix}_rouge1, ..., {prefix}_distinct_outputs_pct, {prefix}_source_reliance), write
    predictions.jsonl, add how many targets --max_target_length cut (data_*_targets_cut), how many come back from
    the tokenizer's round trip (data_*_targets_round_trip_pct, _checked), the padding of packed or padding-free
    rows (train_padding_ratio, as the classification recipe records it), and warn in the log and the report when
    the outputs collapsed, the source is ignored, or the tokenizer cannot write some of the scored targets."""

    finish_advice = ("If generation ran out of memory or time, lower --generation_num_beams, "
                     "--per_device_eval_batch_size or --generation_max_new_tokens (or --max_generate_samples 0 to "
                     "skip it).")

    def __init__(self, splits: dict[str, TokenizedSplit], tokenizer, seq2seq: bool, config: TrainConfig,
                 gen_args: GenerationArguments, modules, collator: TrainCollator, rows: TrainingSet | None = None):
        """`rows`: the training rows (their padding share; --overfit_batches with packed rows is refused here: the
        check generates for the first examples of the split, and the memorised packed rows hold the longest)."""
        if config.overfit_batches and rows is not None and rows.packed:
            raise ConfigError("--overfit_batches with --packing: the overfit check generates for the first "
                              "--overfit_batches x --per_device_train_batch_size examples of the training split, and "
                              "the rows it memorises are packed ones, longest examples first: it would score examples "
                              "the model never saw. Drop --packing for the overfit check (memorising a few batches is "
                              "the question, which padded batches answer).")
        self.splits, self.tokenizer, self.seq2seq = splits, tokenizer, seq2seq
        self.config, self.gen_args, self.modules, self.collator = config, gen_args, modules, collator
        self.padding_ratio = rows.padding_ratio if rows is not None else None  # None for padded batches

    def on_finish(self, session, metrics: dict) -> None:
        acc, config, overfit = session.accelerator, self.config, self.config.overfit_batches > 0
        if self.padding_ratio is not None:
            metrics["train_padding_ratio"] = round(self.padding_ratio, 4)
        for name, split in self.splits.items():
            if split.targets:
                metrics[f"data_{name}_targets_cut"] = float(split.targets_cut)
        metrics.update(round_trip_metrics({name: s.round_trip for name, s in self.splits.items() if s.round_trip}))
        scored = "train" if overfit else "validation"
        split = self.splits[scored]
        limit = (config.overfit_batches * config.per_device_train_batch_size * acc.num_processes if overfit
                 else self.gen_args.max_generate_samples)
        if not split.can_generate or limit == 0:
            return
        prefix = "overfit" if overfit else "eval"
        generator = Generator(split, self.tokenizer, self.seq2seq, self.gen_args, config.per_device_eval_batch_size,
                              limit)
        scores, rows = evaluate_generation(generator, acc, session.model, self.modules, prefix)
        metrics.update(scores)
        outputs = [r["output"] for r in rows]
        metrics.update({f"{prefix}_{k}": v for k, v in output_diversity(outputs).items()})
        reliance = source_reliance(acc, session.model, split.tokens.select(range(len(generator))), self.seq2seq,
                                   session.eval_loss_fn, self.collator, config.per_device_eval_batch_size)
        if reliance is not None:
            metrics[f"{prefix}_source_reliance"] = reliance
        warnings = [collapse_warning([r["source"] for r in rows], [r["reference"] for r in rows], outputs, reliance,
                                     self.seq2seq),
                    split.round_trip and round_trip_warning(scored, split.round_trip, scores, prefix)]
        for warning in filter(None, warnings):
            session.log.warn(warning)
        if acc.is_main_process:
            write_predictions(Path(config.output_dir) / PREDICTIONS, rows)


class MergeLora:
    """--merge_lora: once the adapter is saved, write the base model with the adapter merged into output_dir (the
    adapter moves to output_dir/adapter): a plain from_pretrained model that `accel-train export` takes."""

    def __init__(self, model_args: GenerationModelArguments, tokenizer, output_dir: str):
        self.model_args, self.tokenizer, self.output_dir = model_args, tokenizer, output_dir

    def on_finish(self, session, metrics: dict) -> None:
        acc = session.accelerator
        if acc.is_main_process:
            adapter = merge_lora(self.output_dir, acc.unwrap_model(session.model), self.model_args, self.tokenizer)
            session.log.write(f"--merge_lora: the merged model is in {self.output_dir}, the adapter in {adapter}")
        acc.wait_for_everyone()


def merge_lora(output_dir: str | Path, model, args: GenerationModelArguments, tokenizer) -> Path:
    """Write the base model with the trained LoRA adapter merged into its weights into `output_dir` (a plain
    `from_pretrained` model: config, weights, tokenizer) and move the adapter the run saved there into
    `output_dir/adapter`. The base is loaded afresh from --model_name_or_path with the run's own config (special
    tokens, overrides) and the adapter from the saved files, so the live (possibly sharded) model is not touched.
    Main process only; returns the adapter's folder."""
    import peft

    out = Path(output_dir)
    adapter = out / "adapter"
    adapter.mkdir(exist_ok=True)
    for name in ADAPTER_FILES:
        if (out / name).exists():
            shutil.move(str(out / name), str(adapter / name))
    trained = model.get_base_model()
    auto = AutoModelForSeq2SeqLM if trained.config.is_encoder_decoder else AutoModelForCausalLM
    base = auto.from_pretrained(args.model_name_or_path, config=copy.deepcopy(trained.config), dtype=torch.float32,
                                trust_remote_code=args.trust_remote_code)
    merged = peft.PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged.generation_config = copy.deepcopy(trained.generation_config)
    merged.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return adapter
