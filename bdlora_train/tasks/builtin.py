"""The built-in tasks, on real text that ships in the gensim wheel's test_data (everything runs offline):
analogies (word2vec questions-words.txt), news-ppl (Lee news corpus), arithmetic (generated). See tasks.py."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

from bdlora_train.core.errors import TaskError
from bdlora_train.tasks.kinds import GenerationTask, PerplexityTask, carve_validation, hash_order


def gensim_test_data() -> Path:
    """gensim's bundled test_data folder, found without importing gensim (its scipy deps are not installed)."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise TaskError(
            "tasks: the offline task data ships in the gensim wheel, which is not installed; "
            "run `pip install --no-deps 'gensim>=4.3'` (or `make install`)"
        )
    path = Path(spec.submodule_search_locations[0]) / "test" / "test_data"
    if not path.is_dir():
        raise TaskError(
            f"tasks: {path} is missing; reinstall gensim with `pip install --no-deps --force-reinstall gensim`"
        )
    return path


def analogy_prompt(a: str, b: str, c: str) -> str:
    return f"{a} is to {b} as {c} is to"


def load_analogies(path: Path | None = None) -> list[dict]:
    """Rows {prompt, completion, category} from a word2vec questions-words file (": category" headers)."""
    path = path or gensim_test_data() / "questions-words.txt"
    rows, category = [], None
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith(":"):
            category = line[1:].strip()
            continue
        words = line.split()
        if len(words) != 4 or category is None:
            raise TaskError(
                f"task analogies: {path}:{line_no}: expected a ': category' header then 4 words per line, got {line!r}"
            )
        a, b, c, d = words
        rows.append({"prompt": analogy_prompt(a, b, c), "completion": f" {d}", "category": category})
    return rows


def analogies(
    test_per_category: int = 20, validation_per_category: int = 20, path: Path | None = None
) -> GenerationTask:
    """Held-out: the first `test_per_category` questions of each of the 14 categories in SHA-256 order;
    validation: the first `validation_per_category` of each category's remaining questions in another SHA-256
    order (0: none); train: every other distinct question."""
    rows = load_analogies(path)
    key = lambda r: r["prompt"] + r["completion"]  # noqa: E731
    by_cat: dict[str, list[dict]] = {}
    for row in rows:
        by_cat.setdefault(row["category"], []).append(row)
    # 171 questions appear in both capital-common-countries and capital-world: a question held out in one
    # category must not be trained on through the other, and train keeps one copy of each question.
    test, held = [], set()
    for cat_rows in by_cat.values():
        picked = [r for r in hash_order(cat_rows, key, "analogies") if key(r) not in held][:test_per_category]
        held |= {key(r) for r in picked}
        test += picked
    train, seen = [], set(held)
    for row in rows:
        if key(row) not in seen:
            seen.add(key(row))
            train.append(row)
    train, validation = carve_validation(
        train, key, "analogies-validation", validation_per_category, by=lambda r: r["category"]
    )
    return GenerationTask(
        "analogies", train, test, match="first_word", max_new_tokens=4, validation_rows=validation or None
    )


def load_lee_articles(path: Path | None = None) -> list[str]:
    path = path or gensim_test_data() / "lee_background.cor"
    return [
        line.strip() for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()
    ]


def news_ppl(
    test_fraction: float = 0.1,
    validation_fraction: float = 0.1,
    passage_words: int = 64,
    eval_seq_len: int = 256,
    path: Path | None = None,
) -> PerplexityTask:
    """Test: the first `test_fraction` of the Lee background articles in SHA-256 order (30 of 300); validation:
    `validation_fraction` of all articles (30) from the rest in another SHA-256 order (0: none); train: the rest.

    (Before validation splits existed, `validation_fraction` named the test fraction; it is `test_fraction` now.)
    """
    for name, value in (("test_fraction", test_fraction), ("validation_fraction", validation_fraction)):
        if not 0 <= value < 1:
            raise TaskError(f"task news-ppl: {name}={value} must be in [0, 1)")
    articles = load_lee_articles(path)
    ordered = hash_order(articles, lambda t: t, "news-ppl")
    n_test = max(1, round(test_fraction * len(ordered)))
    n_val = round(validation_fraction * len(ordered))
    train, validation = carve_validation(ordered[n_test:], lambda t: t, "news-ppl-validation", n_val)
    return PerplexityTask(
        "news-ppl", train, ordered[:n_test], passage_words, eval_seq_len, validation_texts=validation or None
    )


def _arithmetic_item(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        a, b = rng.randint(10, 9999), rng.randint(10, 9999)
        return {"prompt": f"{a} + {b} =", "completion": f" {a + b}", "category": "addition"}
    a, b = rng.randint(10, 999), rng.randint(2, 99)
    return {"prompt": f"{a} * {b} =", "completion": f" {a * b}", "category": "multiplication"}


def _arithmetic_questions(rng: random.Random, n: int, exclude: set) -> list[dict]:
    out = []
    while len(out) < n:
        item = _arithmetic_item(rng)
        if item["prompt"] not in exclude:
            exclude.add(item["prompt"])
            out.append(item)
    return out


def arithmetic(n_train: int = 20000, n_test: int = 200, n_validation: int = 200) -> GenerationTask:
    """Addition of 2-4 digit numbers and multiplication of a 2-3 digit by a 1-2 digit number.

    Test questions come from a fixed RNG ("arithmetic-test"), validation questions from another
    ("arithmetic-validation", none of them a test question); training questions from a third, with every test
    and validation prompt removed, so no held-out question is trained on.
    """
    held: set = set()
    test = _arithmetic_questions(random.Random("arithmetic-test"), n_test, held)
    validation = _arithmetic_questions(random.Random("arithmetic-validation"), n_validation, held)
    rng_train, train = random.Random("arithmetic-train"), []
    while len(train) < n_train:
        item = _arithmetic_item(rng_train)
        if item["prompt"] not in held:
            train.append(item)
    return GenerationTask(
        "arithmetic", train, test, match="first_word", max_new_tokens=8, validation_rows=validation or None
    )
