"""Generation metrics score text in every script: identical texts score 100, disjoint ones 0, in English, Russian,
Chinese and Arabic; the one normalisation (NFKC, white space) and the units ROUGE and BLEU count."""

import pytest

from accel_train import load_metric
from accel_train.tasks.text.generation import score_generations
from accel_train.tasks.text_units import bleu_tokens, normalise_text, words

TEXTS = {  # (a text, a text sharing no word with it)
    "english": ("the quick brown fox jumps over the lazy dog", "a completely different sentence about nothing"),
    "russian": ("быстрая коричневая лиса прыгает через ленивую собаку", "совсем другое предложение ни о чём"),
    "chinese": ("我们今天去北京看长城和故宫", "他喜欢在家里读书写字画画"),
    "arabic": ("الثعلب البني السريع يقفز فوق الكلب الكسول", "جملة مختلفة تماما عن شيء آخر هنا"),
}


@pytest.fixture(scope="module")
def modules():
    return {name: load_metric(name) for name in ("rouge", "bleu", "sacrebleu", "exact_match")}


@pytest.mark.parametrize("language", list(TEXTS))
def test_identical_texts_score_100_and_disjoint_ones_0_in_every_script(modules, language):
    text, other = TEXTS[language]
    same = score_generations([text], [text], modules)
    disjoint = score_generations([text], [other], modules)
    for name in ("rouge1", "rouge2", "rougeL", "rougeLsum", "bleu", "sacrebleu", "exact_match"):
        assert same[name] == pytest.approx(100.0), (language, name, same)
        assert disjoint[name] == pytest.approx(0.0, abs=1e-9), (language, name, disjoint)


def test_partial_overlap_counts_words_or_characters_of_each_script(modules):
    rouge = modules["rouge"]
    assert rouge.compute(predictions=["быстрая лиса"], references=["быстрая собака"])["rouge1"] == pytest.approx(0.5)
    # Chinese counts characters: 2 of 4 shared
    assert rouge.compute(predictions=["北京大学"], references=["北京城市"])["rouge1"] == pytest.approx(0.5)
    # Porter stemming stays on English words only; Cyrillic words are not cut
    assert rouge.compute(predictions=["cats running"], references=["cat runs"])["rouge1"] == pytest.approx(1.0)
    assert words("Привет, МИР!") == ["привет", "мир"]
    assert words("東京タワー") == ["東", "京", "タ", "ワ", "ー"]
    assert words("नमस्ते दुनिया") == ["नमस्ते", "दुनिया"]  # combining vowel signs stay inside their word
    assert bleu_tokens("我们, ok.") == ["我", "们", ",", "ok", "."]


def test_the_one_normalisation_is_nfkc_and_white_space_only():
    assert normalise_text("  ＡＢＣ１２３\n\tx  y ") == "ABC123 x y"
    assert normalise_text("Case, punctuation: kept!") == "Case, punctuation: kept!"


def test_a_tokenizer_that_spaces_punctuation_does_not_match_the_raw_reference(modules):
    # what MiniLM's tokenizer writes for an ISO date is not the date: text metrics count it as wrong
    scores = score_generations(["1987 - 03 - 21"], ["1987-03-21"], modules)
    assert scores["exact_match"] == 0.0
    assert score_generations(["21 march 1987"], ["21 march 1987"], modules)["exact_match"] == 100.0
