"""verify's data-accounting check: every training example fed exactly once per epoch, across processes and across the
resume. It runs nothing of its own: it reads what the variants the other checks ran recorded (ACCEL_TRAIN_RECORD_FED,
observe/fed_record.py): the reference (1 process), the world-size check's 2-process run, the resume check's run
(killed and resumed). A check not asked leaves its part out, and the certificate says which.

Per run and process: each epoch's plan (the dataset indices of every micro-batch, the sampler replayed) and, per step,
the plan positions fed and the rows that reached the loss. Judged:
    rows        the rows fed equal the indices planned for those micro-batches (a collator that drops items)
    coverage    the plans of all processes cover each index of range(len(dataset)) once per epoch, but for
                Accelerate's fill of the last batches (fewer than one global batch, announced in the start-up
                report) or, with --dataloader_drop_last, the incomplete last global batch left out
    resume      the resumed process replays the epoch's plan and goes on at the checkpoint's position: no micro-batch
                fed twice or skipped
    length      dataset[len(dataset)] raises and dataset[len(dataset) - 1] loads (the sequence protocol): else
                __len__ does not tell the data's size
"""

from __future__ import annotations

from collections import Counter

from .checks import FAILED, NOT_APPLICABLE, PASSED, Result, Runs
from .diagnose import accounting_cause
from .evidence import Fed, read_fed, run_config

# The runs it reads, by the check that runs them: (variant, processes, what it shows).
SOURCES = (("reference", "determinism", "one process"), ("world-size", "world_size", "two processes"),
           ("resumed", "resume", "across the resume"))


def data_accounting(runs: Runs) -> Result:
    """The fed records of the runs the other checks made, accounted (module docstring)."""
    tolerance = {"rows": "equal", "coverage": "each index once per epoch (the launcher's fill of the last batches, "
                 "or --dataloader_drop_last's incomplete last batch, excepted)", "resume": "equal plans, no position "
                 "fed twice or skipped", "length": "dataset[len] raises, dataset[len - 1] loads"}
    reference = runs.finished("reference")
    if read_fed(reference.output_dir, 0) is None:
        return Result(NOT_APPLICABLE, {"reason": "the reference run recorded nothing fed (diagnostics/fed_rank0.jsonl):"
                                       " the script does not train with accel_train.train()"}, tolerance)
    measured: dict = {"compared": [], "not_compared": [], "findings": [], "rows": {}}
    budget = run_config(reference.output_dir).get("max_tokens_per_batch")
    if budget:  # the loop counts a round's examples from the plan: a process's own rows are not recorded
        measured["not_compared"].append(f"rows: the run batches by a token budget (--max_tokens_per_batch {budget}), "
                                        "whose processes feed micro-batches of unequal rows, counted per round from "
                                        "the plan (coverage and resume are judged)")
    variants = []
    for name, check, what in SOURCES:
        variant = runs.done.get(name)
        if variant is None or variant.returncode != 0:
            why = f"its run failed (see {check})" if variant is not None else \
                f"the {check} check did not run it (not applicable)" if check in runs.verify.checks else \
                f"add {check} to --checks"
            measured["not_compared"].append(f"{what}: {why}")
            continue
        ranks = [read_fed(variant.output_dir, rank) for rank in range(variant.processes)]
        if any(fed is None for fed in ranks):
            measured["findings"].append({"kind": "unrecorded", "variant": name, "sentence": f"{name}: a process "
                                         "recorded nothing fed (its diagnostics/fed_rank<R>.jsonl is missing)."})
            continue
        if not any(fed.plans for fed in ranks):
            return Result(NOT_APPLICABLE, {"reason": "the training data is a stream (an iterable dataset): it has no "
                                           "indices to account for"}, tolerance)
        measured["compared"].append(what)
        variants.append(name)
        account(name, ranks, measured, resumed=name == "resumed", rows=not budget)
    probe = read_fed(reference.output_dir, 0).probe
    measured["length"] = probe
    measured["findings"] += length_findings(probe)
    result = Result(PASSED, measured, tolerance, variants)
    if measured["findings"]:
        result.status = FAILED
        result.cause, result.diagnosis = accounting_cause(measured["findings"])
    return result


def account(name: str, ranks: list[Fed], measured: dict, resumed: bool, rows: bool = True) -> None:
    """Rows (unless `rows` is False), coverage and (for the resumed run) replay and positions of one run's processes:
    findings appended."""
    findings = measured["findings"]
    planned = fed = 0
    for rank, record in enumerate(ranks):
        for step, entry in sorted(record.steps.items()):
            want = sum(len(record.plans[e][p]) for e, a, b in entry["segments"] if e in record.plans
                       for p in range(a, min(b, len(record.plans[e]))))
            planned, fed = planned + want, fed + entry["rows"]
            reported = any(f.get("variant") == name and f["kind"] == "rows" for f in findings)
            if rows and entry["rows"] != want and not reported:
                findings.append({"kind": "rows", "variant": name, "rank": rank, "step": step, "planned": want,
                                 "fed": entry["rows"], "sentence": f"{name}, process {rank}, step {step}: the sampler "
                                 f"gave {want} indices and {entry['rows']} rows reached the loss."})
        if resumed:
            findings += replay_findings(name, rank, record)
    if rows:
        measured["rows"][name] = {"planned": planned, "fed": fed}
    for epoch in sorted(ranks[0].plans):
        findings += coverage_findings(name, epoch, [record.plans.get(epoch, []) for record in ranks],
                                       ranks[0].meta[epoch])


def coverage_findings(name: str, epoch: int, plans: list[list[list[int]]], meta: dict) -> list[dict]:
    """The epoch's plans of every process against range(len(dataset))."""
    length, world = meta["dataset_length"], len(plans)
    counts = Counter(i for plan in plans for batch in plan for i in batch)
    outside = sorted(i for i in counts if not 0 <= i < length)
    missing = length - sum(1 for i in counts if 0 <= i < length)
    extra = sum(counts.values()) - len(counts)
    global_batch = world * max((len(batch) for plan in plans for batch in plan), default=1)
    allowed_extra = 0 if world == 1 or meta.get("drop_last") else global_batch - 1
    allowed_missing = global_batch - 1 if meta.get("drop_last") else 0
    where = f"{name}, epoch {epoch} ({world} process{'es' if world > 1 else ''}, {length} examples)"
    if outside:
        return [{"kind": "outside", "variant": name, "epoch": epoch, "indices": outside[:10], "sentence":
                 f"{where}: the sampler drew indices outside range({length}): {outside[:10]}."}]
    if extra > allowed_extra or missing > allowed_missing:
        return [{"kind": "coverage", "variant": name, "epoch": epoch, "missing": missing, "duplicated": extra,
                 "processes": world, "sentence": f"{where}: the plans of all processes leave {missing} example(s) out "
                 f"and hold {extra} more than once (allowed: {allowed_missing} left out, {allowed_extra} twice)."}]
    return []


def replay_findings(name: str, rank: int, record: Fed) -> list[dict]:
    """Across the resume: every process run planned the epoch alike, and the positions fed tile it once."""
    found = []
    for epoch, plans in record.replays.items():
        if any(plan != plans[0] for plan in plans[1:]):
            found.append({"kind": "replay", "variant": name, "rank": rank, "epoch": epoch, "sentence":
                          f"{name}, process {rank}: the resumed run planned epoch {epoch} in another order than the "
                          "run that was cut."})
    fed: dict[int, list[int]] = {}
    for _, entry in sorted(record.steps.items()):
        for epoch, first, end in entry["segments"]:
            fed.setdefault(epoch, []).extend(range(first, end))
    for epoch, positions in fed.items():
        if positions != list(range(len(positions))):
            found.append({"kind": "positions", "variant": name, "rank": rank, "epoch": epoch, "sentence":
                          f"{name}, process {rank}, epoch {epoch}: the micro-batches fed across the resume are "
                          f"positions {_ranges(positions)} of the epoch, not 0..{len(positions) - 1} once each."})
    return found


def length_findings(probe: dict | None) -> list[dict]:
    if not probe or probe.get("dataset_length") is None:
        return []
    length, kind = probe["dataset_length"], probe.get("dataset_class", "the dataset")
    if probe.get("item_at_length") is True:
        return [{"kind": "length", "length": length, "sentence": f"{kind}[{length}] returned an item although "
                 f"len({kind}) is {length}: the data holds more than __len__ says (the sampler never draws the items "
                 "past it), __getitem__ wraps indices around (items fed twice per epoch), or it serves any index "
                 "(data made from the index: raise IndexError past the length, as a Python sequence does; a loop "
                 "over it never ends otherwise)."}]
    if probe.get("last_item") not in (True, None):
        return [{"kind": "last_item", "length": length, "sentence": f"{kind}[{length - 1}] (the last index __len__ "
                 f"promises) failed: {probe['last_item']}. __len__ is larger than the data: the run fails, or feeds "
                 "something else, when the sampler draws an index past the end."}]
    return []


def _ranges(positions: list[int]) -> str:
    return ", ".join(str(p) for p in positions[:12]) + (" ..." if len(positions) > 12 else "")
