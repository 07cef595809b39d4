"""The paragraph each failed check gets: from what was measured, the likely cause class and what to change in the
user's code. The classes are read from the size and place of the first difference, which is evidence, not proof:
each paragraph says what it rests on.
"""

from __future__ import annotations

import math

# A difference this small (relative, the largest over the compared steps) is floating-point reduction order, not
# other data or other numbers: a sample or a dropout mask changes a step's loss by far more.
KERNEL_NOISE = 1e-4

DATA_OR_OWN_RNG = (
    "Likely cause: data order or random numbers the library does not seed. The seeded generators (Python's random, "
    "numpy's and torch's global ones) were in the same state in both runs at the checkpoint, so the difference "
    "comes from what the script draws or orders by itself: a dataset built by iterating a set or dict of strings "
    "(their order changes with each process: PYTHONHASHSEED), files in os.listdir / glob order, an order or noise "
    "taken from time, or augmentation from a generator made without a seed (random.Random(), "
    "np.random.default_rng(), torch.Generator() seeded from the clock). What to change: sort what you iterate "
    "(sorted(set(...))); draw random augmentation from the global generators inside a dataset wrapped in "
    "accel_train.SeededItems(dataset, config.seed), or seed your own generator from config.seed.")
FIRST_STEP = (
    " The first step differs already, so the initial weights may be what differs: a model built before the "
    "generators are seeded (build it after build_accelerator(config), which seeds them from --seed, or let train() "
    "build the accelerator) or initialised from a generator of its own.")
SEEDED_RNG = (
    "Likely cause: dropout / RNG. The seeded generators were in different states in the two runs at the checkpoint "
    "({generators}): the script reseeds them from something that changes (time, os.urandom, a process id), or draws "
    "from them a number of times that changes between runs. What to change: let train() seed them (--seed); do not "
    "call torch.manual_seed / np.random.seed / random.seed with a changing value.")
KERNEL = (
    "Likely cause: a nondeterministic kernel. The losses differ by at most {relative:.1e} relative, the size of "
    "floating-point reduction order, not of other data or other random numbers. What to change: on a GPU call "
    "torch.use_deterministic_algorithms(True) and set CUBLAS_WORKSPACE_CONFIG=:4096:8 (an error then names the op "
    "without a deterministic version: index_add_, scatter_add_, an embedding's backward ...); avoid "
    "torch.backends.cudnn.benchmark; a compiled model (--torch_compile) may choose other kernels per process.")


def _where(measured: dict) -> str:
    first = measured.get("first_loss_difference")
    tensors = ", ".join(f"{row['tensor']} (max |difference| {row['max_abs']:.3g})"
                        for row in measured.get("largest_differences", []))
    if first:
        where = f"The logged losses first differ at step {first['step']} ({first['loss'][0]} against " \
                f"{first['loss'][1]}, {first['relative']:.2e} relative)"
    else:
        where = "The logged losses are equal"
    return f"{where}; the final weights differ most in {tensors or '(no tensor)'}."


def determinism_cause(measured: dict) -> tuple[str, str]:
    """(cause class, paragraph) for two runs of the same command that differ."""
    first = measured.get("first_loss_difference")
    generators = measured.get("generators_differing_at_checkpoint") or []
    where = _where(measured)
    if generators:
        return "dropout / RNG", f"{where} {SEEDED_RNG.format(generators=', '.join(generators))}"
    # the largest difference over the compared steps, not the first alone: a step of other data may by chance move
    # the loss by little, but not every step does
    relative = measured.get("largest_loss_relative", first["relative"] if first else 0.0)
    if relative <= KERNEL_NOISE:
        return "nondeterministic kernel", f"{where} {KERNEL.format(relative=relative)}"
    start = FIRST_STEP if first and first["step"] == 1 else ""
    return "data order / unseeded RNG", f"{where} {DATA_OR_OWN_RNG}{start}"


def resume_cause(measured: dict) -> tuple[str, str]:
    """(cause class, paragraph) for a resumed run that differs from the uninterrupted one (which is deterministic)."""
    first = measured.get("first_loss_difference")
    resumed_from = measured.get("resumed_from_step")
    parts = [_where(measured)]
    if measured.get("optimizer_differing"):
        parts.append(f"The optimizer state at the last checkpoint differs in "
                     f"{', '.join(measured['optimizer_differing'])}.")
    if measured.get("generators_differing"):
        parts.append(f"The generators' states at the last checkpoint differ: "
                     f"{', '.join(measured['generators_differing'])}.")
    if first and first["step"] == resumed_from + 1:
        parts.append(
            f"The first step after the resume (step {first['step']}) already differs: the resumed run fed other "
            "data or other random numbers than the uninterrupted run did there. Likely cause: random augmentation "
            "drawn in the dataset from the global generators (the loader fetches ahead, so the items after a "
            "checkpoint draw other numbers once resumed), or a sampler / iterable dataset whose position the "
            "checkpoint does not hold. What to change: wrap the dataset in accel_train.SeededItems(dataset, "
            "config.seed) so each item's numbers come from (seed, epoch, index); use the loader's own shuffling or a "
            "sampler with set_epoch.")
        return "data / RNG after resume", " ".join(parts)
    if measured.get("optimizer_differing") and not first:
        parts.append("Likely cause: state the checkpoint does not hold: an optimizer, scheduler or a module's "
                     "buffers changed outside what train() saves. Pass the optimizer and scheduler to train() and "
                     "keep state in registered buffers.")
        return "state outside the checkpoint", " ".join(parts)
    parts.append("Likely cause: state outside the checkpoint that the steps after the resume depend on (a counter, "
                 "a cache or a generator of the script's own, kept in a module-level variable). What to change: "
                 "derive it from the training state (the step), or keep it in the model's buffers.")
    return "state outside the checkpoint", " ".join(parts)


BATCH_NORM_ACCUMULATION = "per-micro-batch batch statistics (BatchNorm): a property of the model, not a bug"


def accumulation_cause(measured: dict) -> tuple[str, str]:
    """(cause class, paragraph) for k accumulated micro-batches that do not make the step one batch of kB makes."""
    k = measured["accumulation_steps"]
    loss_micro, loss_full = measured["loss"]
    norm_micro, norm_full = measured["grad_norm"]
    ratio = norm_micro / norm_full if norm_micro is not None and norm_full else math.nan
    where = (f"With {k} micro-batches of {measured['micro_batch']} accumulated, step 1 logs loss {loss_micro} and "
             f"grad_norm {norm_micro}; with one batch of {k * measured['micro_batch']}, loss {loss_full} and grad_norm "
             f"{norm_full} (gradient ratio {ratio:.4g}).{direction_sentence(measured)}")
    layers = measured.get("batch_norm_layers") or []
    if layers:
        return BATCH_NORM_ACCUMULATION, (
            f"{where} The model has batch norm layers ({', '.join(layers[:4])}): in training each micro-batch is "
            f"normalised by its own statistics (over {measured['micro_batch']} examples, not "
            f"{k * measured['micro_batch']}), so k accumulated micro-batches compute other activations and "
            "gradients than one batch. Accumulation does not make one batch's step for this model by design: "
            "reported as a property, not a failure (it does not make the exit code 1). What to change, if the steps "
            "must agree: a per-example norm (LayerNorm, GroupNorm), or no accumulation (a larger micro-batch). The "
            "batch statistics hide any other difference here (a per-micro-batch loss normalisation, random "
            "augmentation per micro-batch).")
    if math.isclose(ratio, 1 / k, rel_tol=0.02):
        return "loss scaled by the accumulation count", (
            f"{where} The accumulated gradient is 1/{k} of the batch's: the loss is divided by the accumulation "
            "count by hand, and the loop already averages the micro-batches' losses. What to change: return the "
            "micro-batch's mean loss, without dividing by gradient_accumulation_steps.")
    if math.isclose(ratio, k, rel_tol=0.02):
        return "loss summed over micro-batches", (
            f"{where} The accumulated gradient is {k} times the batch's: the loss is multiplied by the accumulation "
            "count, or summed where it should be averaged. What to change: return the micro-batch's mean loss.")
    if abs(ratio - 1) < 0.01:
        return "dropout or per-micro-batch normalisation", (
            f"{where} A difference this small (under 1 %) is what dropout makes: each micro-batch draws its own "
            "masks, so k micro-batches never match one batch while dropout is on. What to change: nothing, if the "
            "model has dropout; to check the accumulation itself, rerun verify with the dropout off for its "
            "accumulation runs only (--accumulation_args '--config_overrides hidden_dropout_prob=0,"
            "attention_probs_dropout_prob=0' for the recipes' transformers models). If it still fails, a loss "
            "normalised per micro-batch over a count that changes with the split (a token mean over variable-length "
            "rows) returns {'loss_sum': sum, 'num_items': count} instead.")
    return "normalisation per micro-batch", (
        f"{where} Likely cause: a loss normalised per micro-batch over a count that changes with the split (a token "
        "mean over variable-length rows: return a token sum and a count, which the loop divides over the whole "
        "window), a BatchNorm whose statistics depend on the micro-batch, or dropout (each micro-batch draws its "
        "own masks: rerun with dropout 0 to tell). What to change: a per-token loss returns {'loss_sum': sum, "
        "'num_items': count}.")


OTHER_EXAMPLES = "step 1 held other examples: the order depends on the batch size"


def accumulation_examples_cause(measured: dict) -> tuple[str, str]:
    """(cause class, paragraph) for k micro-batches whose step held other examples than the one batch of kB."""
    k, batch = measured["accumulation_steps"], measured["micro_batch"]
    only = measured["examples_only_in"]
    return OTHER_EXAMPLES, (
        f"With {k} micro-batches of {batch} accumulated, step 1 fed other dataset examples than one batch of "
        f"{k * batch} did (indices only in the micro-batches: {only['micro-batches']}; only in the one batch: "
        f"{only['one batch']}; read from what each run fed, ACCEL_TRAIN_RECORD_FED). The loss and gradient figures "
        "compare other data, so they prove nothing either way. Likely cause: the training order is built per "
        "micro-batch (a sampler or batch sampler that groups, sorts or buckets by --per_device_train_batch_size), so "
        "accumulation changes which examples make an optimizer step. What to change: group by the optimizer step's "
        "batch (per-device batch x processes x gradient_accumulation_steps), as accel_train.make_loader's length "
        "grouping and the Trainer's do, or build the order independently of the batch size.")


def direction_sentence(measured: dict) -> str:
    """' Step 1's gradients differ by ... (cosine ...).', from the recorded gradients (verify/gradients.py), or ''."""
    if "gradient_relative" not in measured:
        return ""
    return (f" Step 1's whole gradients, as the optimizer is given them, differ by {measured['gradient_relative']:.2e} "
            f"of the reference side's norm (cosine {measured['gradient_cosine']:.6f}).")


GRADIENT_DIRECTION = "gradient direction: examples weighted or paired differently"


def direction_cause(measured: dict, sides: str) -> tuple[str, str]:
    """(cause class, paragraph) for two runs (`sides`: "k accumulated micro-batches and one batch", "1 process and
    2") whose step-1 loss and gradient norm agree and whose gradients point elsewhere."""
    return GRADIENT_DIRECTION, (
        f"{sides[0].upper()}{sides[1:]} log the same step-1 loss and gradient norm, but the gradients point elsewhere:"
        f"{direction_sentence(measured)} Equal totals with another direction mean the examples were weighted or "
        "paired differently when the batch was split: rows reordered or shifted within the batch without their "
        "labels (a collator that sorts rows by length and leaves the labels in place, a shift along the batch axis "
        "instead of the sequence axis), a weighting that depends on the micro-batch's or process's own rows (a "
        "per-batch normalisation of sample weights, in-batch targets), or augmentation drawn per split. What to "
        "change: make each example's loss a function of that example alone (its inputs with its own labels), and "
        "let the loop average over the window and the processes.")


BATCH_NORM = "per-process batch statistics (BatchNorm): a property of the model, not a bug"


def world_size_cause(measured: dict) -> tuple[str, str]:
    """(cause class, paragraph) for 1 process and 2 at the same global batch that train differently."""
    first, rate = measured.get("first_loss_difference"), measured.get("first_learning_rate_difference")
    where = (f"At the same global batch ({measured.get('global_batch')}), 1 process and 2 log losses that first differ "
             f"at step {first['step']} ({first['loss'][0]} against {first['loss'][1]}, {first['relative']:.2e} "
             "relative)" if first else "The logged losses agree")
    where += f"; the final weights differ by up to {measured.get('weights_relative', 0.0):.2e} of their largest value."
    where += direction_sentence(measured)
    layers = measured.get("batch_norm_layers") or []
    if layers:
        return BATCH_NORM, (
            f"{where} The model has batch norm layers ({', '.join(layers[:4])}): in training each process normalises "
            "by the statistics of its own micro-batch (half of the 1-process batch), so 2 processes compute other "
            "activations and gradients from the first step. World-size invariance does not hold for this model by "
            "design: reported as a property, not a failure (it does not make the exit code 1). What to change, if "
            "the runs must agree: torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) (statistics over every "
            "process; GPU only), or a per-example norm (LayerNorm, GroupNorm). The batch statistics hide any other "
            "difference here: the data-accounting check looks at the sharding of the data independently.")
    if rate:
        return "schedule counted in processes", (
            f"{where} The learning rates differ from step {rate['step']} ({rate['learning_rate'][0]} against "
            f"{rate['learning_rate'][1]}): the schedule advances with the number of processes. Likely cause: a "
            "scheduler prepared by Accelerate steps once per process unless split_batches is set, or warmup / total "
            "steps computed from the per-process loader's length. What to change: pass the scheduler to train() "
            "(it is stepped once per optimizer step), or count its steps in optimizer steps of the global batch.")
    if first and first["step"] == 1:
        small = first["relative"] < 1e-2
        return ("dropout or per-process normalisation" if small else "per-process normalisation or data"), (
            f"{where} Step 1 differs, before any update: the two runs computed another loss from the same weights. "
            "Likely causes: a loss or metric normalised by the process's own sizes (a per-token mean over "
            "variable-length rows taken per process, a mean over the local batch size); statistics over the "
            "micro-batch (a normalisation layer or loss term of your own); data that is not sharded (every process "
            "feeding the same examples: see the data-accounting check); dropout, whose masks each process draws for "
            "its own rows" + (" (a difference under 1 %, as here, is the size dropout makes)" if small else "")
            + ". What to change: a per-token loss returns {'loss_sum': sum, 'num_items': count} (the loop divides "
            "by the count over every process); shard the data with the loader train() prepares (no sampler of "
            "your own that ignores the process); to tell dropout, rerun verify with it off for these runs only "
            "(--world_size_args '--config_overrides hidden_dropout_prob=0,attention_probs_dropout_prob=0' for the "
            "recipes' transformers models).")
    return "update differs across processes", (
        f"{where} Step 1 agrees and a later step does not: the first updates differ. Likely cause: state each "
        "process updates on its own (a buffer or a counter in the model, gradients modified by hand before "
        "accelerator.backward's all-reduce, a gradient clipped per process), or accumulation windows that end at "
        "other micro-batches. What to change: keep state in the model's parameters / registered buffers and change "
        "gradients only through the loss.")


# The data-accounting findings, most telling first: (kind, cause class, what to change).
ACCOUNTING = (
    ("length", "__len__ smaller than the data", "make __len__ return the number of items __getitem__ serves (and "
     "__getitem__ raise IndexError past it); a dataset that repeats its items on purpose repeats them in a sampler "
     "or with --num_train_epochs instead"),
    ("last_item", "__len__ larger than the data", "make __len__ return the number of items __getitem__ serves"),
    ("rows", "items dropped between the sampler and the loss", "filter the data before the loader (a datasets "
     "filter(), a Subset of the indices to keep), not in the collator: the sampler, the epoch length, the examples "
     "counted and each process's share of the mean all assume every index drawn is fed"),
    ("outside", "indices outside the dataset", "give the loader a sampler that draws from range(len(dataset))"),
    ("coverage", "data not sharded across processes", "let train() prepare the loader (Accelerate shards a "
     "DataLoader's sampler over the processes); a sampler or an iterable dataset of your own must split by "
     "accelerator.process_index / num_processes, and give each example once per epoch"),
    ("replay", "data order not replayed after the resume", "draw the order from the epoch (the loader's own "
     "shuffling, or a sampler with set_epoch(epoch) seeded from --seed), not from a generator of your own"),
    ("positions", "data position lost at the resume", "resume with --resume_from_checkpoint and the loader train() "
     "prepared; a loader rebuilt or re-iterated by hand must skip the micro-batches the checkpoint consumed"),
    ("unrecorded", "data not recorded", "train with accel_train.train() on every process"),
)


def accounting_cause(findings: list[dict]) -> tuple[str, str]:
    """(cause classes, paragraph) for the data-accounting findings (accounting.py): each kind found, most telling
    first, joined by "; " (independent evidence: a run may hold several of them)."""
    kinds = [kind for kind, _, _ in ACCOUNTING]
    found = sorted({f["kind"] for f in findings}, key=kinds.index)
    said = " ".join(f["sentence"] for f in findings[:6]) + (f" ({len(findings) - 6} more findings in the "
                                                          "certificate.)" if len(findings) > 6 else "")
    causes = [ACCOUNTING[kinds.index(kind)] for kind in found]
    advice = " ".join(f"Likely cause: {cause}. What to change: {change}." for _, cause, change in causes)
    return "; ".join(cause for _, cause, _ in causes), f"{said} {advice}"


EVALUATION_RANDOM = "evaluation not deterministic (dropout or randomness in eval)"
EVALUATION_BATCH = "outputs depend on the batch (padding or batch statistics)"
EVALUATION_GATHER = "metric computed before gathering (per process)"
EVALUATION_WHAT = {"again": "two evaluations of the same weights in one process",
                   "batch_size": "evaluation batch sizes {sizes}", "world_size": "1 process against 2"}


def evaluation_cause(measured: dict) -> tuple[str, str]:
    """(cause class, paragraph) for evaluations of the same weights that disagree: the comparison that isolates the
    fewest causes first (again: nothing changed but time; batch size; world size)."""
    said = []
    for name, what in EVALUATION_WHAT.items():
        compared = measured.get(name)
        if compared and compared["differing"]:
            rows = "; ".join(f"{metric} {compared['metrics'][metric]['values'][0]:.6g} against "
                             f"{compared['metrics'][metric]['values'][1]:.6g}" for metric in compared["differing"][:3])
            what = what.format(sizes=" and ".join(str(s) for s in measured.get("eval_batch_size", [])))
            said.append(f"{what}: {rows} ({compared['relative']:.2e} relative at most)")
    where = "The same weights evaluated give other metrics across " + "; across ".join(said) + "."
    if measured.get("again", {}).get("differing"):
        return EVALUATION_RANDOM, (
            f"{where} Two evaluations in one process, of the same weights on the same data, differ: the evaluation "
            "draws random numbers or keeps state. Likely cause: dropout applied with training=True "
            "(F.dropout(x, p, training=True), or a functional dropout without training=self.training), a module "
            "kept in train mode, random augmentation in the evaluation data, or a metric that accumulates across "
            "evaluations without a reset. What to change: use nn.Dropout modules or pass training=self.training; "
            "no random transforms in the evaluation set; reset a metric's state at each evaluation. (This makes "
            "the other comparisons differ too: fix it and run verify again.)")
    if measured.get("batch_size", {}).get("differing"):
        return EVALUATION_BATCH, (
            f"{where} One process evaluating the same weights twice agrees with itself, but another evaluation "
            "batch size gives other numbers: a sample's output depends on the rows batched with it. Likely cause: "
            "a model that ignores attention_mask (padding tokens enter attention or a mean-pool, and the padding "
            "changes with the batch's longest row), BatchNorm or a layer of your own kept in train mode, or a "
            "metric averaged per batch (a mean of batch means weights the last, smaller batch like a full one). "
            "What to change: pass attention_mask to the model and pool over real tokens only "
            "((h * mask).sum(1) / mask.sum(1)); return per-sample tensors from the loss function and compute "
            "metrics in metrics_fn. (It may hide a metric computed before gathering: run verify again after.)")
    return EVALUATION_GATHER, (
        f"{where} One process agrees with itself at every evaluation batch size, and 2 processes give other "
        "numbers: the metric is computed from each process's share of the evaluation set, and the number reported "
        "is the main process's share. Likely cause: counts accumulated in the loss function (or in a hook's own "
        "loop over the evaluation loader) and turned into the metric without gathering. What to change: return "
        "per-sample tensors (logits, predictions) from the loss function and compute the metric in metrics_fn, "
        "which receives the outputs gathered from every process; in a loop of your own, "
        "accelerator.gather_for_metrics before computing.")


def precision_cause(measured: dict, finite: bool) -> tuple[str, str]:
    """(cause class, paragraph) for a run in low precision whose first losses leave fp32's by more than rounding."""
    fp32, low = measured["precision"]
    worst = max(measured["relative_by_step"], key=lambda s: -1.0 if math.isnan(measured["relative_by_step"][s])
                else measured["relative_by_step"][s])
    pair = measured["losses_by_step"][worst]
    where = (f"At step {worst} the run in {fp32} logs loss {pair[0]} and the run in {low} {pair[1]} "
             f"({measured['relative_by_step'][worst]:.2e} relative).")
    advice = ("What to change: compute the loss and its reductions in float32 (logits.float() before "
              "cross_entropy; a sum over many tokens or a variance in float32), keep epsilons the format can hold "
              "(1e-8 is 0 in fp16), let autocast cast (no .half() / .to(torch.bfloat16) by hand), and prefer bf16 "
              "to fp16 (fp16 overflows past 65504).")
    if not finite:
        return "non-finite loss in low precision", (
            f"{where} A loss that is finite in fp32 and not in {low}: an overflow (fp16 past 65504, an exp or a "
            f"square of a large activation) or a division by an epsilon the format rounds to 0. {advice}")
    return "loss sensitive to low precision", (
        f"{where} More than the rounding of {low} moves (a few 1e-3 on runs without a bug). Likely cause: a "
        "reduction in low precision (a softmax or cross entropy over a large vocabulary, a sum or mean over many "
        "items, a norm's variance computed by hand), or weights or inputs cast by hand so that autocast cannot "
        f"choose float32 where it should. {advice}")
