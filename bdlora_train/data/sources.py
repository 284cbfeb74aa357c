"""Where rows come from: a `dataset` spec resolved to its source and read (data/rows.py lists the specs).

task:<name> a built-in task, glue:<task> a GLUE task from the Hub (with the templates that verbalize it),
packaged:<file> a file shipped in bdlora_train/packaged_data/, a local file (.jsonl / .json / .csv as written,
data/written_rows.py; .parquet through `datasets`), a `save_to_disk` directory, or a Hub dataset.
"""

from __future__ import annotations

from pathlib import Path

from bdlora_train.core.errors import DataError, first_line
from bdlora_train.data.written_rows import INDEXED, read_written

PACKAGED_DIR = Path(__file__).parent.parent / "packaged_data"  # bdlora_train/packaged_data
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}

# GLUE's 8 tasks of the paper's average (WNLI excluded, as usual): prompt template, completion template.
GLUE_TASKS = {
    "cola": ("Sentence: {sentence}\nIs this sentence grammatically acceptable?\nAnswer:", " {label_text}"),
    "sst2": ("Review: {sentence}\nSentiment:", " {label_text}"),
    "mrpc": (
        "Sentence 1: {sentence1}\nSentence 2: {sentence2}\nAre the sentences equivalent?\nAnswer:",
        " {label_text}",
    ),
    "qqp": (
        "Question 1: {question1}\nQuestion 2: {question2}\nAre the questions duplicates?\nAnswer:",
        " {label_text}",
    ),
    "stsb": ("Sentence 1: {sentence1}\nSentence 2: {sentence2}\nSimilarity from 0 to 5:", " {label:.1f}"),
    "mnli": (
        "Premise: {premise}\nHypothesis: {hypothesis}\nEntailment, neutral or contradiction?\nAnswer:",
        " {label_text}",
    ),
    "qnli": (
        "Question: {question}\nSentence: {sentence}\nDoes the sentence answer the question?\nAnswer:",
        " {label_text}",
    ),
    "rte": (
        "Sentence 1: {sentence1}\nSentence 2: {sentence2}\nDoes sentence 1 entail sentence 2?\nAnswer:",
        " {label_text}",
    ),
}


def read_source(spec: str, seed: int, config: str | None, split: str):
    """(dataset, RowNames) of a `dataset` spec."""
    import datasets

    if spec.startswith("task:"):
        from bdlora_train.tasks.registry import get_task  # lazy: tasks import torch and their data on first use

        return get_task(spec.split(":", 1)[1]).train_dataset(seed), INDEXED
    if spec.startswith("glue:"):
        task = spec.split(":", 1)[1]
        if task not in GLUE_TASKS:
            raise DataError(f"dataset {spec}: unknown GLUE task; use one of {sorted(GLUE_TASKS)}")
        return _load_hub("nyu-mll/glue", task, split, spec), INDEXED
    if spec.startswith("packaged:"):
        path = PACKAGED_DIR / spec.split(":", 1)[1]
        if not path.is_file():
            known = sorted(p.name for p in PACKAGED_DIR.iterdir() if p.suffix in LOCAL_FORMATS)
            raise DataError(f"dataset {spec}: no such packaged file; packaged files are {known}")
        spec = str(path)
    path = Path(spec)
    if path.is_dir():
        return _load_saved(path, split, spec), INDEXED
    if path.suffix in LOCAL_FORMATS:
        if not path.is_file():
            raise DataError(f"dataset {spec}: file not found; give an existing .jsonl/.json/.csv/.parquet path")
        if path.suffix != ".parquet":
            return read_written(path, spec)
        try:
            dataset = datasets.load_dataset("parquet", data_files=str(path), split="train")
        except Exception as err:  # datasets raises many types for malformed files
            raise DataError(f"dataset {spec}: cannot be read as parquet ({first_line(err)})") from None
        return dataset, INDEXED
    if path.exists():
        raise DataError(f"dataset {spec}: unsupported file type; use .jsonl, .json, .csv or .parquet")
    if spec.startswith((".", "/", "~")):
        raise DataError(f"dataset {spec}: no such file or directory")
    return _load_hub(spec, config, split, spec), INDEXED


def _load_saved(path: Path, split: str, spec: str):
    """A directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    import datasets

    if not any((path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise DataError(f"dataset {spec}: directory is not a `datasets` save_to_disk output (no dataset_info.json)")
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises several types for a damaged directory
        raise DataError(f"dataset {spec}: cannot load the saved dataset ({first_line(err)})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"dataset {spec}: has splits {sorted(loaded)}, not '{split}'; set dataset_split")
        return loaded[split]
    return loaded


def _load_hub(name: str, config: str | None, split: str, spec: str):
    import datasets

    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as err:  # offline, unknown name, unknown split: all surface here
        raise DataError(
            f"dataset {spec}: cannot load '{name}' (config {config}, split {split}) from the Hub or cache "
            f"({first_line(err)}); use task:<name>, packaged:<file> or a local .jsonl/.csv/.parquet file"
        ) from None
