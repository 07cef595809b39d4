"""The multimodal contrastive recipe and accel_train.tasks.multimodal.

Fast tests use a 1-layer BERT built from a config (a word-level vocabulary, no download) and tiny vision towers;
across processes, the recipe's one real `accelerate launch` (2 processes) and a 2-process GradCache run on the
session's spawned gloo ranks (conftest's `ranks`) against the 1-process run in this process (`main(argv)`).
"""

import json
import math

import multimodal_contrastive as recipe
import numpy as np
import pytest
import torch
import yaml
from conftest import RECIPES, SHARED_DATA, launch, read_jsonl, reset_accelerate
from PIL import Image
from safetensors.torch import load_file

from accel_train import ConfigError, DataError, TrainConfig, build_accelerator, build_scheduler, make_plan
from accel_train.core.evaluation import LOSS_METRICS
from accel_train.tasks.multimodal.collectives import gather_with_grad
from accel_train.tasks.multimodal.contrastive_loss import ContrastiveLoss, clip_loss, draw_captions
from accel_train.tasks.multimodal.contrastive_metrics import ContrastiveMetrics, retrieval_metrics, zero_shot_accuracy
from accel_train.tasks.multimodal.data import (
    ImageTextCollator,
    ImageTextDataset,
    digits_with_captions,
    load_caption_folder,
)
from accel_train.tasks.multimodal.dual_encoder import DualEncoder, build_text_tower, tower_param_groups
from accel_train.tasks.vision.models import SmallResNet
from accel_train.tasks.vision.transforms import EvalTransform

RECIPE = RECIPES / "multimodal_contrastive.py"
COLOURS = {"red": (220, 40, 40), "green": (40, 220, 40), "blue": (40, 40, 220)}
WORDS = sorted(set("a an of the photo picture square patch colour shape bright dark . red green blue".split()))
QUIET = ["--report_to", "none", "--disable_tqdm", "--save_strategy", "no"]
TINY_VISION = ["--vision_config_overrides", '{"widths": [8, 16], "blocks_per_stage": 1}']
TINY_VIT = ["--vision_model_type", "vit", "--vision_config_overrides",
            '{"patch_size": 4, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, '
            '"intermediate_size": 32}']


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def tiny_bert_config(dropout: float = 0.0):
    from transformers import BertConfig

    return BertConfig(vocab_size=len(WORDS) + 5, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=64, hidden_dropout_prob=dropout,
                      attention_probs_dropout_prob=dropout)


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory):
    """A 1-layer BERT and its word-level tokenizer, saved like a pretrained text tower."""
    from transformers import BertModel, BertTokenizer

    path = tmp_path_factory.mktemp("tiny_text")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}).save_pretrained(path)
    torch.manual_seed(0)
    BertModel(tiny_bert_config()).save_pretrained(path)
    return path


def caption_folder(root, counts, size=16, seed=0, rows=None):
    """<root>/<split>/*.png with metadata.jsonl: noisy single-colour images, two captions and a class each."""
    rng = np.random.default_rng(seed)
    for split, n in counts.items():
        folder = root / split
        folder.mkdir(parents=True, exist_ok=True)
        lines = []
        for name, colour in COLOURS.items():
            for i in range(n):
                pixels = np.clip(np.array(colour) + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{name}{i}.png")
                lines.append({"file_name": f"{name}{i}.png", "colour": name,
                              "captions": [f"a {name} square", f"a photo of the colour {name}"]})
        (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (rows or lines)))
    return root


def run(tmp_path, data_dir, tiny_text, *flags, name="out"):
    out = tmp_path / name
    metrics = recipe.main(["--data_dir", str(data_dir), "--output_dir", str(out), "--text_model_name_or_path",
                           str(tiny_text), *QUIET, *flags])
    return out, metrics


def tiny_encoder(dropout=0.0, vision="resnet", seed=0):
    from transformers import BertModel

    torch.manual_seed(seed)
    tower = SmallResNet(0, widths=(4, 8), blocks_per_stage=1) if vision == "resnet" else _NormFreeVision()
    return DualEncoder(BertModel(tiny_bert_config(dropout), add_pooling_layer=False), tower, embed_dim=8)


class _NormFreeVision(torch.nn.Module):
    """A vision tower without batch norm, whose gradients do not depend on how the batch is split."""

    num_features = 6

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, 2)

    def forward(self, x):
        return torch.relu(self.conv(x)).mean(dim=(2, 3))


def fake_batch(n=8, k=2, length=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, len(WORDS) + 5, (n, k, length), generator=g)
    mask = torch.ones_like(ids)
    mask[:, :, -1] = torch.randint(0, 2, (n, k), generator=g)  # some captions a token shorter
    return {"pixel_values": torch.randint(0, 256, (n, 3, 12, 12), dtype=torch.uint8, generator=g),
            "caption_input_ids": ids, "caption_attention_mask": mask, "num_captions": torch.full((n,), k),
            "caption_ids": torch.arange(n * k).view(n, k), "image_ids": torch.arange(n)}


def loss_and_grads(model, loss_fn, batch, accelerator, seed=5):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(model, batch)
    accelerator.backward(loss)
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ------------------------------------------------------------------------------------------------ the loss


def test_clip_loss_matches_a_reference_computation():
    torch.manual_seed(0)
    images = torch.nn.functional.normalize(torch.randn(5, 4, dtype=torch.float64), dim=-1)
    texts = torch.nn.functional.normalize(torch.randn(5, 4, dtype=torch.float64), dim=-1)
    scale = torch.tensor(7.0)
    loss, per_pair = clip_loss(images, texts, scale)
    expected = []
    for i in range(5):  # by hand: -log softmax of the matching pair, in each direction, averaged
        i2t = [scale.item() * float(images[i] @ texts[j]) for j in range(5)]
        t2i = [scale.item() * float(texts[i] @ images[j]) for j in range(5)]
        expected.append((math.log(sum(map(math.exp, i2t))) - i2t[i] + math.log(sum(map(math.exp, t2i))) - t2i[i]) / 2)
    assert per_pair.tolist() == pytest.approx(expected, rel=1e-5)
    assert loss.item() == pytest.approx(sum(expected) / 5, rel=1e-5)
    # pairs 0 and 1 share their image: neither is a negative of the other, in either direction
    masked, _ = clip_loss(images, texts, scale, image_ids=torch.tensor([0, 0, 1, 2, 3]))
    logits = scale.item() * (images @ texts.T)
    keep = [[j for j in range(5) if not (i < 2 and j < 2 and i != j)] for i in range(5)]
    by_hand = sum((torch.logsumexp(logits[i, keep[i]], 0) - logits[i, i]
                   + torch.logsumexp(logits.T[i, keep[i]], 0) - logits[i, i]).item() / 2 for i in range(5)) / 5
    assert masked.item() == pytest.approx(by_hand, rel=1e-6)


def test_gradient_cache_gives_the_whole_batch_gradients(tmp_path):
    accelerator = build_accelerator(TrainConfig(output_dir=str(tmp_path), report_to=["none"]))
    model = tiny_encoder(vision="norm_free").train()
    batch = fake_batch(n=8)
    common = dict(seed=3, num_train_images=8)
    whole = ContrastiveLoss(accelerator, EvalTransform([0.5] * 3, [0.25] * 3), None, **common)
    cached = ContrastiveLoss(accelerator, EvalTransform([0.5] * 3, [0.25] * 3), None, chunk_size=3, **common)
    loss_a, grads_a = loss_and_grads(model, whole, batch, accelerator)
    loss_b, grads_b = loss_and_grads(model, cached, batch, accelerator)  # chunks of 3, 3 and 2
    assert loss_b == pytest.approx(loss_a, abs=1e-6)
    assert set(grads_a) == set(grads_b) and "logit_scale" in grads_a and any(k.startswith("text.") for k in grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


def test_gradient_cache_replays_dropout_and_leaves_batch_norm_statistics_alone(tmp_path):
    # With dropout and batch norm, chunks are not one batch; GradCache must equal one graph over the same chunks.
    accelerator = build_accelerator(TrainConfig(output_dir=str(tmp_path), report_to=["none"]))
    batch, transform = fake_batch(n=6), EvalTransform([0.5] * 3, [0.25] * 3)
    cached = ContrastiveLoss(accelerator, transform, None, seed=3, num_train_images=6, chunk_size=3)
    model = tiny_encoder(dropout=0.3).train()
    loss, grads = loss_and_grads(model, cached, batch, accelerator)
    stats = model.vision.stem[1].running_mean.clone()

    reference = tiny_encoder(dropout=0.3).train()
    from accel_train.tasks.multimodal.contrastive_loss import select_captions

    torch.manual_seed(5)
    images = transform(batch["pixel_values"])
    pick = draw_captions(batch["image_ids"], batch["num_captions"], 3, 0, 6)
    input_ids, mask, caption_ids = select_captions(batch, pick)
    outs = [reference(pixel_values=images[r], input_ids=input_ids[r], attention_mask=mask[r])
            for r in (slice(0, 3), slice(3, 6))]
    ref_loss, _ = clip_loss(torch.cat([o["image_embeds"] for o in outs]), torch.cat([o["text_embeds"] for o in outs]),
                            outs[0]["logit_scale"], batch["image_ids"], caption_ids)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), abs=1e-6)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(stats, reference.vision.stem[1].running_mean)


def test_accumulation_is_refused_with_the_gradient_cache_alternative(tmp_path, tiny_text):
    # the loss declares it (refuse_accumulation) and the session refuses, before anything is written
    data = caption_folder(tmp_path / "data", {"train": 4, "test": 1})
    with pytest.raises(ConfigError, match=r"--gradient_accumulation_steps 4: .*4x fewer negatives.*"
                                          r"--per_device_train_batch_size by 4.*--gradient_cache_chunk_size"):
        run(tmp_path, data, tiny_text, *TINY_VISION, "--gradient_accumulation_steps", "4")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_gradient_cache_is_refused_under_deepspeed():
    """DeepSpeed's engine steps the optimizer inside every backward (no_sync is a null context for ZeRO >= 2): each
    GradCache chunk would be an optimizer step on its part of the gradient. Refused (failed before: accepted)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    deepspeed = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED)
    with pytest.raises(ConfigError, match=r"--gradient_cache_chunk_size 2 under DeepSpeed: .*optimizer step.*DDP or "
                                          r"FSDP.*drop"):
        ContrastiveLoss(deepspeed, torch.nn.Identity(), torch.nn.Identity(), seed=0, num_train_images=4, chunk_size=2)
    ContrastiveLoss(deepspeed, torch.nn.Identity(), torch.nn.Identity(), seed=0, num_train_images=4)  # no GradCache


def test_label_smoothing_is_refused_by_the_contrastive_loss_before_anything_is_written(tmp_path, tiny_text):
    """InfoNCE here has no label smoothing: the flag changed nothing while config.yaml recorded it (failed before)."""
    data = caption_folder(tmp_path / "data", {"train": 4, "test": 1})
    with pytest.raises(ConfigError, match=r"--label_smoothing_factor 0.1: .*InfoNCE.* no label smoothing.*drop"):
        run(tmp_path, data, tiny_text, *TINY_VISION, "--max_steps", "1", "--label_smoothing_factor", "0.1")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_captions_are_drawn_per_epoch_from_the_seed_alone():
    ids, counts = torch.arange(200), torch.full((200,), 5)
    first = draw_captions(ids, counts, seed=1, epoch=0, num_images=200)
    assert torch.equal(first, draw_captions(ids, counts, seed=1, epoch=0, num_images=200))
    assert torch.equal(first[50:60], draw_captions(ids[50:60], counts[:10], seed=1, epoch=0, num_images=200))
    assert not torch.equal(first, draw_captions(ids, counts, seed=1, epoch=1, num_images=200))
    assert not torch.equal(first, draw_captions(ids, counts, seed=2, epoch=0, num_images=200))
    assert set(first.tolist()) == set(range(5))
    assert draw_captions(ids, torch.ones(200, dtype=torch.long), 1, 3, 200).eq(0).all()


# ----------------------------------------------------------------------------------------------- metrics


def test_recall_and_median_rank_on_hand_made_embeddings():
    scores = torch.tensor([[0.9, 0.1, 0.2, 0.3],   # image 0: its caption first          -> rank 1
                           [0.8, 0.5, 0.1, 0.0],   # image 1: one caption scores higher  -> rank 2
                           [0.7, 0.6, 0.4, 0.1],   # image 2                             -> rank 3
                           [0.5, 0.6, 0.7, 0.2]])  # image 3                             -> rank 4
    m = retrieval_metrics(torch.eye(4), scores.T, ks=(1, 2, 3))  # image i . text j == scores[i, j]
    assert [m[f"i2t_recall@{k}"] for k in (1, 2, 3)] == [0.25, 0.5, 0.75] and m["i2t_median_rank"] == 2
    # caption j queries the images (column j): ranks 1, 3, 2, 2
    assert [m[f"t2i_recall@{k}"] for k in (1, 2, 3)] == [0.25, 0.75, 1.0] and m["t2i_median_rank"] == 2
    assert m["i2t_chance_recall@1"] == m["t2i_chance_recall@1"] == 0.25 and m["t2i_chance_recall@3"] == 0.75
    assert m["mean_recall"] == pytest.approx((0.25 + 0.5 + 0.75 + 0.25 + 0.75 + 1.0) / 6)

    # Two captions per image (pairs 0,1 -> image 0; 2,3 -> image 1): an image hits if either caption ranks.
    images = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    texts = torch.tensor([[0.2, 0.9], [0.95, 0.1], [0.1, 0.8], [0.9, 0.3]])
    m = retrieval_metrics(images, texts, image_ids=torch.tensor([0, 0, 1, 1]), caption_ids=torch.arange(4), ks=(1,))
    assert (m["retrieval_images"], m["retrieval_captions"]) == (2, 4)
    assert m["i2t_recall@1"] == 0.5  # image 0's best is its own caption 1; image 1's best (0.9) is caption 0
    assert m["t2i_recall@1"] == 0.5  # captions 1 and 2 find their image first; 0 and 3 do not
    assert m["i2t_chance_recall@1"] == 0.5  # 2 of 4 captions are right for each image

    # Identical captions (one id) of different images match either image: "a seven" may find any seven.
    shared = torch.nn.functional.normalize(torch.tensor([0.3, 1.0, 0.0]), dim=0)  # closer to image 1 than 0
    texts = torch.stack([shared, shared, torch.tensor([0.0, 0.0, 1.0])])
    m = retrieval_metrics(torch.eye(3), texts, caption_ids=torch.tensor([7, 7, 8]), ks=(1,))
    assert m["retrieval_captions"] == 2 and m["t2i_recall@1"] == 1.0 and m["i2t_recall@1"] == 1.0
    assert retrieval_metrics(torch.eye(3), texts, ks=(1,))["t2i_recall@1"] == pytest.approx(2 / 3)  # as 3 captions


def test_zero_shot_accuracy_counts_each_image_once():
    logits = torch.tensor([[2.0, 1.0], [2.0, 1.0], [0.0, 3.0], [5.0, 0.0]])
    assert zero_shot_accuracy(logits, torch.tensor([0, 0, 1, 1])) == 0.75
    shared = zero_shot_accuracy(logits, torch.tensor([0, 0, 1, 1]), image_ids=torch.tensor([0, 0, 1, 2]))
    assert shared == pytest.approx(2 / 3)
    outputs = {"image_embeds": torch.eye(2), "text_embeds": torch.eye(2), "zero_shot_logits": torch.eye(2),
               "labels": torch.tensor([0, 1])}
    assert ContrastiveMetrics(zero_shot=True)(outputs)["zero_shot_accuracy"] == 1.0


def test_the_metrics_declare_exactly_the_names_they_return():
    """`metric_names` is what a call returns, with and without zero-shot, for other Ks too: the session checks
    --metric_for_best_model against it before training (core/evaluation.py). Zero-shot asked for on outputs without
    its logits is an error naming the fix, not a metric left out."""
    outputs = {"image_embeds": torch.eye(3), "text_embeds": torch.eye(3), "zero_shot_logits": torch.eye(3),
               "labels": torch.tensor([0, 1, 2])}
    for ks in ((1, 5, 10), (1, 2)):
        for zero_shot in (False, True):
            metrics = ContrastiveMetrics(ks, zero_shot=zero_shot)
            assert list(metrics(outputs)) == metrics.metric_names
    assert "zero_shot_accuracy" not in ContrastiveMetrics().metric_names
    with pytest.raises(ConfigError, match=r"zero_shot=True\), but the evaluation outputs hold no zero_shot_logits"):
        ContrastiveMetrics(zero_shot=True)({"image_embeds": torch.eye(2), "text_embeds": torch.eye(2)})


def test_a_metric_for_best_model_the_evaluations_never_report_is_refused_before_training(tmp_path, tiny_text):
    """The recipe's metrics declare their names, so a mistyped --metric_for_best_model is refused before the first
    step, naming what the evaluations report (before: a MetricsError at the first evaluation, after training)."""
    data = caption_folder(tmp_path / "data", {"train": 4, "test": 1})
    with pytest.raises(ConfigError, match=r"--metric_for_best_model eval_i2t_recall@l: the evaluations of this run "
                                          r"report only eval_loss, .*eval_i2t_recall@1, .*eval_zero_shot_accuracy"):
        run(tmp_path, data, tiny_text, *TINY_VISION, "--max_steps", "2", "--per_device_train_batch_size", "4",
            "--eval_strategy", "steps", "--eval_steps", "1", "--label_column_name", "colour",
            "--metric_for_best_model", "eval_i2t_recall@l")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------- per-tower training


def test_each_tower_keeps_its_lr_and_weight_decay_on_one_schedule():
    model = tiny_encoder()
    groups = tower_param_groups(model, {"head": 1.0, "vision": 0.5, "text": 0.1},
                                {"head": 0.2, "vision": 0.3, "text": 0.4})
    assert [g["name"] for g in groups] == ["head", "head_no_decay", "vision", "vision_no_decay", "text",
                                           "text_no_decay"]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(1.0, 0.2), (1.0, 0.0), (0.5, 0.3), (0.5, 0.0),
                                                             (0.1, 0.4), (0.1, 0.0)]
    assert model.logit_scale in groups[1]["params"]
    config = TrainConfig(lr_scheduler_type="cosine", warmup_steps=3, max_steps=12, report_to=["none"])
    optimizer = torch.optim.AdamW(groups)
    scheduler = build_scheduler(optimizer, config, make_plan(config, 12, 1))
    for _ in range(12):
        bases = (1.0, 1.0, 0.5, 0.5, 0.1, 0.1)
        factors = {g["lr"] / base for g, base in zip(optimizer.param_groups, bases, strict=True)}
        assert len({round(f, 12) for f in factors}) == 1  # warmup then decay, the same factor for every group
        optimizer.step()
        scheduler.step()


def test_a_frozen_tower_stays_unchanged_for_its_steps_then_trains(tmp_path, tiny_text):
    data = caption_folder(tmp_path / "data", {"train": 4, "test": 1})
    initial = load_file(tiny_text / "model.safetensors")
    common = [*TINY_VISION, "--max_steps", "2", "--warmup_steps", "0", "--per_device_train_batch_size", "6"]
    out, _ = run(tmp_path, data, tiny_text, *common, "--freeze_text_tower_steps", "2", name="frozen")
    trained = load_file(out / "model.safetensors")
    text = [k for k in trained if k.startswith("text.")]
    assert text and all(torch.equal(trained[k], initial[k.removeprefix("text.")]) for k in text)
    out, _ = run(tmp_path, data, tiny_text, *common, "--freeze_text_tower_steps", "1", name="one_step")
    after = load_file(out / "model.safetensors")
    changed = [k for k in text if not torch.equal(after[k], initial[k.removeprefix("text.")])]
    assert len(changed) > len(text) // 2  # the second step trained the text tower


# --------------------------------------------------------------------------------------------- end to end


def test_tiny_run_learns_colours_and_writes_retrieval_metrics(tmp_path, tiny_text, capsys):
    data = caption_folder(tmp_path / "data", {"train": 6, "test": 2})
    out, metrics = run(tmp_path, data, tiny_text, *TINY_VISION, "--num_train_epochs", "12", "--learning_rate", "3e-3",
                       "--text_learning_rate", "3e-3", "--freeze_text_tower_steps", "0",
                       "--per_device_train_batch_size", "6", "--logging_steps", "3", "--label_column_name", "colour",
                       "--gradient_cache_chunk_size", "4")
    results = json.loads((out / "all_results.json").read_text())
    assert results == pytest.approx(metrics)
    # 6 test images with 2 captions each: every (image, caption) pair is evaluated; the 6 captions repeat per colour
    assert (results["eval_samples"], results["eval_retrieval_images"], results["eval_retrieval_captions"]) == (12, 6, 6)
    assert results["eval_t2i_recall@1"] == results["eval_i2t_recall@1"] == 1.0
    assert results["eval_zero_shot_accuracy"] == 1.0
    declared = {f"eval_{name}" for name in recipe.build_metrics(has_classes=True).metric_names}
    assert {k for k in results if k.startswith("eval_")} - set(LOSS_METRICS) == declared
    assert results["eval_t2i_chance_recall@1"] == pytest.approx(2 / 6)
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < 0.5 * losses[0]
    assert 1 < results["logit_scale"] <= 100
    weights = load_file(out / "model.safetensors")
    assert {"logit_scale", "text_projection.weight", "vision_projection.weight"} <= set(weights)
    assert (out / "tokenizer_config.json").is_file()
    assert json.loads((out / "preprocessor_config.json").read_text())["size"] == {"height": 16, "width": 16}
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["gradient_cache_chunk_size"] == 4 and saved["data_dir"] == str(data)
    assert "eval (6 images, 6 captions): image->text R@1/5/10 100.0%" in capsys.readouterr().out


def test_the_demo_has_its_own_defaults_and_flags_still_win(tmp_path):
    config, data, _, towers = recipe.parse([])
    assert (config.num_train_epochs, towers.crop_scale_min, towers.horizontal_flip) == (2, 0.8, False)
    config, data, _, towers = recipe.parse(["--data_dir", "photos"])
    assert (config.num_train_epochs, towers.crop_scale_min, towers.horizontal_flip) == (20, 0.35, True)
    assert recipe.parse(["--num_train_epochs", "1", "--horizontal_flip", "true"])[0].num_train_epochs == 1
    (tmp_path / "c.yaml").write_text("data_dir: photos\n")
    assert recipe.parse(["--config", str(tmp_path / "c.yaml")])[0].num_train_epochs == 20


def test_demo_captions_are_generated_from_the_digit_labels():
    data = digits_with_captions()
    assert {k: len(v) for k, v in data.splits.items()} == {"train": 4000, "test": 1000}
    split = data.splits["test"]
    label = int(split.labels[0])
    word = data.class_names[label]
    assert split.fields["captions"][0] == [f"a handwritten digit {word}", f"the number {label} written by hand",
                                          f"a picture of a {word}", f"a scanned handwritten {label}"]


def test_flickr8k_mini_loads_with_five_captions_per_image():
    folder = SHARED_DATA / "flickr8k-mini"
    if not folder.is_dir():
        pytest.skip(f"{folder} is not here")
    data = load_caption_folder(folder)
    assert {k: len(v) for k, v in data.splits.items()} == {"train": 400, "test": 100}
    assert data.image_size == 224 and data.notes == ()
    assert {len(c) for c in data.splits["test"].fields["captions"]} == {5}
    ds = ImageTextDataset(data.splits["test"], 32, train=False)
    assert len(ds) == 500 and ds[7]["image_ids"] == 1
    assert ds[7]["captions"] == [data.splits["test"].fields["captions"][1][2]]


def test_dataset_name_reads_a_local_datasets_folder_with_caption_lists_and_classes(tmp_path):
    import datasets

    from accel_train.tasks.multimodal.data import ImageTextArguments, load_image_text_data

    features = datasets.Features({"image": datasets.Image(), "sentences": datasets.List(datasets.Value("string")),
                                  "kind": datasets.ClassLabel(names=["dark", "bright"])})
    (tmp_path / "hub" / "data").mkdir(parents=True)
    for split, n in (("train", 6), ("test", 2)):
        rows = {"image": [Image.new("RGB", (20, 12), (40 * i,) * 3) for i in range(n)],
                "sentences": [[f"a dark shape {i}"] if i % 2 == 0 else ["a bright patch", "a bright square"]
                              for i in range(n)],
                "kind": [i % 2 for i in range(n)]}
        datasets.Dataset.from_dict(rows, features=features).to_parquet(tmp_path / "hub" / "data" / f"{split}-0.parquet")
    args = ImageTextArguments(dataset_name=str(tmp_path / "hub"), label_column_name="kind")
    data = load_image_text_data(args, seed=0)
    assert data.class_names == ["dark", "bright"] and data.image_size == 12
    assert data.splits["train"].fields["captions"][1] == ["a bright patch", "a bright square"]
    assert data.splits["test"].fields["labels"] == [0, 1]
    item = ImageTextDataset(data.splits["test"], 12, train=False)[2]  # image 1's second caption
    assert item["pixel_values"].shape == (3, 12, 12) and item["captions"] == ["a bright square"] and item["labels"] == 1
    with pytest.raises(DataError, match="--caption_column_name text: no such column"):
        load_image_text_data(ImageTextArguments(dataset_name=str(tmp_path / "hub"), caption_column_name="text"), 0)


# -------------------------------------------------------------------------------------------- bad input


def test_a_row_without_the_caption_column_is_a_clear_error(tmp_path, tiny_text):
    data = caption_folder(tmp_path / "data", {"train": 2}, rows=[{"file_name": "red0.png", "colour": "red"}])
    with pytest.raises(DataError, match=r"metadata.jsonl:1: no caption column \(looked for .*the row has "
                                        r"\['colour', 'file_name'\]. Name it with --caption_column_name"):
        run(tmp_path, data, tiny_text)
    with pytest.raises(DataError, match=r"metadata.jsonl:1: no 'sentence' column"):
        run(tmp_path, data, tiny_text, "--caption_column_name", "sentence", name="b")


def test_an_image_missing_on_disk_is_a_clear_error(tmp_path, tiny_text):
    data = caption_folder(tmp_path / "data", {"train": 2, "test": 1})
    (data / "test" / "green0.png").unlink()
    with pytest.raises(DataError, match=r"test/metadata.jsonl:2: the image file green0.png is not on disk"):
        run(tmp_path, data, tiny_text)


def test_an_empty_caption_list_is_a_clear_error(tmp_path, tiny_text):
    rows = [{"file_name": "red0.png", "captions": ["a red square"]}, {"file_name": "red1.png", "captions": []}]
    data = caption_folder(tmp_path / "data", {"train": 2}, rows=rows)
    with pytest.raises(DataError, match=r"metadata.jsonl:2: the caption list is empty \(\[\]\)"):
        run(tmp_path, data, tiny_text)
    rows[1]["captions"] = ["  ", ""]
    (data / "train" / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"metadata.jsonl:2: the caption list is empty"):
        load_caption_folder(data)


def test_unreadable_images_are_skipped_and_reported(tmp_path):
    data = caption_folder(tmp_path / "data", {"train": 2})
    (data / "train" / "blue1.png").write_bytes(b"not a png")
    loaded = load_caption_folder(data)
    assert len(loaded.splits["train"]) == 5
    assert loaded.notes[0].startswith("skipped 1 file(s) that are not readable images: train/blue1.png")


def test_collator_pads_caption_lists_of_different_lengths(tiny_text):
    _, tokenizer = build_text_tower(str(tiny_text))
    items = [{"pixel_values": torch.zeros(3, 4, 4, dtype=torch.uint8), "captions": ["a red square"],
              "caption_ids": [0], "image_ids": 0},
             {"pixel_values": torch.zeros(3, 4, 4, dtype=torch.uint8), "captions": ["a blue patch", "a dark shape"],
              "caption_ids": [1, 2], "image_ids": 1}]
    batch = ImageTextCollator(tokenizer, 8)(items)
    assert batch["caption_input_ids"].shape[:2] == (2, 2) and batch["num_captions"].tolist() == [1, 2]
    assert batch["caption_ids"].tolist() == [[0, -1], [1, 2]]
    assert tokenizer.decode(batch["caption_input_ids"][1, 1], skip_special_tokens=True) == "a dark shape"


# ------------------------------------------------------------------------------------------ across processes


def gather_with_grad_on_rank() -> None:
    """One rank (conftest's Ranks calls it on each) of a fresh process group: rows gathered in rank order, and each
    rank's gradient the sum over ranks of the gathered rows' gradients."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((2, 3), float(rank), requires_grad=True)
    gathered, offset = gather_with_grad(x)
    assert offset == 2 * rank and gathered[:, 0].tolist() == [float(r) for r in range(world) for _ in range(2)]
    weights = torch.arange(2.0 * world * 3).view(2 * world, 3)
    (gathered * weights).sum().backward()
    assert torch.equal(x.grad, world * weights[offset:offset + 2])
    dist.destroy_process_group()


def test_gathering_with_gradients_works_in_each_process_group_a_process_holds(ranks):
    """A process that ends its process group and starts another (the session's pooled ranks; a sweep or a notebook
    training twice): torch.distributed.nn's all_gather takes the group that was the world when it was imported as
    its default, so the second group's gather failed ('not initialized in the world group map')."""
    ranks.run(gather_with_grad_on_rank)
    ranks.run(gather_with_grad_on_rank)



@pytest.mark.slow
def test_one_and_two_processes_give_the_same_losses_gradients_and_metrics(tmp_path, tiny_text, ranks):
    """SGD without momentum: the weights after 3 steps are a linear record of the gradients (Adam would hide a
    scale error). No augmentation and a norm-free ViT, so that nothing depends on how the batch is split.
    The text tower is frozen for the first step (DDP with unused parameters); the third run adds GradCache.
    1 process: `main(argv)` here; 2: the real launcher; 2 with GradCache: the session's spawned ranks."""
    data = caption_folder(tmp_path / "data", {"train": 4, "test": 2})
    common = [str(x) for x in ("--data_dir", data, "--text_model_name_or_path", tiny_text, *TINY_VIT, "--optim", "sgd",
                               "--sgd_momentum", 0, "--learning_rate", 0.5, "--max_grad_norm", 0, "--max_steps", 3,
                               "--warmup_steps", 0, "--crop_scale_min", 1, "--horizontal_flip", "false",
                               "--color_jitter", 0, "--logging_steps", 1,
                               "--freeze_text_tower_steps", 1, "--per_device_eval_batch_size", 5, *QUIET)]
    reset_accelerate()
    recipe.main([*common, "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path / "one")])
    launch(RECIPE, [*common, "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "two")], 2)
    ranks.run(recipe.main, [*common, "--per_device_train_batch_size", "4", "--gradient_cache_chunk_size", "2",
                            "--output_dir", str(tmp_path / "cache")])
    one = load_file(tmp_path / "one" / "model.safetensors")
    losses = [r["loss"] for r in read_jsonl(tmp_path / "one" / "metrics.jsonl") if "loss" in r]
    results = json.loads((tmp_path / "one" / "all_results.json").read_text())
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    for run_name in ("two", "cache"):
        other = load_file(tmp_path / run_name / "model.safetensors")
        assert max((one[k] - other[k]).abs().max().item() for k in one) < 1e-5, run_name
        other_losses = [r["loss"] for r in read_jsonl(tmp_path / run_name / "metrics.jsonl") if "loss" in r]
        assert other_losses == pytest.approx(losses, abs=1e-5), run_name
        other_results = json.loads((tmp_path / run_name / "all_results.json").read_text())
        assert other_results["eval_samples"] == results["eval_samples"] == 12  # gathered once per pair
        for key in (k for k in results if "recall" in k or "rank" in k):
            assert other_results[key] == results[key], (run_name, key)


def test_the_evaluation_loss_on_two_processes_leaves_out_the_pairs_that_even_out_the_last_batch(tmp_path, tiny_text,
                                                                                               ranks):
    """12 evaluation pairs, 1 process x 10 against 2 x 5: the last batch holds 2 real pairs, which Accelerate tops
    up on 2 processes with 8 pairs from the start of the set. Those 8 are no negatives of the real 2 (on 1 process
    the last batch is the 2 alone), so eval_loss is the same. Before, they were: 1.79 on 1 process, 2.15 on 2."""
    data = caption_folder(tmp_path / "data", {"train": 4, "test": 2})
    common = [str(x) for x in ("--data_dir", data, "--text_model_name_or_path", tiny_text, *TINY_VIT,
                               "--learning_rate", 0, "--max_steps", 1, "--per_device_train_batch_size", 4, *QUIET)]
    reset_accelerate()
    one = recipe.main([*common, "--per_device_eval_batch_size", "10", "--output_dir", str(tmp_path / "one")])
    ranks.run(recipe.main, [*common, "--per_device_eval_batch_size", "5", "--output_dir", str(tmp_path / "two")])
    two = json.loads((tmp_path / "two" / "all_results.json").read_text())
    losses = [k for k in one if k.endswith("_loss") and k.startswith(("eval_", "test_"))]
    assert "eval_loss" in losses and two["eval_samples"] == one["eval_samples"] == 12
    for key in losses:
        assert two[key] == pytest.approx(one[key], abs=1e-5), key
