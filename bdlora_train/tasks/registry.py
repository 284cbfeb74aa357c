"""The task registry: built-in tasks by name, task plugins (.yaml / .py files, Hub datasets), `get_task`."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path

from bdlora_train.core.errors import TaskError, first_line
from bdlora_train.tasks.builtin import analogies, arithmetic, news_ppl
from bdlora_train.tasks.kinds import GenerationTask, PerplexityTask, Task, carve_validation, hash_order

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
        ordered = hash_order(train, key, name)
        n_test = max(1, round(test_fraction * len(ordered)))
        train, test = ordered[n_test:], ordered[:n_test]
    if held_keys[:1] == ["test"] and len(held_keys) > 1:
        return train, _rows_from_dataset(splits[held_keys[1]], name, columns), test
    if not 0 <= validation_fraction < 1:
        raise TaskError(f"task {name}: validation_fraction={validation_fraction} must be in [0, 1)")
    train, validation = carve_validation(train, key, f"{name}-validation", round(validation_fraction * len(train)))
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
    """A task by name: built-in, a local .yaml/.yml or .py plugin file, or a Hub dataset with prompt/completion
    columns."""
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
