"""The task types: `Task` (the interface `bdlora compare` scores), `GenerationTask` (exact match of greedy
generations) and `PerplexityTask` (held-out perplexity), and the deterministic split helpers they are built with.
Built-in tasks are in builtin_tasks.py, the registry and plugin loaders in tasks.py."""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence

import torch

from bdlora_train.core.errors import TaskError
from bdlora_train.tasks import metrics


def hash_order(items: Sequence, key: Callable[[object], str], salt: str) -> list:
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

    def _set_splits(self, name: str, train: list, test: list, validation: list | None, unit: str) -> None:
        """Keep the three splits (validation optional, but never empty when given)."""
        if not train or not test or validation == []:
            raise TaskError(
                f"task {name}: empty split ({len(train)} train, {len(validation or [])} validation, "
                f"{len(test)} test {unit})"
            )
        self.name, self._train, self._test, self._validation = name, train, test, validation
        self.splits = ("validation", "test") if validation else ("test",)

    def split_sizes(self) -> dict[str, int]:
        """{"train": n, "validation": n, "test": n}: part of a sweep's fingerprint, so runs trained on other
        splits are never mixed into one table."""
        if not hasattr(self, "_train"):  # a subclass that keeps its own splits
            raise NotImplementedError
        return {"train": len(self._train), "validation": len(self._validation or []), "test": len(self._test)}

    def _held_out(self, split: str):
        """The rows (or texts) of a held-out split, or a TaskError when the task has no such split."""
        held = {"test": self._test, "validation": self._validation}
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
        self._set_splits(name, train_rows, test_rows, validation_rows, "rows")
        self.match, self.max_new_tokens = match, max_new_tokens

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
        rows = self._held_out(split)
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
        self._set_splits(name, train_texts, test_texts, validation_texts, "documents")
        self.passage_words, self.eval_seq_len = passage_words, eval_seq_len

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
        texts = self._held_out(split)
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


def carve_validation(rows: list, key: Callable[[object], str], salt: str, n: int, by=None) -> tuple[list, list]:
    """(train, validation): the first `n` of `rows` in SHA-256 order under `salt` (per group of `by`, if given)
    go to validation; train keeps the rest in their original order."""
    groups: dict = {}
    for row in rows:
        groups.setdefault(by(row) if by else None, []).append(row)
    picked = {key(r) for group in groups.values() for r in hash_order(group, key, salt)[:n]}
    return [r for r in rows if key(r) not in picked], [r for r in rows if key(r) in picked]
