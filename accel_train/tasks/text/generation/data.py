"""Text-generation data: where the text comes from and which columns hold what (the arguments, the raw splits).

Three kinds of task, chosen by the column flags:

* **pairs** — a source and a target: `--text_column` / `--summary_column` (the Hugging Face summarization
  example's names) or `--prompt_column` / `--completion_column`. A seq2seq model reads the source and
  learns the target; a causal LM reads prompt + completion and learns the completion only (unless
  `--train_on_prompt`);
* **chat** — `--messages_column`, a list of `{"role", "content"}` messages per row ending with the
  assistant's reply, rendered with the tokenizer's chat template (causal LMs);
* **lm** — `--text_column` alone: language modelling on the text cut into blocks of `--block_size` tokens
  (causal LMs).

Bad input stops the run with a `DataError` or `ConfigError` naming the column, row or flag at fault.
Tokenization is in `tokens.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import pandas as pd

from ....errors import ConfigError, DataError
from ...sampling import subsample
from .demo import load_date_demo

FILE_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class GenerationDataArguments:
    """Where the examples come from, which columns hold what, and how they are cut."""

    dataset_name: str | None = field(default=None, metadata={"help": "A `datasets` name or local folder."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The dataset's configuration."})
    train_file: str | None = field(default=None, metadata={"help": "csv / tsv / json / jsonl / parquet. "
                                                                      "Neither this nor --dataset_name: the demo."})
    validation_file: str | None = field(default=None, metadata={"help": "Default: held out from train."})
    column_names: str | None = field(default=None, metadata={
        "help": "Names for the columns of a csv/tsv file WITHOUT a header row, e.g. 'label,title,description'."})
    text_column: str | None = field(default=None, metadata={
        "help": "The source text (with --summary_column), or alone: causal language modelling in blocks."})
    summary_column: str | None = field(default=None, metadata={"help": "The target text of each source."})
    prompt_column: str | None = field(default=None, metadata={"help": "Prompt (with --completion_column)."})
    completion_column: str | None = field(default=None, metadata={"help": "The completion to learn."})
    messages_column: str | None = field(default=None, metadata={
        "help": "A list of {role, content} messages per row, the last one the assistant's (causal LMs)."})
    source_prefix: str = field(default="", metadata={"help": "Prepended to every source, e.g. 'summarize: ' (T5)."})
    prompt_suffix: str = field(default="", metadata={
        "help": "Appended to every prompt of a causal LM without a chat template, e.g. ' Title:'."})
    max_source_length: int = field(default=256, metadata={"help": "Source / prompt tokens kept."})
    max_target_length: int = field(default=64, metadata={"help": "Target / completion tokens kept (with eos)."})
    block_size: int | None = field(default=None, metadata={
        "help": "Language modelling: tokens per block (default: the model's positions, at most 1024)."})
    train_on_prompt: bool = field(default=False, metadata={
        "help": "Causal LMs: learn the prompt tokens too (default: the loss is on the completion only)."})
    validation_split: float = field(default=0.05, metadata={
        "help": "Held out from train when there is no validation split: a fraction in (0, 1) or a count >= 1."})
    max_train_samples: int | None = field(default=None, metadata={
        "help": "Train on a seeded random subset of N rows (not the first N: files are often sorted)."})
    max_eval_samples: int | None = field(default=None, metadata={
        "help": "Evaluate on a seeded random subset of N validation rows."})
    group_by_length: bool = field(default=True, metadata={"help": "Batches of similar lengths: less padding."})
    packing: bool = field(default=False, metadata={
        "help": "Causal LMs: pack whole training examples into rows of --max_seq_length tokens (best-fit "
                "decreasing); each example attends only to itself and keeps its own positions, so training is the "
                "same as with padded batches, with almost no padding. Language modelling: each text is an example."})
    max_seq_length: int | None = field(default=None, metadata={
        "help": "--packing: tokens per row (default: --max_source_length + --max_target_length, or the block size "
                "for language modelling)."})
    packing_split: bool = field(default=False, metadata={
        "help": "--packing: cut an example longer than a row into pieces (default: refuse it)."})
    padding_free: bool = field(default=False, metadata={
        "help": "Causal LMs: each micro-batch is one row of its examples, no padding at all (isolated as with "
                "--packing); the batches hold the same examples as padded ones."})
    length_buckets: str | None = field(default=None, metadata={
        "help": "Pad each batch to the smallest of a few widths that holds it, so --torch_compile compiles one "
                "static graph per width and then never again: e.g. 32,64,128, or auto (powers of two from 16, then "
                "the longest row: source + target, or the block size). Not with --packing / --padding_free."})

    def __post_init__(self):
        if self.messages_column and (self.prompt_column or self.completion_column or self.summary_column):
            raise ConfigError("--messages_column holds whole conversations: give it alone, without --prompt_column, "
                              "--completion_column or --summary_column.")
        if bool(self.prompt_column) != bool(self.completion_column):
            raise ConfigError("--prompt_column and --completion_column go together: give both.")
        if self.summary_column and not self.text_column:
            raise ConfigError(f"--summary_column {self.summary_column}: give the source too (--text_column).")
        if self.prompt_column and self.text_column:
            raise ConfigError("--prompt_column and --text_column both name the source: give one of them.")
        for name in ("max_source_length", "max_target_length"):
            if getattr(self, name) < 2:
                raise ConfigError(f"--{name} {getattr(self, name)}: must be at least 2 tokens.")
        if self.packing and self.padding_free:
            raise ConfigError("--packing and --padding_free are two ways to batch without padding: give one.")
        if self.length_buckets and (self.packing or self.padding_free):
            why = ("--packing fills rows of --max_seq_length tokens already: nearly every batch has that width"
                   if self.packing else "--padding_free writes each micro-batch as one row without padding: its "
                   "width is the sum of its examples' lengths, which padding to a bucket would undo")
            raise ConfigError(f"--length_buckets pads batches of whole examples; {why}. Give one of them.")
        for name in ("max_seq_length", "packing_split"):
            if getattr(self, name) and not self.packing:
                raise ConfigError(f"--{name} shapes the rows of --packing: add --packing, or drop it.")
        if self.max_seq_length is not None and self.max_seq_length < 2:
            raise ConfigError(f"--max_seq_length {self.max_seq_length}: must be at least 2 tokens.")
        split = self.validation_split
        if split <= 0 or (split >= 1 and split != int(split)):
            raise ConfigError(f"--validation_split {self.validation_split}: a fraction in (0, 1) or a whole count.")


@dataclass(frozen=True)
class TaskColumns:
    """What the column flags mean for this model: kind is 'pairs', 'chat' or 'lm'."""

    kind: str
    source: str | None = None  # pairs: the source / prompt column; lm: the text column
    target: str | None = None  # pairs: the target / completion column
    messages: str | None = None


def resolve_columns(args: GenerationDataArguments, seq2seq: bool, columns: list[str]) -> TaskColumns:
    """Which task the flags ask for, checked against the model family and the data's columns."""
    if args.messages_column:
        if seq2seq:
            raise ConfigError("--messages_column (chat data) needs a causal LM; this model is an encoder-decoder. "
                              "Use --text_column / --summary_column for a seq2seq model.")
        task = TaskColumns("chat", messages=args.messages_column)
    elif args.prompt_column or args.summary_column:
        task = TaskColumns("pairs", source=args.prompt_column or args.text_column,
                           target=args.completion_column or args.summary_column)
    elif args.text_column:
        if seq2seq:
            raise ConfigError(f"--text_column {args.text_column} alone is language modelling, which needs a causal "
                              "LM; an encoder-decoder needs a target too: add --summary_column.")
        task = TaskColumns("lm", source=args.text_column)
    else:
        raise ConfigError(f"name the columns: --text_column + --summary_column (source -> target), "
                          f"--prompt_column + --completion_column, --messages_column, or --text_column alone (causal "
                          f"language modelling). The data has columns {columns}.")
    missing = [c for c in (task.source, task.target, task.messages) if c and c not in columns]
    if missing:
        raise DataError(f"column {missing[0]!r} is not in the data; its columns are {columns}. Check the column "
                        "flags (or --column_names for a csv file without a header row).")
    check_affixes(args, task, seq2seq)
    return task


def check_affixes(args: GenerationDataArguments, task: TaskColumns, seq2seq: bool) -> None:
    """--source_prefix applies to pairs (either family), --prompt_suffix to the pairs of a causal LM: given where
    tokenization never reads it, it is refused rather than silently left out of every example."""
    data = {"chat": "chat data (--messages_column: the tokenizer's chat template frames each turn)",
            "lm": "language modelling (--text_column alone: the texts are cut into blocks)"}.get(task.kind)
    if args.source_prefix and data:
        raise ConfigError(f"--source_prefix {args.source_prefix!r} is prepended to the source of each pair "
                          "(--text_column + --summary_column, or --prompt_column + --completion_column); this run "
                          f"is {data}, which has no source to prefix. Drop --source_prefix.")
    if args.prompt_suffix and (data or seq2seq):
        this = (f"this run is {data}" if data else "this model is an encoder-decoder, whose decoder starts the target "
                "on its own after reading the whole source (text before each source: --source_prefix)")
        raise ConfigError(f"--prompt_suffix {args.prompt_suffix!r} is appended to the prompts of a causal LM's pairs "
                          "(--prompt_column + --completion_column, or --text_column + --summary_column), just before "
                          f"the completion it learns; {this}. Drop --prompt_suffix.")


def load_raw_data(args: GenerationDataArguments, seed: int) -> datasets.DatasetDict:
    """train and validation splits with the raw columns: from files, a `datasets` name, or the demo."""
    if args.train_file:
        ds = datasets.DatasetDict({split: read_file(path, args.column_names, split) for split, path in
                                   (("train", args.train_file), ("validation", args.validation_file)) if path})
    elif args.dataset_name:
        try:
            ds = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        except Exception as err:  # datasets raises many types for an unknown name or an offline hub
            raise DataError(f"--dataset_name {args.dataset_name}: could not be loaded ({type(err).__name__}: "
                            f"{err}). Offline, use --train_file or a dataset in the local cache.") from None
    else:
        ds = load_date_demo(seed)
    if "train" not in ds:
        raise DataError(f"no 'train' split in {sorted(ds)}.")
    if "validation" not in ds:
        size = int(args.validation_split) if args.validation_split >= 1 else args.validation_split
        if (size if isinstance(size, int) else 2) >= len(ds["train"]):
            raise DataError(f"--validation_split {args.validation_split}: the training data has only "
                            f"{len(ds['train'])} rows.")
        parts = ds["train"].train_test_split(test_size=size, seed=seed)
        ds = datasets.DatasetDict({"train": parts["train"], "validation": parts["test"]})
    for split, limit in (("train", args.max_train_samples), ("validation", args.max_eval_samples)):
        if limit is not None and len(ds[split]) > limit:  # a seeded sample, in the split's order
            ds[split] = ds[split].select(subsample(len(ds[split]), limit, seed))
        if len(ds[split]) == 0:
            raise DataError(f"the {split} split is empty; give it examples.")
    return datasets.DatasetDict({"train": ds["train"], "validation": ds["validation"]})


def read_file(path: str, column_names: str | None, split: str) -> datasets.Dataset:
    file = Path(path)
    if not file.is_file():
        raise DataError(f"--{split}_file {file}: no such file.")
    builder = FILE_BUILDERS.get(file.suffix.lower())
    if builder is None:
        raise DataError(f"--{split}_file {file}: unknown format; use {sorted(FILE_BUILDERS)}.")
    if column_names and builder != "csv":
        raise ConfigError(f"--column_names is for csv/tsv files without a header row, not {file.suffix} files.")
    names = [c.strip() for c in column_names.split(",")] if column_names else None
    try:
        if builder == "json":  # read with the json module: pyarrow would turn "2021-03-03" into a timestamp
            data = datasets.Dataset.from_list(read_json_rows(file))
        elif builder == "csv":  # every cell a string ("42" stays text); an empty cell "" (refused later), not NaN
            frame = pd.read_csv(file, sep="\t" if file.suffix.lower() == ".tsv" else ",", dtype=str,
                                keep_default_na=False, header=None if names else "infer", names=names)
            data = datasets.Dataset.from_pandas(frame, preserve_index=False)
        else:
            data = datasets.load_dataset(builder, data_files={split: str(file)}, split=split)
    except DataError:
        raise
    except Exception as err:  # datasets and json raise many types for a malformed file; name the file
        raise DataError(f"--{split}_file {file}: could not be read as {builder}: {err}") from None
    if len(data) == 0:
        raise DataError(f"--{split}_file {file}: no rows.")
    return data


def read_json_rows(file: Path) -> list[dict]:
    """Rows of a .jsonl file (one object a line) or a .json file (a list of objects)."""
    text = file.read_text(encoding="utf-8")
    if file.suffix.lower() == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = json.loads(text)
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise DataError(f"{file}: expected JSON objects (one per line in .jsonl, a list of them in .json).")
    return rows


def check_texts(split: datasets.Dataset, task: TaskColumns, name: str) -> None:
    """Every source is a string, every target a non-empty string, every conversation a list of messages."""
    if task.kind == "chat":
        for row, messages in enumerate(split[task.messages]):
            problem = message_problem(messages)
            if problem:
                raise DataError(f"{name} row {row}, column {task.messages!r}: {problem}. Each row must be a list of "
                                '{"role": ..., "content": ...} messages ending with the "assistant" reply to learn.')
        return
    for column, required in ((task.source, False), (task.target, True)):
        if column is None:
            continue
        values = split[column]
        not_text = [i for i, v in enumerate(values) if v is not None and not isinstance(v, str)]
        if not_text:
            raise DataError(f"{name}: column {column!r} holds {type(values[not_text[0]]).__name__} values, not text "
                            f"(first: row {not_text[0]}, {values[not_text[0]]!r}); store it as strings.")
        empty = [i for i, v in enumerate(values) if v is None or (required and not v.strip())]
        if empty:
            what = "an empty or missing" if required else "a missing"
            raise DataError(f"{name}: {len(empty)} of {len(values)} rows have {what} {column!r} (first: row "
                            f"{empty[0]}, value {values[empty[0]]!r}). Remove or fill those rows: an empty target "
                            "teaches nothing but the end-of-sequence token.")


def message_problem(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return f"expected a non-empty list of messages, got {type(messages).__name__} {str(messages)[:60]!r}"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            return f"message {i} is not a {{'role': str, 'content': str}} mapping: {str(message)[:60]!r}"
    if messages[-1]["role"] != "assistant":
        return f"the last message is from {messages[-1]['role']!r}, not 'assistant'"
    if not messages[-1]["content"].strip():
        return "the assistant's reply is empty"
    return None


def training_texts(split: datasets.Dataset, task: TaskColumns) -> list[str]:
    """The texts a new tokenizer is trained on: sources and targets, message contents, or the text column."""
    if task.kind == "chat":
        return [m["content"] for messages in split[task.messages] for m in messages if isinstance(m, dict)
                and isinstance(m.get("content"), str)]
    columns = [c for c in (task.source, task.target) if c]
    return [text for column in columns for text in split[column] if isinstance(text, str)]
