"""Image-text fusion (ALBEF / BLIP style): a dual encoder, cross-attention fusion layers and an image-text
matching (ITM) head, trained on contrastive (ITC) + ITM losses with hard negatives from the global batch.

    accelerate launch recipes/multimodal_fusion.py                     # DEMO: MNIST digits, GENERATED captions
    accelerate launch recipes/multimodal_fusion.py --data_dir ../shared/data/flickr8k-mini
    accelerate launch recipes/multimodal_fusion.py --config recipes/configs/multimodal_fusion_flickr8k.yaml
    accelerate launch recipes/multimodal_fusion.py --config ... --loss_weighting uncertainty   # learned weights

The towers, projections and temperature are the contrastive recipe's (all-MiniLM-L6-v2 text tower, a small
ResNet or a transformers vision tower); --fusion_layers cross-attention layers let each caption's tokens
attend to its image's last feature map, and the ITM head (a linear layer on the fused [CLS] plus a learned
multiple of a word-region alignment score) says whether they match. Each image and each caption gets one
hard negative drawn from the ITC similarities over the gathered global batch.
Losses are weighted by --loss_weights itc=1,itm=1 or learned (--loss_weighting uncertainty, Kendall et al.
2018); each task's loss, weight and gradient norm goes to the loss output's "log". The evaluation reports ITC
retrieval, the same retrieval with each query's top --rerank_k ITC candidates re-ranked by ITM (and by
ITM + ITC), and ITM accuracy / ROC-AUC against random and hard negatives (all in all_results.json, a
summary printed). Measured: benchmarks/multimodal_fusion.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from accelerate.utils import set_seed

from accel_train import ConfigError, TrainConfig, build_accelerator, parse_with_defaults, run_cli, split_loaders, train
from accel_train.tasks.multimodal.contrastive_loss import StepClock
from accel_train.tasks.multimodal.data import (
    ImageTextArguments,
    ImageTextCollator,
    ImageTextDataset,
    load_image_text_data,
)
from accel_train.tasks.multimodal.fusion_loss import TASKS, FusionLoss, FusionTaskArguments, parse_loss_weights
from accel_train.tasks.multimodal.fusion_metrics import FusionMetrics, summary
from accel_train.tasks.multimodal.fusion_model import FusionEncoder, fusion_param_groups
from accel_train.tasks.multimodal.towers import TowerModelArguments, TowerTrainingArguments, build_towers
from accel_train.tasks.vision.transforms import (
    EvalTransform,
    channel_mean_std,
    image_processor,
    processor_size,
)

# The contrastive recipe's defaults for photo folders (strong augmentation, weight decay, a frozen pretrained
# text tower: 400 photos overfit a from-scratch vision tower); the flickr8k-mini config is what was measured.
DEFAULTS = {
    "output_dir": "outputs/multimodal_fusion", "num_train_epochs": 20, "per_device_train_batch_size": 64,
    "per_device_eval_batch_size": 256, "learning_rate": 1e-3, "weight_decay": 0.2, "lr_scheduler_type": "cosine",
    "warmup_steps": 0.1, "logging_steps": 10, "save_total_limit": 1, "freeze_text_tower_steps": -1,
    "crop_scale_min": 0.35, "horizontal_flip": True, "color_jitter": 0.3,
    "dataloader_drop_last": True,  # a short last batch has few negatives (and one pair has none)
}
# The demo (no data flag): 4,000 digits, 62 steps an epoch; digits are not mirror images and need no jitter.
DEMO_DEFAULTS = {"num_train_epochs": 2, "crop_scale_min": 0.8, "horizontal_flip": False, "color_jitter": 0.0}


@dataclass(frozen=True)
class ModelArguments(TowerModelArguments):
    """The two towers and the shared embedding space (tasks.multimodal.towers), and the fusion layers."""

    fusion_layers: int = field(default=2, metadata={"help": "Cross-attention fusion layers."})
    fusion_dim: int = field(default=128, metadata={"help": "Width of the fusion layers."})
    fusion_heads: int = field(default=4, metadata={"help": "Attention heads of the fusion layers."})
    fusion_dropout: float = field(default=0.1, metadata={"help": "Dropout in the fusion layers."})
    fusion_alignment: bool = field(default=True, metadata={
        "help": "Add a word-region alignment score (SCAN, Lee et al. 2018) of the fusion's inputs to the ITM logit."})


@dataclass(frozen=True)
class TowerArguments(TowerTrainingArguments):
    """Per-tower optimisation and image augmentation (tasks.multimodal.towers), the fusion part's learning rate
    and the captions' token dropout."""

    fusion_learning_rate: float | None = field(default=None, metadata={
        "help": "Fusion layers, ITM head and learned task weights, trained from scratch (default: --learning_rate)."})
    token_dropout: float = field(default=0.0, metadata={
        "help": "Text augmentation: hide each caption token (not [CLS] / [SEP]) with this probability; 0 = off."})

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.token_dropout < 1:
            raise ConfigError(f"--token_dropout {self.token_dropout}: must be in [0, 1).")


CONFIG_TYPES = (TrainConfig, ImageTextArguments, ModelArguments, FusionTaskArguments, TowerArguments)


def load_data(data_args: ImageTextArguments, seed: int, accelerator):
    """(ImageData, and, once the image size is known, a function size -> {split: ImageTextDataset})."""
    with accelerator.main_process_first():
        data = load_image_text_data(data_args, seed=seed)
    for note in data.notes:
        accelerator.print(f"data: {note}")

    def datasets(size: int) -> dict[str, ImageTextDataset]:
        return {name: ImageTextDataset(split, size, train=name == "train", eval_captions=data_args.eval_captions)
                for name, split in data.splits.items()}

    return data, datasets


def build_model(args: ModelArguments, tasks: FusionTaskArguments, image_size: int):
    """(FusionEncoder, tokenizer, image processor or None)."""
    text_model, tokenizer, vision, processor = build_towers(args, image_size)
    model = FusionEncoder(text_model, vision, args.embed_dim, args.init_temperature, args.max_logit_scale,
                          args.fusion_layers, args.fusion_dim, args.fusion_heads, args.fusion_dropout,
                          num_task_weights=len(TASKS) if tasks.loss_weighting == "uncertainty" else 0,
                          fusion_alignment=args.fusion_alignment)
    return model, tokenizer, processor


def build_loss(config: TrainConfig, data_args: ImageTextArguments, tasks: FusionTaskArguments, towers: TowerArguments,
               train_set: ImageTextDataset, mean, std) -> FusionLoss:
    train_transform = towers.train_transform(train_set.images.image_size, mean, std)
    return FusionLoss(train_transform, EvalTransform(mean, std), seed=config.seed, num_train_images=len(train_set),
                      text_length=data_args.max_seq_length, weights=parse_loss_weights(tasks.loss_weights),
                      clock=StepClock(), token_dropout=towers.token_dropout, grad_norms=tasks.log_task_grad_norms,
                      freeze_steps=towers.freeze_steps(), contrastive_steps=tasks.contrastive_steps)


def build_metrics(model: FusionEncoder, config: TrainConfig, tasks: FusionTaskArguments) -> FusionMetrics:
    return FusionMetrics(model, rerank_k=tasks.rerank_k, seed=config.seed, batch_size=config.per_device_eval_batch_size)


class Finish:
    """The finish seam: the learned temperature and task weights in the final metrics, the image processor saved
    beside the model, a summary printed."""

    def __init__(self, processor, output_dir: str):
        self.processor, self.output_dir = processor, output_dir

    def on_finish(self, session, metrics: dict[str, float]) -> None:
        model = session.accelerator.unwrap_model(session.model)
        metrics["logit_scale"] = float(model.logit_scale.detach().clamp(0, model.max_log_scale).exp())
        if model.task_log_vars is not None:
            for task, log_var in zip(TASKS, model.task_log_vars.detach().tolist(), strict=True):
                metrics[f"{task}_weight"] = math.exp(-log_var)
        if session.accelerator.is_main_process:
            self.processor.save_pretrained(self.output_dir)
            for prefix in ("eval", "test"):
                line = summary(metrics, prefix)
                if line:
                    print(line, flush=True)


def parse(argv=None):
    """The five configs; the demo's own defaults apply when no data flag (nor a YAML file) names data."""
    return parse_with_defaults(CONFIG_TYPES, argv, DEFAULTS,
                               lambda c: {} if c[1].data_dir or c[1].dataset_name else DEMO_DEFAULTS)


def main(argv=None) -> dict[str, float]:
    config, data_args, model_args, tasks, towers = parse(argv)
    accelerator = build_accelerator(config)
    demo = not (data_args.data_dir or data_args.dataset_name)
    data, make_datasets = load_data(data_args, config.seed, accelerator)
    model, tokenizer, processor = build_model(model_args, tasks, data.image_size)
    size = processor_size(processor) or data.image_size
    datasets = make_datasets(size)
    mean, std = (processor.image_mean, processor.image_std) if processor else channel_mean_std(datasets["train"].images)
    accelerator.print(("DEMO: embedded MNIST digits with captions GENERATED from their labels (not human captions)\n"
                       if demo else "") + "data: " + ", ".join(f"{k} {len(v.captions)} images / {len(v)} items"
                                                               for k, v in datasets.items()) + f", {size}x{size}")
    loss_fn = build_loss(config, data_args, tasks, towers, datasets["train"], mean, std)
    lrs = {**towers.learning_rates(config.learning_rate), "fusion": _or(towers.fusion_learning_rate,
                                                                           config.learning_rate)}
    wds = {**towers.weight_decays(config.weight_decay), "fusion": config.weight_decay}
    set_seed(config.seed, device_specific=True)  # the model is built: now every process draws its own crops
    collator = ImageTextCollator(tokenizer, data_args.max_seq_length)
    loaders = split_loaders(datasets, config, accelerator, data.eval_split, collate_fn=collator)
    finish = Finish(image_processor(size, mean, std) if processor is None else processor, config.output_dir)
    result = train(model, loaders.train, config=config, loss_fn=loss_fn,
                   metrics_fn=build_metrics(model, config, tasks), eval_loader=loaders.eval,
                   final_eval_loaders=loaders.final, accelerator=accelerator,
                   optimizer=fusion_param_groups(model, lrs, wds), hooks=[finish], processing_class=tokenizer,
                   extra_configs=[data_args, model_args, tasks, towers])
    return result.metrics


def _or(value, default):
    return default if value is None else value


if __name__ == "__main__":
    run_cli(main)
