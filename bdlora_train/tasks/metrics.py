"""Scoring: exact match on generated text, perplexity from summed token losses, seed statistics.

Kept separate from the tasks so every number in a results table comes from one small, tested place.
"""

from __future__ import annotations

import math
import re
import string
from collections import defaultdict
from collections.abc import Iterable, Sequence

_PUNCT = string.punctuation + "“”‘’«»…"
MATCH_MODES = ("first_word", "exact")


def first_word(text: str) -> str:
    """The first whitespace-delimited word, stripped of surrounding punctuation and lower-cased.

    "A is to B as C is to" is answered by one word; models often continue (" Iraq.\nAthens"), so only
    the first word counts. Case is ignored because the analogy set mixes "Greece" and "greece"-style cases
    with lower-case grammar categories.
    """
    for word in text.split():
        word = word.strip(_PUNCT).lower()
        if word:
            return word
    return ""


def normalize(text: str) -> str:
    """Whitespace-collapsed, lower-cased, outer punctuation stripped: for whole-answer exact match."""
    return re.sub(r"\s+", " ", text).strip().strip(_PUNCT).strip().lower()


def exact_match(prediction: str, reference: str, mode: str = "first_word") -> bool:
    if mode == "first_word":
        ref = first_word(reference)
        return bool(ref) and first_word(prediction) == ref
    if mode == "exact":
        ref = normalize(reference)
        return bool(ref) and normalize(prediction) == ref
    raise ValueError(f"metrics: unknown match mode '{mode}'; use one of {MATCH_MODES}")


def accuracy(
    predictions: Sequence[str],
    references: Sequence[str],
    categories: Sequence[str] | None = None,
    mode: str = "first_word",
) -> dict[str, float]:
    """{"accuracy": %, "accuracy/<category>": %, "n": count} — percentages, 0..100."""
    if len(predictions) != len(references):
        raise ValueError(f"metrics: {len(predictions)} predictions for {len(references)} references")
    if not references:
        raise ValueError("metrics: no references to score; the test split is empty")
    hits = [exact_match(p, r, mode) for p, r in zip(predictions, references)]
    out = {"accuracy": 100.0 * sum(hits) / len(hits), "n": float(len(hits))}
    if categories is not None:
        per = defaultdict(list)
        for hit, cat in zip(hits, categories):
            per[cat].append(hit)
        for cat in sorted(per):
            out[f"accuracy/{cat}"] = 100.0 * sum(per[cat]) / len(per[cat])
    return out


def perplexity(nll_sum: float, n_tokens: int) -> dict[str, float]:
    """Token-level perplexity exp(mean NLL) from a summed negative log-likelihood (nats)."""
    if n_tokens <= 0:
        raise ValueError("metrics: perplexity needs at least one scored token")
    loss = nll_sum / n_tokens
    return {"perplexity": math.exp(loss), "loss": loss, "n_tokens": float(n_tokens)}


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0.0 for a single value) over seeds."""
    vals = [float(v) for v in values]
    if not vals:
        return math.nan, math.nan
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def binomial_stderr(accuracy_pct: float, n: int) -> float:
    """Standard error (in points) of one accuracy measured on n questions: how noisy a single run is."""
    p = accuracy_pct / 100.0
    return 100.0 * math.sqrt(max(p * (1 - p), 0.0) / n) if n > 0 else math.nan
