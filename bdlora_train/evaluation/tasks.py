"""Evaluation tasks: a train set of prompt/completion pairs and a held-out score, on real offline data.

    task = get_task("analogies")          # or "news-ppl", "arithmetic", "org/dataset", "my_task.yaml", "my_task.py"
    train = task.train_dataset(seed=0)    # datasets.Dataset with "prompt", "completion" (no EOS: the trainer adds it)
    scores = task.evaluate(model, tokenizer)   # {"accuracy": 81.4, "accuracy/family": 90.0, ...}
    val = task.evaluate(model, tokenizer, split="validation")   # the split hyper-parameters are chosen on

Built-in tasks (data ships in the gensim wheel's test_data, so everything runs offline):
  analogies   word2vec analogy set (questions-words.txt, 14 categories). Prompt "Athens is to Greece as
              Baghdad is to" -> " Iraq"; exact match of the first generated word (greedy, 4 tokens).
  news-ppl    Lee news corpus (lee_background.cor, 300 articles): train on passages of the training
              articles, score perplexity (loss on all tokens) on the held-out articles.
  arithmetic  generated multi-digit addition and multiplication, "123 + 456 =" -> " 579"; exact match.

Three disjoint splits, deterministic and independent of the training seed: items are ordered by the SHA-256
of "<task>:<item>" and the first ones go to test (analogies: the first `test_per_category` of each
category; news-ppl: the first `test_fraction` of articles). The validation split is then carved from what is
left (the training data) the same way under another salt ("<task>-validation:<item>"), and training gets the
rest. The training seed only shuffles the training rows, so every method, seed and hyper-parameter setting is
selected on the very same validation items and scored on the very same test items.
"""

from __future__ import annotations

import hashlib
import importlib.util
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bdlora_train.errors import TaskError, first_line
from bdlora_train.evaluation import metrics


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


def _hash_order(items: Sequence, key: Callable[[object], str], salt: str) -> list:
    """Items sorted by SHA-256 of "<salt>:<key>": a fixed pseudo-random order that no RNG state can change."""
    return sorted(items, key=lambda item: hashlib.sha256(f"{salt}:{key(item)}".encode()).hexdigest())


def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def _model_device(model) -> torch.device:
    return next(_unwrap(model).parameters()).device


def _check_tokenizer(tokenizer, task: str):
    if tokenizer is None:
        raise TaskError(
            f"task {task}: evaluation needs a tokenizer; the model spec gave none (tiny models reuse the "
            "embedded tokenizer)"
        )


class Task:
    """A named task: training pairs plus a held-out metric. Subclass or use the factories below."""

    name: str = "task"
    primary_metric: str = "accuracy"
    higher_is_better: bool = True
    # The held-out splits `evaluate(split=...)` accepts; a task without "validation" cannot be tuned on.
    splits: tuple[str, ...] = ("test",)

    def train_dataset(self, seed: int = 0):
        """A datasets.Dataset with string columns "prompt" and "completion", shuffled by `seed`."""
        raise NotImplementedError

    def test_dataset(self):
        raise NotImplementedError

    def evaluate(
        self,
        model,
        tokenizer,
        batch_size: int = 32,
        limit: int | None = None,
        progress: bool = False,
        split: str = "test",
    ) -> dict[str, float]:
        raise NotImplementedError

    def split_sizes(self) -> dict[str, int]:
        """{"train": n, "validation": n, "test": n}: part of a sweep's fingerprint, so runs trained on other
        splits are never mixed into one table."""
        raise NotImplementedError

    def _held_out(self, split: str, held: dict):
        if split not in held or held[split] is None:
            raise TaskError(
                f"task {self.name}: no '{split}' split; this task has {list(self.splits)} (a validation split is "
                "needed to choose hyper-parameters: give the task one, e.g. validation_fraction in a task YAML)"
            )
        return held[split]

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r})"


class GenerationTask(Task):
    """Prompt -> short answer; scored by exact match of greedy generations (first word or whole answer)."""

    primary_metric = "accuracy"
    higher_is_better = True

    def __init__(
        self,
        name: str,
        train_rows: list[dict],
        test_rows: list[dict],
        match: str = "first_word",
        max_new_tokens: int = 4,
        validation_rows: list[dict] | None = None,
    ):
        if match not in metrics.MATCH_MODES:
            raise TaskError(f"task {name}: match '{match}' is not one of {metrics.MATCH_MODES}")
        if not train_rows or not test_rows or validation_rows == []:
            raise TaskError(
                f"task {name}: empty split ({len(train_rows)} train, {len(validation_rows or [])} validation, "
                f"{len(test_rows)} test rows)"
            )
        self.name, self.match, self.max_new_tokens = name, match, max_new_tokens
        self._train, self._test, self._validation = train_rows, test_rows, validation_rows
        self.splits = ("validation", "test") if validation_rows else ("test",)

    def split_sizes(self) -> dict[str, int]:
        return {"train": len(self._train), "validation": len(self._validation or []), "test": len(self._test)}

    def train_dataset(self, seed: int = 0):
        from datasets import Dataset

        rows = [{"prompt": r["prompt"], "completion": r["completion"]} for r in self._train]
        random.Random(seed).shuffle(rows)
        return Dataset.from_list(rows)

    def test_dataset(self):
        from datasets import Dataset

        return Dataset.from_list([{"category": "all", **r} for r in self._test])

    @torch.no_grad()
    def generate(
        self, model, tokenizer, prompts: Sequence[str], batch_size: int = 32, progress: bool = False
    ) -> list[str]:
        """Greedy continuations of `prompts`, batched with left padding (decoder-only models need it)."""
        _check_tokenizer(tokenizer, self.name)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        side = tokenizer.padding_side
        tokenizer.padding_side = "left"
        device, was_training = _model_device(model), _unwrap(model).training
        model.eval()
        outputs = []
        bar = _progress(range(0, len(prompts), batch_size), progress, f"eval {self.name}")
        try:
            for start in bar:
                batch = tokenizer(
                    list(prompts[start : start + batch_size]),
                    return_tensors="pt",
                    padding=True,
                    add_special_tokens=True,
                ).to(device)
                generated = model.generate(
                    **batch, max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=pad_id, num_beams=1
                )
                new = generated[:, batch["input_ids"].shape[1] :]
                outputs += tokenizer.batch_decode(new, skip_special_tokens=True)
        finally:
            tokenizer.padding_side = side
            if was_training:
                model.train()
        return outputs

    def evaluate(
        self,
        model,
        tokenizer,
        batch_size: int = 32,
        limit: int | None = None,
        progress: bool = False,
        split: str = "test",
    ) -> dict[str, float]:
        rows = self._held_out(split, {"test": self._test, "validation": self._validation})
        rows = rows if limit is None else _limit_per_category(rows, limit)
        preds = self.generate(model, tokenizer, [r["prompt"] for r in rows], batch_size, progress)
        cats = [r.get("category", "all") for r in rows]
        return metrics.accuracy(
            preds, [r["completion"] for r in rows], cats if len(set(cats)) > 1 else None, self.match
        )


class PerplexityTask(Task):
    """Domain adaptation: train on passages of the training documents, score perplexity on held-out ones."""

    primary_metric = "perplexity"
    higher_is_better = False

    def __init__(
        self,
        name: str,
        train_texts: list[str],
        test_texts: list[str],
        passage_words: int = 64,
        eval_seq_len: int = 256,
        validation_texts: list[str] | None = None,
    ):
        if not train_texts or not test_texts or validation_texts == []:
            raise TaskError(
                f"task {name}: empty split ({len(train_texts)} train, {len(validation_texts or [])} validation, "
                f"{len(test_texts)} test documents)"
            )
        self.name, self.passage_words, self.eval_seq_len = name, passage_words, eval_seq_len
        self._train, self._test, self._validation = train_texts, test_texts, validation_texts
        self.splits = ("validation", "test") if validation_texts else ("test",)

    def split_sizes(self) -> dict[str, int]:
        return {"train": len(self._train), "validation": len(self._validation or []), "test": len(self._test)}

    def passages(self) -> list[str]:
        """Training documents cut at sentence ends into passages of about `passage_words` words, so that a
        short max_seq_length truncates nothing and every training token is seen."""
        out = []
        for text in self._train:
            current: list[str] = []
            for sentence in re.split(r"(?<=[.!?])\s+", text.strip()):
                words = sentence.split()
                if current and len(current) + len(words) > self.passage_words:
                    out.append(" ".join(current))
                    current = []
                current += words
            if current:
                out.append(" ".join(current))
        return out

    def train_dataset(self, seed: int = 0):
        from datasets import Dataset

        # Empty prompt: with the completion-only loss of the trainer this is the loss on all tokens.
        rows = [{"prompt": "", "completion": p} for p in self.passages()]
        random.Random(seed).shuffle(rows)
        return Dataset.from_list(rows)

    def test_dataset(self):
        from datasets import Dataset

        return Dataset.from_list([{"text": t} for t in self._test])

    @torch.no_grad()
    def evaluate(
        self,
        model,
        tokenizer,
        batch_size: int = 8,
        limit: int | None = None,
        progress: bool = False,
        split: str = "test",
    ) -> dict[str, float]:
        """Perplexity over every token of the held-out documents, each cut into windows of eval_seq_len."""
        _check_tokenizer(tokenizer, self.name)
        texts = self._held_out(split, {"test": self._test, "validation": self._validation})
        texts = texts if limit is None else texts[:limit]
        windows = []
        for text in texts:
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
            windows += [ids[i : i + self.eval_seq_len] for i in range(0, len(ids), self.eval_seq_len)]
        windows = [w for w in windows if len(w) > 1]
        device, was_training = _model_device(model), _unwrap(model).training
        model.eval()
        nll, count = 0.0, 0
        try:
            for start in _progress(range(0, len(windows), batch_size), progress, f"eval {self.name}"):
                chunk = windows[start : start + batch_size]
                width = max(len(w) for w in chunk)
                ids = torch.zeros(len(chunk), width, dtype=torch.long)
                mask = torch.zeros(len(chunk), width, dtype=torch.long)
                for row, w in enumerate(chunk):
                    ids[row, : len(w)] = torch.tensor(w)
                    mask[row, : len(w)] = 1
                ids, mask = ids.to(device), mask.to(device)
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
                target, keep = ids[:, 1:], mask[:, 1:].bool()
                losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
                nll += losses[keep].sum().item()
                count += int(keep.sum())
        finally:
            if was_training:
                model.train()
        return metrics.perplexity(nll, count)


def _limit_per_category(rows: list[dict], limit: int) -> list[dict]:
    """At most `limit` rows of each category, in split order (so a limited run is a subset of a full one)."""
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        cat = r.get("category", "all")
        if seen.get(cat, 0) < limit:
            out.append(r)
            seen[cat] = seen.get(cat, 0) + 1
    return out


def _progress(iterable, enabled: bool, desc: str):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, leave=False)


# ---------------------------------------------------------------------------------------------- built-in tasks


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


def _carve_validation(rows: list, key: Callable[[object], str], salt: str, n: int, by=None) -> tuple[list, list]:
    """(train, validation): the first `n` of `rows` in SHA-256 order under `salt` (per group of `by`, if given)
    go to validation; train keeps the rest in their original order."""
    groups: dict = {}
    for row in rows:
        groups.setdefault(by(row) if by else None, []).append(row)
    picked = {key(r) for group in groups.values() for r in _hash_order(group, key, salt)[:n]}
    return [r for r in rows if key(r) not in picked], [r for r in rows if key(r) in picked]


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
        picked = [r for r in _hash_order(cat_rows, key, "analogies") if key(r) not in held][:test_per_category]
        held |= {key(r) for r in picked}
        test += picked
    train, seen = [], set(held)
    for row in rows:
        if key(row) not in seen:
            seen.add(key(row))
            train.append(row)
    train, validation = _carve_validation(
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
    ordered = _hash_order(articles, lambda t: t, "news-ppl")
    n_test = max(1, round(test_fraction * len(ordered)))
    n_val = round(validation_fraction * len(ordered))
    train, validation = _carve_validation(ordered[n_test:], lambda t: t, "news-ppl-validation", n_val)
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


BUILTIN: dict[str, Callable[..., Task]] = {"analogies": analogies, "news-ppl": news_ppl, "arithmetic": arithmetic}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    """Make `get_task(name)` return `factory()`: the in-process way to add a task."""
    BUILTIN[name] = factory


# ---------------------------------------------------------------------------------------------- plugins


def _rows_from_dataset(ds, name: str, columns: Sequence[str]) -> list[dict]:
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise TaskError(f"task {name}: dataset has columns {ds.column_names}, missing {missing}")
    keep = [c for c in (*columns, "category") if c in ds.column_names]
    return [{c: str(row[c]) for c in keep} for row in ds]


def _split_rows(
    name: str, splits: dict, columns: Sequence[str], test_fraction: float, validation_fraction: float
) -> tuple[list[dict], list[dict], list[dict]]:
    """(train, validation, test) rows from a DatasetDict. Test: its `test` split, else its validation/dev split,
    else a hashed slice of train. Validation: its validation/dev split when `test` exists, else a hashed slice
    (`validation_fraction` of train, another salt; 0: none) of what training would get."""
    train_key = "train" if "train" in splits else next(iter(splits))
    train = _rows_from_dataset(splits[train_key], name, columns)
    held_keys = [k for k in ("test", "validation", "valid", "dev") if k in splits and k != train_key]
    key = lambda r: "\x1f".join(r[c] for c in columns)  # noqa: E731
    if held_keys:
        test = _rows_from_dataset(splits[held_keys[0]], name, columns)
    else:
        ordered = _hash_order(train, key, name)
        n_test = max(1, round(test_fraction * len(ordered)))
        train, test = ordered[n_test:], ordered[:n_test]
    if held_keys[:1] == ["test"] and len(held_keys) > 1:
        return train, _rows_from_dataset(splits[held_keys[1]], name, columns), test
    if not 0 <= validation_fraction < 1:
        raise TaskError(f"task {name}: validation_fraction={validation_fraction} must be in [0, 1)")
    train, validation = _carve_validation(train, key, f"{name}-validation", round(validation_fraction * len(train)))
    return train, validation, test


def _make_task(
    name: str,
    splits: dict,
    kind: str = "generation",
    match: str = "exact",
    max_new_tokens: int = 32,
    test_fraction: float = 0.1,
    validation_fraction: float = 0.1,
    **perplexity_opts,
) -> Task:
    if kind == "generation":
        train, val, test = _split_rows(name, splits, ("prompt", "completion"), test_fraction, validation_fraction)
        return GenerationTask(
            name, train, test, match=match, max_new_tokens=max_new_tokens, validation_rows=val or None
        )
    if kind == "perplexity":
        train, val, test = _split_rows(name, splits, ("text",), test_fraction, validation_fraction)
        texts = lambda rows: [r["text"] for r in rows]  # noqa: E731
        return PerplexityTask(name, texts(train), texts(test), validation_texts=texts(val) or None, **perplexity_opts)
    raise TaskError(f"task {name}: kind '{kind}' is not 'generation' or 'perplexity'")


def task_from_yaml(path: Path) -> Task:
    """A task described by a YAML file (keys: name, kind, data_files or dataset, match, max_new_tokens,
    test_fraction, validation_fraction, and for perplexity passage_words / eval_seq_len). data_files are relative
    to the YAML."""
    import yaml
    from datasets import load_dataset

    spec = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(spec, dict):
        raise TaskError(f"task {path}: expected a mapping of keys, got {type(spec).__name__}")
    known = {
        "name",
        "kind",
        "data_files",
        "dataset",
        "match",
        "max_new_tokens",
        "test_fraction",
        "validation_fraction",
        "passage_words",
        "eval_seq_len",
    }
    unknown = sorted(set(spec) - known)
    if unknown:
        raise TaskError(f"task {path}: unknown keys {unknown}; allowed: {sorted(known)}")
    name = spec.pop("name", Path(path).stem)
    if "data_files" in spec:
        files = spec.pop("data_files")
        files = {"train": files} if isinstance(files, str) else dict(files)
        files = {k: str((Path(path).parent / v).resolve()) for k, v in files.items()}
        suffix = Path(next(iter(files.values()))).suffix.lstrip(".")
        builder = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet", "txt": "text"}.get(suffix)
        if builder is None:
            raise TaskError(
                f"task {path}: data file type '.{suffix}' unsupported; use .jsonl, .json, .csv, .parquet or .txt"
            )
        splits = load_dataset(builder, data_files=files)
    elif "dataset" in spec:
        splits = _load_hub_dataset(spec.pop("dataset"))
    else:
        raise TaskError(f"task {path}: give `data_files` (local files) or `dataset` (a Hub dataset id)")
    return _make_task(name, splits, **spec)


def task_from_python(path: Path) -> Task:
    """A task defined in a Python file that sets `TASK = <Task>` or defines `get_task() -> Task`."""
    spec = importlib.util.spec_from_file_location(f"bdlora_task_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    task = getattr(module, "TASK", None) or (module.get_task() if hasattr(module, "get_task") else None)
    if not isinstance(task, Task):
        raise TaskError(f"task {path}: the file must set TASK = <Task instance> or define get_task() returning one")
    return task


def _load_hub_dataset(dataset_id: str):
    from datasets import load_dataset

    try:
        return load_dataset(dataset_id)
    except Exception as err:  # noqa: BLE001 - datasets raises many types for "not available"; report one line
        raise TaskError(
            f"task {dataset_id}: not a built-in task ({', '.join(sorted(BUILTIN))}), not a local .yaml/.py file, "
            f"and the Hub dataset could not be loaded ({type(err).__name__}: {first_line(err, 120)}); "
            "check the name or go online (HF_HUB_OFFLINE=0)"
        ) from None


def get_task(name: str, **options) -> Task:
    """A task by name: built-in, a local .yaml/.yml or .py plugin file, or a Hub dataset with prompt/completion "
    "columns."""
    if name in BUILTIN:
        try:
            return BUILTIN[name](**options)
        except TypeError as err:
            raise TaskError(f"task {name}: bad option ({err})") from None
    path = Path(name)
    if path.suffix in (".yaml", ".yml", ".py"):
        if not path.is_file():
            raise TaskError(f"task {name}: no such file")
        return task_from_yaml(path) if path.suffix != ".py" else task_from_python(path)
    if "/" not in name:
        raise TaskError(
            f"task {name}: unknown; use one of {sorted(BUILTIN)}, a .yaml/.py task file, or a Hub dataset id 'org/name'"
        )
    return _make_task(name, _load_hub_dataset(name), **options)


__all__ = [
    "BUILTIN",
    "GenerationTask",
    "PerplexityTask",
    "Task",
    "TaskError",
    "analogies",
    "arithmetic",
    "get_task",
    "news_ppl",
    "register_task",
]
