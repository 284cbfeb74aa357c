"""Metrics on hand-made cases: every expected value here is worked out by hand, not by the code under test."""

import math

import pytest

from bdlora_train.tasks import metrics


@pytest.mark.parametrize(
    "text, word",
    [
        (" Iraq.\n\nThe capital", "iraq"),
        ("  \n", ""),
        ('"Paris", said', "paris"),
        (" ... Rome", "rome"),
        (" 10222\n", "10222"),
    ],
)
def test_first_word(text, word):
    assert metrics.first_word(text) == word


def test_exact_match_first_word_is_strict_about_the_word():
    assert metrics.exact_match(" Iraq.\n\nAthens", " Iraq")
    assert metrics.exact_match(" iraq", " Iraq")  # case-insensitive
    assert not metrics.exact_match(" the UK.", " UK")  # the first word is "the"
    assert not metrics.exact_match(" Iraqi", " Iraq")  # no prefix matching
    assert not metrics.exact_match(" 1022", " 10222")
    assert not metrics.exact_match("", " Iraq")
    assert not metrics.exact_match(" anything", "")  # an empty reference never matches


def test_exact_match_whole_answer():
    assert metrics.exact_match("  The Answer is 4. ", "the answer is 4", mode="exact")
    assert not metrics.exact_match("the answer is 4, no 5", "the answer is 4", mode="exact")
    with pytest.raises(ValueError, match="unknown match mode"):
        metrics.exact_match("a", "a", mode="fuzzy")


def test_accuracy_with_categories():
    preds = [" Egypt.", " Germany", " the UK", " Spain"]
    refs = [" Egypt", " Germany", " UK", " France"]
    out = metrics.accuracy(preds, refs, ["capitals", "capitals", "capitals", "other"])
    assert out["accuracy"] == 50.0
    assert out["accuracy/capitals"] == pytest.approx(200 / 3)
    assert out["accuracy/other"] == 0.0
    assert out["n"] == 4


def test_accuracy_rejects_bad_input():
    with pytest.raises(ValueError, match="3 predictions for 2 references"):
        metrics.accuracy(["a", "b", "c"], ["a", "b"])
    with pytest.raises(ValueError, match="empty"):
        metrics.accuracy([], [])


def test_perplexity():
    out = metrics.perplexity(4 * math.log(2), 4)  # mean NLL ln 2 -> perplexity 2
    assert out["perplexity"] == pytest.approx(2.0)
    assert out["loss"] == pytest.approx(math.log(2))
    with pytest.raises(ValueError):
        metrics.perplexity(1.0, 0)


def test_mean_std_and_stderr():
    assert metrics.mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert metrics.mean_std([5.0]) == (5.0, 0.0)
    assert all(math.isnan(v) for v in metrics.mean_std([]))
    assert metrics.binomial_stderr(50.0, 100) == pytest.approx(5.0)
    assert metrics.binomial_stderr(80.0, 280) == pytest.approx(100 * math.sqrt(0.16 / 280))
