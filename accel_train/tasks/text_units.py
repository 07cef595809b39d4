"""Text as the generation metrics compare it, for every script: one normalisation, and the units ROUGE and BLEU count.

* `normalise_text`: Unicode NFKC (full-width letters and digits, ligatures and compatibility forms become their
  plain forms) and white space collapsed to single spaces, both ends stripped. The only normalisation applied
  before text is scored; case, punctuation and diacritics are kept.
* `words`: the units ROUGE counts. Runs of letters, combining marks and digits of any script (Cyrillic, Greek, Arabic,
  Hebrew, Devanagari ... words count, not only `[a-z0-9]` as in `rouge_score`'s default tokenizer), except that every
  character of a script written without spaces between words (Chinese, Japanese kana) is a unit of its own, as
  character-level ROUGE and BLEU for Chinese and Japanese do. Punctuation is dropped.
* `bleu_tokens`: sacreBLEU's 13a tokenisation, with the same characters first set apart by spaces (what sacreBLEU's
  `zh` tokenizer does for Chinese), so that a Chinese sentence is not one "word".

The metric modules in `metric_modules/` use these by default; `tests/tasks/test_text_metrics.py` checks identical and
disjoint texts in English, Russian, Chinese and Arabic.
"""

from __future__ import annotations

import unicodedata

import regex  # transformers' own dependency: Unicode properties (\p{L}, \p{Han}) that `re` lacks

# Scripts written without spaces between words: Chinese (Han ideographs), Japanese kana, Bopomofo.
UNSPACED = r"\p{Han}\p{Hiragana}\p{Katakana}\p{Bopomofo}"
# one unspaced character, or a run of letters, combining marks (Devanagari vowel signs, Arabic harakat) and digits
UNIT = regex.compile(rf"[{UNSPACED}]|(?:(?![{UNSPACED}])[\p{{L}}\p{{M}}\p{{N}}])+")
SPACE_APART = regex.compile(rf"([{UNSPACED}])")


def normalise_text(text: str) -> str:
    """NFKC, white space collapsed, stripped: what every generation metric compares (module docstring)."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


def words(text: str) -> list[str]:
    """Lower-cased (case-folded) word units of `text`, every script: see the module docstring."""
    return UNIT.findall(unicodedata.normalize("NFKC", text).casefold())


def bleu_tokens(text: str) -> list[str]:
    """13a tokens (sacreBLEU's default) of `text`, with every character of an unspaced script its own token."""
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    return Tokenizer13a()(SPACE_APART.sub(r" \1 ", text)).split()


def has_unspaced_script(texts) -> bool:
    """Whether any text holds characters of a script written without spaces (Chinese, Japanese)."""
    pattern = regex.compile(rf"[{UNSPACED}]")
    return any(pattern.search(t) for t in texts)
