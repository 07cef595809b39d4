"""The text-generation recipe's no-flag demo: dates written in many ways, to be rewritten in one form.

A rule-generated sequence-to-sequence task, so that the recipe runs offline with nothing but the package:
"the twenty-first of march, 1987", "3/21/1987", "saturday, march 21, 1987" -> "21 march 1987". Nothing here
was written by people; the dates are drawn from (seed, split) alone. Copying the source scores no exact
match (no input format is the target's), so exact match shows plainly whether the model learned the mapping
(month numbers to names, spelled ordinals to digits, the order of the fields).

Why not ISO dates ("1987-03-21"): the demo's model speaks MiniLM's uncased WordPiece vocabulary, whose
pre-tokenizer splits at every punctuation mark, so the best it can write is "1987 - 03 - 21" — and the metrics
score text against the raw reference (eval.py). "21 march 1987" is a string that tokenizer writes
exactly; the basic ISO form "19870321" would be too, but as pieces that cut across the fields ("1987", "##0",
"##32", "##1").
"""

from __future__ import annotations

import datetime
import random

import datasets

MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
          "november", "december")
UNITS = ("", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
         "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth", "eighteenth",
         "nineteenth")
TENS = {20: "twentieth", 30: "thirtieth"}
FORMATS = (
    "{month} {day}, {year}",
    "the {ordinal} of {month}, {year}",
    "{mon} {day} {year}",
    "{m}/{day}/{year}",
    "{weekday}, {month} {day}, {year}",
    "{month} {nth}, {year}",
    "{ordinal} {month} {year}",
    "{year}, {month} {day}",
)
TARGET = "{day} {month} {year}"  # one form the model's tokenizer writes exactly (module docstring)
FIRST, LAST = datetime.date(1950, 1, 1).toordinal(), datetime.date(2049, 12, 31).toordinal()


def ordinal_word(day: int) -> str:
    if day < 20:
        return UNITS[day]
    if day % 10 == 0:
        return TENS[day]
    return f"{'twenty' if day < 30 else 'thirty'}-{UNITS[day % 10]}"


def ordinal_suffix(day: int) -> str:
    suffix = "th" if 10 <= day % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def write_date(date: datetime.date, fmt: str) -> str:
    month = MONTHS[date.month - 1]
    return fmt.format(month=month, mon=month[:3], day=date.day, year=date.year, m=date.month,
                      ordinal=ordinal_word(date.day), nth=ordinal_suffix(date.day),
                      weekday=date.strftime("%A").lower())


def date_pairs(n: int, seed: int, exclude: frozenset = frozenset()) -> dict[str, list[str]]:
    """`n` (text, summary) pairs: a date in a random format, and the same date as "21 march 1987"; no text in
    `exclude`."""
    rng = random.Random(seed)
    texts, targets = [], []
    while len(texts) < n:
        date = datetime.date.fromordinal(rng.randint(FIRST, LAST))
        text = write_date(date, rng.choice(FORMATS))
        if text not in exclude:
            texts.append(text)
            targets.append(write_date(date, TARGET))
    return {"text": texts, "summary": targets}


def load_date_demo(seed: int, train_size: int = 8000, validation_size: int = 400) -> datasets.DatasetDict:
    """The demo's splits: no validation text occurs in the training split."""
    train = date_pairs(train_size, seed * 2 + 1)
    validation = date_pairs(validation_size, seed * 2 + 2, exclude=frozenset(train["text"]))
    return datasets.DatasetDict({"train": datasets.Dataset.from_dict(train),
                                 "validation": datasets.Dataset.from_dict(validation)})
