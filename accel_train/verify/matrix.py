"""The feature x invariant matrix (docs/matrix.md) as data: one table, two uses.

The project's own tests (tests/core/test_matrix.py) run every feature of the loop against every invariant it keeps
and judge each cell with verify's evidence functions; `accel-train verify` reads a user's config.yaml, finds which of
the table's features that run combines, and states in its certificate what the table says for each check.

A cell is *proven* (a test checks it: test_matrix.py, or the named test elsewhere), *refused* by name before
training, *said* before training (the run goes ahead and its start-up report names what does not hold), or *n/a*
(the reason is in the table).

    FEATURES       each row: the flags the project's own run of it gives (tests/scripts' toy_train or token_train),
                   the config.yaml entries that name it, the parts a user's config.yaml shows it by
    SPECIAL        every cell that is not "proven here": its status and its reason (or the test that proves it)
    SAID           rows the start-up report speaks of (the run goes ahead)
    table()        the Markdown table docs/matrix.md holds
    features_of()  the rows a config.yaml combines;  said_for(): what the table says for one of verify's checks
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

PROVEN, REFUSED, SAID_STATUS, NA = "proven", "refused", "said", "n/a"
STATUSES = (PROVEN, REFUSED, SAID_STATUS, NA)
HERE = "here"  # the reason of a cell test_matrix.py itself proves

INVARIANTS = ("resume", "data", "history", "2 processes", "model FLOPs", "run record")
INVARIANT_TEXT = {
    "resume": "cut mid-epoch (a stop, or SIGTERM) and resumed with `latest`: bitwise the uninterrupted run's weights",
    "data": "each example fed once per epoch; the resumed run feeds exactly the uninterrupted run's batches after "
            "the checkpoint",
    "history": "metrics.jsonl: one timeline, its steps never go back",
    "2 processes": "2 processes x B/2 = 1 process x B: the same data (the ranks' halves of each micro-batch), weights "
                   "and evaluation, within TOLERANCE (AdamW "
                   "turns rounding-sized gradient differences into up to 2 x lr on its first steps: bf16 is compared "
                   "after 3 SGD steps)",
    "model FLOPs": "the FLOPs counted per sample (per token) are the model's, as without the feature",
    "run record": "config.yaml names what ran",
}

# How a user's config.yaml shows a part of a row (TrainConfig's fields, and the text recipes' data arguments: the
# recipes say `packing`, the project's token_train `pack_width`). A part not here (a stream, dropout, SIGTERM, a
# dataset's augmentation) is not in config.yaml: a row with such a part is never matched.
PARTS: dict[str, Callable[[dict], bool]] = {
    "accumulation": lambda c: (c.get("gradient_accumulation_steps") or 1) > 1,
    "bf16": lambda c: c.get("mixed_precision") == "bf16",
    "packing": lambda c: bool(c.get("pack_width") or c.get("packing")),
    "padding-free": lambda c: bool(c.get("padding_free")),
    "chunked CE": lambda c: bool(c.get("loss_chunk_size")),
    "length buckets": lambda c: bool(c.get("length_buckets")),
    "token budget": lambda c: bool(c.get("max_tokens_per_batch")),
    "rollback": lambda c: bool(c.get("spike_window")) and c.get("on_spike") == "rollback",
    "spike skip": lambda c: bool(c.get("spike_window")) and c.get("on_spike") == "skip",
    "non-finite skip": lambda c: c.get("on_nonfinite") == "skip",
    "weight averaging": lambda c: bool(c.get("ema_decay")),
    "gradient checkpointing": lambda c: bool(c.get("gradient_checkpointing")),
    "automatic batch size": lambda c: bool(c.get("auto_find_batch_size")),
    "best model": lambda c: bool(c.get("metric_for_best_model")),
    "Muon": lambda c: c.get("optim") == "muon",
    "async save": lambda c: bool(c.get("async_save")),
    "torch.compile": lambda c: bool(c.get("torch_compile")),
}


@dataclass(frozen=True)
class Feature:
    """A row: the flags of the project's own run of it, the config.yaml entries that run writes (its run-record cell
    checks them), and the parts of PARTS a user's config.yaml shows it by (empty: config.yaml cannot show it)."""

    flags: tuple[str, ...]
    record: dict = field(default_factory=dict)
    parts: tuple[str, ...] = ()


ROLLBACK = ("--spike_window", "3", "--spike_threshold", "10", "--on_spike", "rollback", "--shuffle", "false")
FEATURES: dict[str, Feature] = {
    "map-style data": Feature(()),
    "accumulation": Feature(("--gradient_accumulation_steps", "2"), {"gradient_accumulation_steps": 2},
                            ("accumulation",)),
    "bf16": Feature(("--mixed_precision", "bf16"), {"mixed_precision": "bf16"}, ("bf16",)),
    "packing": Feature(("--pack_width", "40", "--per_device_train_batch_size", "2"), {"pack_width": 40}, ("packing",)),
    "padding-free": Feature(("--padding_free", "true"), {"padding_free": True}, ("padding-free",)),
    "chunked CE": Feature(("--loss_chunk_size", "8"), {"loss_chunk_size": 8}, ("chunked CE",)),
    "length buckets": Feature(("--length_buckets", "16,32,40"), {"length_buckets": "16,32,40"}, ("length buckets",)),
    # 64 padded tokens a micro-batch: 11 micro-batches of 1 to 6 sequences an epoch (tests/core/test_token_batches.py)
    "token budget": Feature(("--max_tokens_per_batch", "64"), {"max_tokens_per_batch": 64}, ("token budget",)),
    "token budget + accumulation + bf16 + weight averaging": Feature(
        ("--max_tokens_per_batch", "64", "--gradient_accumulation_steps", "2", "--mixed_precision", "bf16",
         "--ema_decay", "0.9"),
        {"max_tokens_per_batch": 64, "gradient_accumulation_steps": 2, "mixed_precision": "bf16", "ema_decay": 0.9},
        ("token budget", "accumulation", "bf16", "weight averaging")),
    "stream": Feature(("--max_steps", "20")),
    "stream + 2 workers": Feature(("--max_steps", "20", "--dataloader_num_workers", "2"),
                                  {"dataloader_num_workers": 2}),
    "shuffled stream": Feature(("--max_steps", "20", "--stream_shuffle", "8"), {"stream_shuffle": 8}),
    "augmentation (SeededItems)": Feature(("--augment", "0.3", "--seeded_items", "true", "--dataloader_num_workers",
                                           "2"), {"augment": 0.3, "seeded_items": True}),
    "rollback": Feature((*ROLLBACK, "--spike_index", "20", "--spike_scale", "1e4"), {"on_spike": "rollback"},
                        ("rollback",)),
    "rollback + padding-free": Feature((*ROLLBACK[:6], "--padding_free", "true", "--spike_batch", "4"),
                                       {"on_spike": "rollback", "padding_free": True}, ("rollback", "padding-free")),
    "rollback + token budget": Feature((*ROLLBACK[:6], "--max_tokens_per_batch", "64", "--spike_batch", "4"),
                                       {"on_spike": "rollback", "max_tokens_per_batch": 64},
                                       ("rollback", "token budget")),
    "spike skip": Feature(("--spike_window", "3", "--spike_threshold", "10", "--on_spike", "skip", "--spike_index",
                           "20", "--spike_scale", "1e4"), {"on_spike": "skip"}, ("spike skip",)),
    # logged every 4 steps, cut at step 7 (SIGTERM): the checkpoint carries steps 5-7's unlogged losses
    # (TrainState.pending_loss), and the resumed run logs step 8, and train_loss, from them (in nearly every run: not
    # looked up)
    "logging interval across the cut": Feature(("--logging_steps", "4"), {"logging_steps": 4}),
    # training point 21 is NaN: steps 6 and 16 are skipped, step 6 inside the interval 5-8 that the cut splits
    "non-finite skip + logging interval across the cut": Feature(
        ("--poison_index", "21", "--on_nonfinite", "skip", "--logging_steps", "4"),
        {"on_nonfinite": "skip", "logging_steps": 4}, ("non-finite skip",)),
    # the token script's loss returns per-token sums and their count: the loop divides by the count over the whole
    # window and every process; logged every 3 steps, cut at 4: the checkpoint carries step 4's sums and count
    "sum loss + accumulation + logging interval across the cut": Feature(
        ("--gradient_accumulation_steps", "2", "--logging_steps", "3"),
        {"gradient_accumulation_steps": 2, "logging_steps": 3}),
    "dropout": Feature(("--dropout", "0.2"), {"dropout": 0.2}),
    "weight averaging": Feature(("--ema_decay", "0.9"), {"ema_decay": 0.9}, ("weight averaging",)),
    "gradient checkpointing": Feature(("--gradient_checkpointing", "true"), {"gradient_checkpointing": True},
                                      ("gradient checkpointing",)),
    "automatic batch size": Feature(("--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
                                     "--auto_find_batch_size", "true"),
                                    {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
                                    ("automatic batch size",)),
    "best model + early stopping": Feature(("--metric_for_best_model", "eval_loss", "--load_best_model_at_end", "true",
                                            "--early_stopping_patience", "20"), {"metric_for_best_model": "eval_loss"},
                                           ("best model",)),
    "SIGTERM": Feature(("--dropout", "0.2"), {"dropout": 0.2}),
    "Muon": Feature(("--optim", "muon"), {"optim": "muon"}, ("Muon",)),
    "Muon + accumulation": Feature(("--optim", "muon", "--gradient_accumulation_steps", "2"),
                                   {"optim": "muon", "gradient_accumulation_steps": 2}, ("Muon", "accumulation")),
    "Muon + bf16": Feature(("--optim", "muon", "--mixed_precision", "bf16"),
                           {"optim": "muon", "mixed_precision": "bf16"}, ("Muon", "bf16")),
    "Muon + weight averaging + SIGTERM": Feature(("--optim", "muon", "--ema_decay", "0.9"),
                                                 {"optim": "muon", "ema_decay": 0.9}),
    # aot_eager: dynamo and AOTAutograd trace forward and backward as inductor's do, without generating kernels; the
    # toy's layers in a model class of its own, as a user's model is (an nn.Sequential is not compiled under DDP:
    # SPECIAL's 2-process cell)
    "torch.compile + accumulation": Feature(
        ("--torch_compile", "true", "--torch_compile_backend", "aot_eager", "--gradient_accumulation_steps", "2",
         "--own_module", "true"),
        {"torch_compile": True, "torch_compile_backend": "aot_eager", "gradient_accumulation_steps": 2},
        ("torch.compile", "accumulation")),
    # checkpoints written in the background (the race itself, a write slower than the steps: test_async_save.py)
    "async save": Feature(("--async_save", "true"), {"async_save": True}, ("async save",)),
    "async save + stream": Feature(("--max_steps", "20", "--async_save", "true"), {"async_save": True}),
    "async save + weight averaging + SIGTERM": Feature(("--async_save", "true", "--ema_decay", "0.9"),
                                                       {"async_save": True, "ema_decay": 0.9}),
    # the recipes' default batches (a token budget) with the optimizer and the saves a user turns on beside them
    "token budget + Muon + async save + SIGTERM": Feature(
        ("--max_tokens_per_batch", "64", "--optim", "muon", "--async_save", "true"),
        {"max_tokens_per_batch": 64, "optim": "muon", "async_save": True}, ("token budget", "Muon", "async save")),
}
# Cells that test_matrix.py does not prove itself: (status, reason or the test that proves it elsewhere).
ELSEWHERE = "tests/core/test_spike_guard.py::test_rollback_gives_bitwise_the_run_whose_data_never_held_the_spiked_batch"
SPECIAL: dict[tuple[str, str], tuple[str, str]] = {
    ("stream", "2 processes"): ("n/a", "each process reads its own shards: the global batch holds other examples "
                                       "than one process's; tests/core/test_stream_resume.py resumes 2 bitwise"),
    ("stream + 2 workers", "2 processes"): ("n/a", "as for a stream"),
    ("shuffled stream", "2 processes"): ("n/a", "as for a stream"),
    ("async save + stream", "2 processes"): ("n/a", "as for a stream"),
    ("stream", "data"): ("proven", "here, on the resumed run; a stream has no epoch-wide index to check once-ness"),
    ("rollback", "data"): ("proven", ELSEWHERE + " (the kept batches are the run's without the spiked one)"),
    ("rollback", "2 processes"): ("proven", "here, with a rank that does not see the newest checkpoint yet; with "
                                            "accumulation: tests/core/test_spike_guard.py::test_rollback_agrees_"
                                            "across_ranks_with_accumulation"),
    ("rollback + padding-free", "2 processes"): ("n/a", "the spiked micro-batch is found by content on 1 process"),
    ("rollback + padding-free", "model FLOPs"): ("n/a", "padding-free rows: attention FLOPs per token depend on "
                                                        "the row's length"),
    ("token budget", "2 processes"): ("proven", "tests/core/test_token_batches.py::test_two_processes_run_as_many_"
                                                "micro_batches_and_give_the_token_mean_gradient (a plan for 2 deals "
                                                "whole batches, one per rank a round: the same number on each rank, "
                                                "the step the token mean of the examples of both)"),
    ("token budget + accumulation + bf16 + weight averaging", "2 processes"): (
        "n/a", "as for a token budget: the plan deals whole batches, not halves of one process's"),
    ("rollback + token budget", "2 processes"): ("n/a", "the spiked micro-batch is found by content on 1 process"),
    ("token budget + Muon + async save + SIGTERM", "2 processes"): (
        "n/a", "as for a token budget: the plan deals whole batches, not halves of one process's"),
    ("spike skip", "2 processes"): ("proven", "tests/core/test_spike_guard.py::test_the_guard_agrees_across_ranks_"
                                              "and_resumes_with_its_window_bitwise"),
    ("packing", "model FLOPs"): ("n/a", "packed rows are longer sequences: attention FLOPs per token differ"),
    ("padding-free", "model FLOPs"): ("n/a", "one row of every example: attention FLOPs per token differ"),
    ("packing", "2 processes"): ("proven", "tests/tasks/test_packing.py::test_a_packed_step_on_two_processes_is_the_"
                                           "padded_steps_gradient"),
    ("padding-free", "2 processes"): ("n/a", "the rows of 2 processes are 2 rows, not one: a different batch shape "
                                             "(the step gradient equals the padded one's, test_packing.py)"),
    ("automatic batch size", "2 processes"): ("proven", "tests/core/test_speed.py::test_auto_batch_size_agrees_"
                                                        "across_processes"),
    ("augmentation (SeededItems)", "2 processes"): ("proven", "here: each item's noise is a function of (seed, "
                                                              "epoch, index), on any rank"),
    ("dropout", "2 processes"): ("n/a", "each process draws its own dropout masks; resumed bitwise on 2: "
                                        "tests/launch/test_distributed.py::test_resume_mid_epoch_is_exact"),
    ("Muon + bf16", "2 processes"): ("n/a", "Muon, as AdamW, makes bf16's rounding-sized gradient differences "
                                            "update-sized (Newton-Schulz lifts every direction of the gradient to "
                                            "~1: 0.012 after 3 steps at lr 0.05); bf16 on 2 processes is the bf16 "
                                            "row's (SGD), Muon on 2 the Muon rows' (fp32: 0 difference in its matrix)"),
    ("torch.compile + accumulation", "2 processes"): (
        "proven", "here, with a model class of the script's own; under DDP a model whose forward is torch.nn's own "
                  "(an nn.Sequential) is not compiled at all, said in its log two steps in (pytorch/pytorch#140416)"),
    ("SIGTERM", "2 processes"): ("n/a", "dropout, as above; SIGTERM agreed across ranks: tests/rundir/"
                                        "test_reliability.py::test_sigterm_saves_at_the_step_boundary_and_exits_"
                                        "cleanly (slow)"),
}
SAID = {  # feature -> the start-up line a run without the fix gets (a test below sees it)
    "augmentation (global RNG)": "the training set's items draw from the global random generator(s) of torch",
}


SAID_LINE = "said: " + SAID["augmentation (global RNG)"] + " ..."


def cell_status(feature: str, invariant: str) -> tuple[str, str]:
    """(status, reason): SPECIAL's entry, else proven here (by test_matrix.py)."""
    if (feature, invariant) in SPECIAL:
        return SPECIAL[(feature, invariant)]
    return PROVEN, HERE


def cell_text(feature: str, invariant: str) -> str:
    status, where = cell_status(feature, invariant)
    return status if where == HERE else f"{status}: {where}"


def table() -> str:
    """The table docs/matrix.md holds (test_matrix.py keeps the two equal)."""
    rows = ["| feature | " + " | ".join(INVARIANTS) + " |", "|" + "---|" * (len(INVARIANTS) + 1)]
    for name in FEATURES:
        rows.append(f"| {name} | " + " | ".join(cell_text(name, invariant) for invariant in INVARIANTS) + " |")
    rows.append(f"| augmentation (global RNG) | {SAID_LINE} |" + " said |" * (len(INVARIANTS) - 1))
    return "\n".join(rows)


# ------------------------------------------------------------------------------------- a user's run: verify's use

# verify's checks against the table's invariants. A check in JUDGED has an invariant for its whole subject: where the
# table marks that cell n/a for a feature the run combines, verify reports the check not applicable with the table's
# reason instead of running it (a difference there is no bug). The others are told what the table says.
CHECK_INVARIANTS = {"resume": ("resume", "data"), "world_size": ("2 processes",), "evaluation": ("2 processes",),
                    "data_accounting": ("data",)}
JUDGED = {"resume": "resume", "world_size": "2 processes", "data_accounting": "data"}
NOT_SEEN = ("a stream, dropout, SIGTERM, a dataset's own augmentation and a loss that returns sums are not in "
            "config.yaml, and a logging interval split by a checkpoint is in nearly every run: the rows that need "
            "them are not looked up")


def features_of(config: dict) -> list[str]:
    """The rows of the table a run's config.yaml (a dict) combines: each row whose parts all hold, in table order."""
    return [name for name, row in FEATURES.items() if row.parts and all(PARTS[part](config) for part in row.parts)]


def said_rows(startup: str) -> list[str]:
    """The rows of SAID whose start-up line a run's output holds: a property of the data config.yaml cannot show."""
    return [name for name, line in SAID.items() if line in startup]


def combination(features: list[str], said: list[str] = ()) -> dict:
    """What the certificate says of the run as a whole: its rows, whether the table holds the combination itself as
    a row (else each row is proven on its own), and the rows the table says (`said`: SAID's rows the run's start-up
    report holds) or refuses, or where a cell is n/a."""
    parts = {part for name in features for part in FEATURES[name].parts}
    whole = next((name for name in features if set(FEATURES[name].parts) == parts), None)
    cells = {name: {invariant: cell_status(name, invariant) for invariant in INVARIANTS} for name in features}
    named = {status: sorted({name for name, row in cells.items() for s, _ in row.values() if s == status})
             for status in (SAID_STATUS, REFUSED, NA)}
    if not features:
        whole_text = "none of the table's features named in config.yaml: its plain row (map-style data) applies"
    elif whole is not None:
        whole_text = f"a row of the table: {whole}"
    else:
        whole_text = "not a row of the table: each of its rows is proven on its own, not together"
    return {"features": features, "combination": whole_text, "said": sorted({*named[SAID_STATUS], *said}),
            "refused": named[REFUSED],
            "not_applicable": named[NA], "not_looked_up": NOT_SEEN}


def said_for(check: str, features: list[str], said: list[str] = ()) -> dict | None:
    """What the table says for verify's `check` on a run that combines `features` (and whose start-up report said
    the rows `said`); None: the table has no invariant for that check. The status is the first of refused, n/a, said
    found in those cells, else proven; the line names each cell of that status (and where a proven one is proven)."""
    invariants = CHECK_INVARIANTS.get(check)
    if invariants is None:
        return None
    rows = features or ([] if said else ["map-style data"])
    cells = [(name, invariant, *cell_status(name, invariant)) for name in rows for invariant in invariants]
    cells += [(name, invariant, SAID_STATUS, f"the start-up report: {SAID[name]}") for name in said
              for invariant in invariants]
    status = next((s for s in (REFUSED, NA, SAID_STATUS) if any(cell[2] == s for cell in cells)), PROVEN)
    shown = [cell for cell in cells if cell[2] == status]
    text = "; ".join(f"{name} x {invariant}: {s}" + ("" if where == HERE else f" ({where})")
                     for name, invariant, s, where in shown)
    if status == PROVEN:
        text = f"proven for {', '.join(rows)} ({', '.join(invariants)}): tests/core/test_matrix.py" + \
            "".join(f"; {where}" for *_, where in shown if where != HERE)
    judged = any(cell[1] == JUDGED.get(check) and cell[2] == NA for cell in cells)
    return {"status": status, "invariants": list(invariants), "said": text, "judged": judged}
