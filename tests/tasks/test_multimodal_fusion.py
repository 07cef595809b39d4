"""The multimodal fusion recipe and accel_train.tasks.multimodal.

Fast tests use a 1-layer BERT built from a config (a word-level vocabulary, no download) and tiny vision towers;
across processes, the recipe's one real `accelerate launch` (2 processes, learned task weights), and on the session's
spawned gloo ranks (conftest's `ranks`) the two-stage schedule's 2-process run and the hard negatives, each against
its 1-process run in this process.
"""

import json
import math

import fusion_negatives
import multimodal_fusion as recipe
import pytest
import torch
from conftest import (
    CAPTION_WORDS,
    RECIPES,
    TINY_FUSION,
    TINY_VISION,
    caption_folder,
    launch,
    read_jsonl,
    reset_accelerate,
    text_tower_config,
)
from safetensors.torch import load_file

from accel_train import ConfigError, ModelError
from accel_train.core.evaluation import LOSS_METRICS
from accel_train.tasks.multimodal.fusion_loss import (
    FusionLoss,
    drop_tokens,
    itm_loss,
    parse_loss_weights,
    sample_negatives,
    weigh,
)
from accel_train.tasks.multimodal.fusion_metrics import (
    FusionMetrics,
    PairScorer,
    balanced_accuracy,
    rerank_ranks,
    roc_auc,
)
from accel_train.tasks.multimodal.fusion_model import FusionEncoder, vision_tokens
from accel_train.tasks.vision.models import SmallResNet
from accel_train.tasks.vision.transforms import EvalTransform

RECIPE = RECIPES / "multimodal_fusion.py"
QUIET = ["--report_to", "none", "--disable_tqdm", "--save_strategy", "no"]
TINY_VIT = ["--vision_model_type", "vit", "--vision_config_overrides", '{"patch_size": 4, "hidden_size": 16, '
            '"num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}']

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory):
    """A 1-layer BERT and its word-level tokenizer, saved like a pretrained text tower."""
    from transformers import BertModel, BertTokenizer

    path = tmp_path_factory.mktemp("tiny_text")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *CAPTION_WORDS]
    BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}).save_pretrained(path)
    torch.manual_seed(0)
    BertModel(text_tower_config()).save_pretrained(path)
    return path


def tiny_model(num_task_weights=0, seed=0, dropout=0.0):
    from transformers import BertModel

    torch.manual_seed(seed)
    return FusionEncoder(BertModel(text_tower_config(), add_pooling_layer=False),
                         SmallResNet(0, widths=(4, 8), blocks_per_stage=1), embed_dim=8, fusion_dim=8, fusion_heads=2,
                         fusion_dropout=dropout, num_task_weights=num_task_weights)


def fake_batch(n=6, k=2, length=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, len(CAPTION_WORDS) + 5, (n, k, length), generator=g)
    return {"pixel_values": torch.randint(0, 256, (n, 3, 12, 12), dtype=torch.uint8, generator=g),
            "caption_input_ids": ids, "caption_attention_mask": torch.ones_like(ids),
            "num_captions": torch.full((n,), k), "caption_ids": torch.arange(n * k).view(n, k),
            "image_ids": torch.arange(n)}


def run(tmp_path, data_dir, tiny_text, *flags, name="out"):
    out = tmp_path / name
    metrics = recipe.main(["--data_dir", str(data_dir), "--output_dir", str(out), "--text_model_name_or_path",
                           str(tiny_text), *QUIET, *TINY_FUSION, *flags])
    return out, metrics


# ------------------------------------------------------------------------------------------------ the model


def test_fusion_layers_see_only_their_own_image():
    model = tiny_model().eval()
    batch = fake_batch(n=4)
    images = EvalTransform([0.5] * 3, [0.25] * 3)(batch["pixel_values"])
    ids, mask = batch["caption_input_ids"][:, 0], batch["caption_attention_mask"][:, 0]
    mask[0, -2:] = 0  # a shorter caption: its padding must not matter either
    with torch.no_grad():
        out = model(pixel_values=images, input_ids=ids, attention_mask=mask)
        fused = model.fusion.fused(out["image_tokens"], out["text_states"], out["text_mask"])
        other = out["image_tokens"].clone()
        other[1:] = torch.randn_like(other[1:]) * 5  # every other image's features change
        changed = model.fusion.fused(other, out["text_states"], out["text_mask"])
        assert torch.equal(changed[0], fused[0])
        assert not torch.allclose(changed[1], fused[1])
        # through the whole model (eval mode: batch norm uses its running statistics, no batch mixing)
        pixels = images.clone()
        pixels[2:] = -pixels[2:]
        again = model(pixel_values=pixels, input_ids=ids, attention_mask=mask)
        logits = model.match(again["image_tokens"], again["text_states"], again["text_mask"])
        before = model.match(out["image_tokens"], out["text_states"], out["text_mask"])
        torch.testing.assert_close(logits[:2], before[:2], rtol=0, atol=1e-6)


def test_vision_tokens_pool_to_the_dual_encoder_features_and_unknown_towers_are_refused():
    tower = SmallResNet(0, widths=(4, 8), blocks_per_stage=1).eval()
    x = torch.randn(2, 3, 16, 16)
    tokens, pooled = vision_tokens(tower, x)
    assert tokens.shape == (2, 64, 8)  # 16x16 -> one stride-2 stage: an 8x8 map of 8 channels
    torch.testing.assert_close(pooled, tower.forward_features(x))
    with pytest.raises(ModelError, match="gives no feature map to fuse"):
        vision_tokens(torch.nn.Conv2d(3, 4, 3), x)


# ----------------------------------------------------------------------------------------- hard negatives


def test_a_small_resnet_run_warm_starts_the_vision_tower(tmp_path):
    from safetensors.torch import save_file

    from accel_train.deploy.factory import describe_model
    from accel_train.tasks.multimodal.dual_encoder import build_vision_tower

    torch.manual_seed(0)
    trained = SmallResNet(10, widths=(4, 8), blocks_per_stage=1, stem_stride=2)  # a classifier, as the recipe saves
    describe_model(trained).save(tmp_path)
    save_file(trained.state_dict(), tmp_path / "model.safetensors")
    tower, processor = build_vision_tower("small_resnet", str(tmp_path), 32, {"widths": [64]})  # preset ignored
    assert processor is None and tower.num_features == 8 and not isinstance(tower.head, torch.nn.Linear)
    x = torch.randn(2, 3, 32, 32)
    trained.eval(), tower.eval()
    assert torch.equal(tower(x), trained.forward_features(x))  # the same features, no head
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no model.safetensors"):
        build_vision_tower("small_resnet", str(tmp_path), 32)
    (tmp_path / "model_factory.json").write_text('{"factory": "some.module:Net", "kwargs": {}}')
    with pytest.raises(ModelError, match="the run trained some.module:Net"):
        build_vision_tower("small_resnet", str(tmp_path), 32)


def test_sampled_negatives_are_never_forbidden_and_follow_the_softmax():
    g = torch.Generator().manual_seed(0)
    similarity = torch.randn(64, 12, generator=g) * 3
    forbidden = torch.rand(64, 12, generator=g) < 0.4
    forbidden[:, 0] = True
    similarity[:, 0] = 100.0  # the forbidden favourite
    forbidden[5] = True  # a row without any allowed column
    for _ in range(50):
        index, valid = sample_negatives(similarity, forbidden, 1 - torch.rand(64, generator=g))
        assert not forbidden[valid.nonzero().squeeze(1), index[valid]].any()
        assert valid.tolist() == [i != 5 for i in range(64)]
    # one row drawn many times: the frequencies are the softmax over the allowed columns
    row, allowed = torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([True, False, False, True])
    index, _ = sample_negatives(row.expand(20000, 4), allowed.expand(20000, 4), 1 - torch.rand(20000, generator=g))
    counts = torch.bincount(index, minlength=4).float() / 20000
    expected = torch.softmax(row.masked_fill(allowed, float("-inf")), 0)
    torch.testing.assert_close(counts, expected, atol=0.015, rtol=0)


def test_hard_negatives_never_pick_the_positive_across_processes_and_match_one_process(tmp_path, ranks):
    """tests/scripts/fusion_negatives.py on 1 process (here) and on 2 (the session's spawned gloo ranks)."""
    draws = {}
    for world in (1, 2):
        out = tmp_path / str(world)
        out.mkdir()
        if world == 1:
            fusion_negatives.main(str(out))
        else:
            ranks.run(fusion_negatives.main, str(out))
        records = [json.loads((out / f"negatives_rank{r}.json").read_text()) for r in range(world)]
        draws[world] = {key: [sum((rank[key][s] for rank in records), []) for s in range(300)]
                        for key in ("caption", "image")}
        for r, rank in enumerate(records):
            b = 8 // world
            own = list(range(r * b, (r + 1) * b))
            for step in range(300):
                # [positives; hard captions; hard images]: each pair's halves come from the right global rows
                assert rank["image_rows"][step] == own + own + rank["image_rows"][step][2 * b:]
                assert rank["text_rows"][step][:b] == own and rank["text_rows"][step][2 * b:] == own
                assert rank["length"][step] == world  # padded to the longest rank's captions
    image_ids, caption_ids = [0, 1, 2, 3, 4, 5, 2, 7], [0, 1, 2, 3, 0, 5, 6, 7]
    captions_of = {0: {0}, 1: {1, 5}, 2: {2, 6}, 3: {3}, 4: {0}, 5: {5}, 7: {7}}  # image 1 also has caption 5
    images_of = {c: {i for i in captions_of if c in captions_of[i]} for c in set(caption_ids)}
    for world in (1, 2):
        for step in range(300):
            for row in range(8):
                assert draws[world]["caption"][step][row] not in captions_of[image_ids[row]]
                assert draws[world]["image"][step][row] not in images_of[caption_ids[row]]
    assert draws[1] == draws[2]  # 2 processes x 4 draw exactly what 1 process x 8 draws
    drawn = {c for step in draws[1]["caption"] for c in step}
    assert len(drawn) >= 5  # sampled, not always the same argmax


# ----------------------------------------------------------------------------------------- losses, weights


def test_itm_loss_is_the_mean_of_three_binary_cross_entropies_per_pair():
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0, 3.0, -2.0])  # 2 positives, 2 hard captions, 2 hard images
    valid = torch.tensor([True, True, True, False])
    bce = lambda z, y: -math.log(1 / (1 + math.exp(-z))) if y else -math.log(1 - 1 / (1 + math.exp(-z)))  # noqa: E731
    expected = [(bce(2.0, 1) + bce(0.5, 0) + bce(3.0, 0)) / 3, (bce(-1.0, 1) + bce(0.0, 0)) / 3]
    assert itm_loss(logits, valid).tolist() == pytest.approx(expected, rel=1e-6)


def test_uncertainty_weighting_gradient_matches_a_direct_computation():
    losses = {"itc": torch.tensor([2.0, 3.0, 4.0], requires_grad=True), "itm": torch.tensor([0.5, 0.7, 0.3],
                                                                                              requires_grad=True)}
    log_vars = torch.tensor([0.3, -0.8], requires_grad=True)
    total, weights = weigh(losses, {"itc": 1.0, "itm": 1.0}, log_vars)
    total.mean().backward()
    mean_itc, mean_itm = 3.0, 0.5
    # d/ds_t [exp(-s_t) L_t + s_t / 2] = -exp(-s_t) L_t + 1/2; d/dL_t,i = exp(-s_t) / B
    expected = [-math.exp(-0.3) * mean_itc + 0.5, -math.exp(0.8) * mean_itm + 0.5]
    assert log_vars.grad.tolist() == pytest.approx(expected, rel=1e-6)
    assert losses["itc"].grad.tolist() == pytest.approx([math.exp(-0.3) / 3] * 3, rel=1e-6)
    assert losses["itm"].grad.tolist() == pytest.approx([math.exp(0.8) / 3] * 3, rel=1e-6)
    assert weights["itm"].item() == pytest.approx(math.exp(0.8))
    # fixed weights: plain weighted sum, no learned part
    fixed, w = weigh({k: v.detach() for k, v in losses.items()}, {"itc": 1.0, "itm": 0.5}, None)
    assert fixed.tolist() == pytest.approx([2.25, 3.35, 4.15]) and float(w["itm"]) == 0.5


def test_the_loss_function_trains_the_task_weights_through_the_model(tmp_path):
    # The same gradient, end to end: FusionLoss on a FusionEncoder with learned weights.
    model = tiny_model(num_task_weights=2).train()
    with torch.no_grad():
        model.task_log_vars.copy_(torch.tensor([0.4, -0.2]))
    loss_fn = FusionLoss(EvalTransform([0.5] * 3, [0.25] * 3), None, seed=0, num_train_images=6, text_length=8)
    out = loss_fn(model, fake_batch())
    out["loss"].backward()
    log = out["log"]
    expected = [-math.exp(-0.4) * float(log["itc_loss"]) + 0.5, -math.exp(0.2) * float(log["itm_loss"]) + 0.5]
    assert model.task_log_vars.grad.tolist() == pytest.approx(expected, rel=1e-5)
    assert float(log["itm_weight"]) == pytest.approx(math.exp(0.2))
    assert out["loss"].item() == pytest.approx(math.exp(-0.4) * float(log["itc_loss"]) + 0.2
                                               + math.exp(0.2) * float(log["itm_loss"]) - 0.1, rel=1e-5)
    assert float(log["itc_grad_norm"]) > 0 and float(log["itm_grad_norm"]) > 0
    assert model.fusion.itm_head.weight.grad.abs().sum() > 0 and model.vision.stem[0].weight.grad.abs().sum() > 0


def test_task_gradient_norms_are_those_of_each_weighted_loss_at_the_vision_features():
    model = tiny_model().train()
    loss_fn = FusionLoss(EvalTransform([0.5] * 3, [0.25] * 3), None, seed=0, num_train_images=6, text_length=8,
                         weights={"itc": 2.0, "itm": 0.5}, freeze_steps={"text": -1})  # only the vision features
    torch.manual_seed(3)
    log = loss_fn(model, fake_batch())["log"]
    # by hand: the gradient of 2 * ITC alone with respect to the vision features, from a fresh graph
    from accel_train.tasks.multimodal.contrastive_loss import clip_loss

    torch.manual_seed(3)
    images = EvalTransform([0.5] * 3, [0.25] * 3)(fake_batch()["pixel_values"])
    tokens, pooled = vision_tokens(model.vision, images)
    batch = fake_batch()
    from accel_train.tasks.multimodal.contrastive_loss import draw_captions

    pick = draw_captions(batch["image_ids"], batch["num_captions"], 0, 0, 6)
    rows = torch.arange(6)
    text = model(input_ids=batch["caption_input_ids"][rows, pick],
                 attention_mask=batch["caption_attention_mask"][rows, pick])
    image_embeds = torch.nn.functional.normalize(model.vision_projection(pooled), dim=-1)
    itc = clip_loss(image_embeds, text["text_embeds"], text["logit_scale"], batch["image_ids"],
                    batch["caption_ids"][rows, pick])[0]
    (grad,) = torch.autograd.grad(2.0 * itc, tokens)
    assert float(log["itc_grad_norm"]) == pytest.approx(grad.norm().item(), rel=1e-4)
    assert float(log["itc_weight"]) == 2.0 and float(log["itm_weight"]) == 0.5


def test_two_stages_train_itc_then_only_the_fusion_half_on_itm():
    class Clock:
        step, epoch = 0, 0

    model, transform = tiny_model().train(), EvalTransform([0.5] * 3, [0.25] * 3)
    loss_fn = FusionLoss(transform, transform, seed=0, num_train_images=6, text_length=8, clock=Clock(),
                         contrastive_steps=2)
    fusion = {n for n, _ in model.named_parameters() if n.startswith("fusion.")}
    for step, stage in ((0, "itc"), (1, "itc"), (2, "itm"), (9, "itm")):
        Clock.step = step
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        model.zero_grad(set_to_none=True)
        out = loss_fn(model, fake_batch())
        out["loss"].backward()
        log = out["log"]
        trained = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        if stage == "itc":  # ITC alone: no ITM logits computed, the fusion half gets no gradient at all
            assert any(n.startswith("vision.") and not torch.equal(b, buffers[n]) for n, b in model.named_buffers())
            assert not trained & fusion and {"vision_projection.weight", "logit_scale"} <= trained
            assert out["loss"].item() == pytest.approx(float(log["itc_loss"]))
            assert float(log["itm_loss"]) == 0 and float(log["itm_weight"]) == 0
        else:  # ITM alone: only fusion parameters have a gradient (AdamW skips the rest: grad None)
            assert trained and trained <= fusion
            assert all(p.grad is None for n, p in model.named_parameters() if n not in fusion)
            # the fixed vision tower's batch norms neither use nor move batch statistics: ITC stays as it was
            moved = [n for n, b in model.named_buffers() if not torch.equal(b, buffers[n])]
            assert not [n for n in moved if n.startswith("vision.")]
            assert out["loss"].item() == pytest.approx(float(log["itm_loss"]))
            assert float(log["itc_loss"]) > 0 and float(log["itc_weight"]) == 0  # still logged
    model.eval()  # evaluation scores both tasks, whatever the stage
    assert set(loss_fn(model, fake_batch())) >= {"per_sample_loss", "image_tokens"}
    with pytest.raises(ConfigError, match="--contrastive_steps 3 with --loss_weighting uncertainty"):
        recipe.parse(["--contrastive_steps", "3", "--loss_weighting", "uncertainty"])
    with pytest.raises(ConfigError, match="--contrastive_steps -1"):
        recipe.parse(["--contrastive_steps", "-1"])


def test_loss_weight_flags_are_checked():
    assert parse_loss_weights("itc=1, itm=0.25") == {"itc": 1.0, "itm": 0.25}
    for bad in ("itc=1", "itc=1,itm=x", "itc=0,itm=0", "itc=1,itm=-1", "itc=1,itm=1,mlm=1"):
        with pytest.raises(ConfigError, match="--loss_weights"):
            parse_loss_weights(bad)
    with pytest.raises(ConfigError, match="learned weights replace the fixed ones"):
        recipe.parse(["--loss_weighting", "uncertainty", "--loss_weights", "itc=1,itm=2"])
    with pytest.raises(ConfigError, match="--loss_weighting 'learned': choose fixed or uncertainty"):
        recipe.parse(["--loss_weighting", "learned"])
    with pytest.raises(ConfigError, match="--token_dropout 1.0"):
        recipe.parse(["--token_dropout", "1"])


def test_token_dropout_hides_tokens_but_never_the_first_and_last():
    torch.manual_seed(0)
    mask = torch.ones(200, 10, dtype=torch.long)
    mask[:, 7:] = 0  # 7 real tokens: [CLS] w w w w w [SEP]
    dropped = drop_tokens(mask, 0.5)
    assert dropped[:, 0].all() and dropped[:, 6].all() and not dropped[:, 7:].any()
    assert 0.4 < dropped[:, 1:6].float().mean() < 0.6


# ------------------------------------------------------------------------------------------------ metrics


def test_auc_and_balanced_accuracy_on_hand_made_scores():
    labels = torch.tensor([1, 1, 1, 0, 0, 0, 0, 0, 0])
    scores = torch.tensor([3.0, 0.5, -1.0, 1.0, -2.0, -3.0, -0.5, -4.0, -5.0])
    # positive 3.0 beats all 6 negatives, 0.5 beats 5, -1.0 beats 4: (6 + 5 + 4) / 18
    assert roc_auc(scores, labels) == pytest.approx(15 / 18)
    assert roc_auc(torch.tensor([1.0, 1.0]), torch.tensor([1, 0])) == 0.5  # ties count half
    assert math.isnan(roc_auc(scores, torch.ones(9)))
    # at logit 0: positives 2 of 3 above, negatives 5 of 6 below
    assert balanced_accuracy(scores, labels) == pytest.approx((2 / 3 + 5 / 6) / 2)


def test_rerank_ranks_order_the_candidates_by_itm_and_keep_the_itc_rank_beyond_k():
    similarity = torch.tensor([[0.9, 0.8, 0.7, 0.1], [0.9, 0.8, 0.7, 0.6], [0.1, 0.2, 0.9, 0.8]])
    positive = torch.tensor([[False, True, False, False], [False, False, False, True], [False, False, True, True]])
    top = similarity.topk(3, 1).indices  # row 1's positive (column 3) is outside its top 3
    itm = torch.tensor([[0.0, 5.0, 1.0], [9.0, 9.0, 9.0], [2.0, 3.0, 1.0]]).flatten()  # in top order
    ranks = rerank_ranks(similarity, positive, top, itm)
    # row 0: candidates 0, 1, 2 scored 0, 5, 1 -> its positive (1) first; row 1: ITC rank 4; row 2: candidates
    # 2, 3, 1 scored 2, 3, 1 -> positive 3 first
    assert ranks.tolist() == [1, 4, 1]


class TableModel(torch.nn.Module):
    """A stand-in for FusionEncoder: match(image i, caption c) = table[i, c] (ids carried in the features)."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)
        self.logit_scale, self.max_log_scale = torch.nn.Parameter(torch.tensor(0.0)), 1.0  # ITC logit = cosine
        self.calls = 0

    def match(self, image_tokens, text_states, text_mask):
        self.calls += len(image_tokens)
        return self.table[image_tokens[:, 0, 0].long(), text_states[:, 0, 0].long()]


def test_fusion_metrics_rerank_and_score_itm_pairs_once(tmp_path):
    # 3 images with 2 captions each (pairs 0..5). ITC ranks image 0's captions last; ITM knows better.
    image_ids, caption_ids = torch.tensor([0, 0, 1, 1, 2, 2]), torch.arange(6)
    image_embeds = torch.eye(3)[image_ids]
    text_embeds = torch.tensor([[0, 0, 1], [0, 0, 1], [0, 1, 0], [0, 1, 0], [1, 0, 0], [1, 0, 0.0]])
    table = torch.full((3, 6), -1.0)
    table[image_ids, caption_ids] = 2.0
    model = TableModel(table)
    outputs = {"image_embeds": image_embeds, "text_embeds": text_embeds, "image_ids": image_ids,
               "caption_ids": caption_ids, "image_tokens": image_ids.float()[:, None, None].expand(6, 2, 3),
               "text_states": caption_ids.float()[:, None, None].expand(6, 4, 3), "text_mask": torch.ones(6, 4)}
    metrics_fn = FusionMetrics(model, ks=(1, 2), rerank_k=4, seed=0)
    m = metrics_fn(outputs)
    assert sorted(m) == sorted(metrics_fn.metric_names)  # declared: a wrong --metric_for_best_model is refused early
    # ITC: image 0 finds captions 4, 5 first (image 2's), image 1 its own, image 2 captions 0, 1 first
    assert m["i2t_recall@1"] == pytest.approx(1 / 3)
    assert m["rerank_i2t_recall@1"] == 1.0 and m["rerank_t2i_recall@1"] == 1.0 and m["rerank_k"] == 3
    # ITM (+2 / -1) outweighs the ITC cosine (0 / 1) in BLIP's sum too
    assert m["rerank_sum_i2t_recall@1"] == 1.0 and m["rerank_sum_t2i_median_rank"] == 1.0
    assert m["itm_auc_random"] == m["itm_auc_hard"] == 1.0 and m["itm_accuracy_hard"] == 1.0
    assert m["itc_auc_hard"] < 0.5
    # every distinct pair scored once: at most 3 x 6 pairs exist
    assert model.calls <= 18
    scorer = PairScorer(model, outputs["image_tokens"][[0, 2, 4]], outputs["text_states"], outputs["text_mask"])
    lookup = scorer(torch.tensor([[0, 0], [1, 5], [0, 0]]))  # image 1 with image 2's caption; a duplicate
    assert lookup(torch.tensor([[1, 5], [0, 0]])).tolist() == [-1.0, 2.0]


# ------------------------------------------------------------------------------------------------- recipe


def test_recipe_trains_itm_on_colours_and_writes_everything(tmp_path, tiny_text, capsys):
    data = caption_folder(tmp_path / "data", {"train": 8, "test": 2})
    out, results = run(tmp_path, data, tiny_text, *TINY_VISION, "--max_steps", "60", "--learning_rate", "3e-3",
                       "--fusion_learning_rate", "1e-2",
                       "--per_device_train_batch_size", "12", "--crop_scale_min", "1", "--horizontal_flip", "false",
                       "--logging_steps", "5", "--freeze_text_tower_steps", "0", "--loss_weighting", "uncertainty",
                       "--token_dropout", "0.1")
    assert results["eval_itm_auc_random"] > 0.9 and results["eval_rerank_i2t_recall@1"] == 1.0
    declared = {f"eval_{name}" for name in FusionMetrics(None).metric_names}  # the recipe's Ks
    assert {k for k in results if k.startswith("eval_")} - set(LOSS_METRICS) == declared
    assert {"eval_itm_auc_hard", "eval_itc_auc_hard", "eval_itm_accuracy_random", "eval_rerank_t2i_median_rank",
            "itc_weight", "itm_weight", "logit_scale"} <= set(results)
    assert json.loads((out / "all_results.json").read_text())["itm_weight"] == results["itm_weight"] != 1.0
    task_log = [r for r in read_jsonl(out / "metrics.jsonl") if "itm_loss" in r]  # the loss's "log" terms
    assert [r["step"] for r in task_log] == list(range(5, 61, 5))
    assert {"itc_loss", "itm_loss", "itc_weight", "itm_weight", "itc_grad_norm", "itm_grad_norm"} <= set(task_log[0])
    assert task_log[-1]["itm_loss"] < task_log[0]["itm_loss"]
    weights = load_file(out / "model.safetensors")
    assert {"task_log_vars", "fusion.itm_head.weight", "fusion.layers.1.cross_attention.in_proj_weight"} <= set(weights)
    assert "re-ranked by ITM (top 6)" in capsys.readouterr().out


def test_the_demo_has_its_own_defaults_and_accumulation_is_refused(tmp_path, tiny_text):
    config, _, model, tasks, towers = recipe.parse([])
    assert (config.num_train_epochs, towers.crop_scale_min, towers.horizontal_flip) == (2, 0.8, False)
    assert (model.fusion_layers, tasks.loss_weights, tasks.loss_weighting, towers.token_dropout) == (
        2, "itc=1,itm=1", "fixed", 0.0)
    assert recipe.parse(["--data_dir", "photos"])[0].num_train_epochs == 20
    data = caption_folder(tmp_path / "data", {"train": 4, "test": 1})
    with pytest.raises(ConfigError, match=r"--gradient_accumulation_steps 2: .*raise --per_device_train_batch_size"):
        run(tmp_path, data, tiny_text, *TINY_VISION, "--gradient_accumulation_steps", "2")


def test_a_metric_for_best_model_the_evaluations_never_report_is_refused_before_training(tmp_path, tiny_text):
    """FusionMetrics declares its names, so a mistyped --metric_for_best_model is refused before the first step
    (before: a MetricsError at the first evaluation, after training)."""
    data = caption_folder(tmp_path / "data", {"train": 4, "test": 1})
    with pytest.raises(ConfigError, match=r"--metric_for_best_model eval_rerank_i2t_recall@l: the evaluations of this "
                                          r"run report only eval_loss, .*eval_rerank_i2t_recall@1, .*eval_rerank_k"):
        run(tmp_path, data, tiny_text, *TINY_VISION, "--max_steps", "2", "--per_device_train_batch_size", "4",
            "--eval_strategy", "steps", "--eval_steps", "1",
            "--metric_for_best_model", "eval_rerank_i2t_recall@l")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_label_smoothing_is_refused_by_the_fusion_loss_before_anything_is_written(tmp_path, tiny_text):
    data = caption_folder(tmp_path / "data", {"train": 4, "test": 1})
    with pytest.raises(ConfigError, match=r"--label_smoothing_factor 0.1: .*no label smoothing.*drop"):
        run(tmp_path, data, tiny_text, *TINY_VISION, "--max_steps", "1", "--label_smoothing_factor", "0.1")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ------------------------------------------------------------------------------------------ across processes


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["uncertainty", "two_stage"])
def test_one_and_two_processes_give_the_same_weights_and_metrics(tmp_path, tiny_text, schedule, ranks):
    """SGD without momentum: the weights after 3 steps are a linear record of the gradients (Adam would hide a
    scale error). No augmentation, no dropout and a norm-free ViT, so nothing depends on how the batch is
    split. The text tower is frozen for the first step (DDP with unused parameters); learned task weights, or
    the two-stage schedule (step 1 leaves the fusion half idle, steps 2-3 the towers and projections).
    1 process: `main(argv)` here. 2 processes: the recipe's real launch for learned task weights, the session's
    spawned ranks for the two-stage schedule (the launcher is proven once)."""
    data = caption_folder(tmp_path / "data", {"train": 4, "test": 2})
    tasks = ["--loss_weighting", "uncertainty"] if schedule == "uncertainty" else ["--contrastive_steps", "1"]
    common = [str(x) for x in ("--data_dir", data, "--text_model_name_or_path", tiny_text, *TINY_VIT, *TINY_FUSION,
                               "--fusion_dropout", 0, "--optim", "sgd", "--sgd_momentum", 0, "--learning_rate", 0.5,
                               "--max_grad_norm", 0, "--max_steps", 3, "--warmup_steps", 0, "--crop_scale_min", 1,
                               "--horizontal_flip", "false", "--color_jitter", 0, "--logging_steps", 1,
                               "--freeze_text_tower_steps", 1, "--per_device_eval_batch_size", 5,
                               *tasks, "--rerank_k", 3, *QUIET)]
    reset_accelerate()
    recipe.main([*common, "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path / "one")])
    two_processes = [*common, "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "two")]
    if schedule == "uncertainty":
        launch(RECIPE, two_processes, 2)
    else:
        ranks.run(recipe.main, two_processes)
    one, two = (load_file(tmp_path / name / "model.safetensors") for name in ("one", "two"))
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
    if schedule == "uncertainty":
        assert (one["task_log_vars"] != 0).all()  # the weights did train
    losses = [[r["loss"] for r in read_jsonl(tmp_path / n / "metrics.jsonl") if "loss" in r] for n in ("one", "two")]
    assert len(losses[0]) == 3 and losses[1] == pytest.approx(losses[0], abs=1e-5)
    logs = [[r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "itm_loss" in r] for name in ("one", "two")]
    for key in ("itc_grad_norm", "itm_grad_norm", "itc_weight", "itm_weight"):  # global quantities
        assert [r[key] for r in logs[1]] == pytest.approx([r[key] for r in logs[0]], rel=1e-4, abs=1e-7), key
    if schedule == "two_stage":
        assert [r["itm_weight"] for r in logs[0]] == [0, 1, 1]
    results = [json.loads((tmp_path / name / "all_results.json").read_text()) for name in ("one", "two")]
    assert results[0]["eval_samples"] == results[1]["eval_samples"] == 12  # gathered once per pair
    for key in (k for k in results[0] if any(s in k for s in ("recall", "rank", "auc", "accuracy"))):
        assert results[1][key] == results[0][key], key


def test_the_evaluation_loss_on_two_processes_leaves_out_the_pairs_that_even_out_the_last_batch(tmp_path, tiny_text,
                                                                                               ranks):
    """12 evaluation pairs, 1 process x 10 against 2 x 5: on 2 processes Accelerate tops the last batch's 2 real
    pairs up with 8 from the start of the set. They are neither ITC negatives nor drawn as ITM hard negatives of the
    real 2, so eval_loss (and the metrics) are those of 1 process."""
    data = caption_folder(tmp_path / "data", {"train": 4, "test": 2})
    common = [str(x) for x in ("--data_dir", data, "--text_model_name_or_path", tiny_text, *TINY_VIT, *TINY_FUSION,
                               "--fusion_dropout", 0, "--learning_rate", 0, "--max_steps", 1,
                               "--per_device_train_batch_size", 4, "--rerank_k", 3, *QUIET)]
    reset_accelerate()
    one = recipe.main([*common, "--per_device_eval_batch_size", "10", "--output_dir", str(tmp_path / "one")])
    ranks.run(recipe.main, [*common, "--per_device_eval_batch_size", "5", "--output_dir", str(tmp_path / "two")])
    two = json.loads((tmp_path / "two" / "all_results.json").read_text())
    assert "eval_loss" in one and two["eval_samples"] == one["eval_samples"] == 12
    evaluated = [k for k in one if k.startswith(("eval_", "test_"))]
    for key in (k for k in evaluated if k.endswith("_loss") or any(s in k for s in ("recall", "rank", "auc", "acc"))):
        assert two[key] == pytest.approx(one[key], abs=1e-5), key
