"""Training data: any source, in any of the formats practitioners bring, as canonical rows, checked row by row.

Sources (the recipe's `dataset` / `eval_dataset` key):
  task:<name>          a built-in task (bdlora_train/tasks: analogies, news-ppl, arithmetic, ...)
  glue:<task>          a GLUE task from the Hub (nyu-mll/glue), verbalized as prompt -> label word
  packaged:<file>      a file shipped in bdlora_train/data/ (the tiny recipe's data)
  a local .jsonl/.json/.csv/.parquet file, a directory written by `datasets`' save_to_disk, or a Hub dataset
Formats (`dataset_format`, "auto" detects them from the columns), the ones TRL and axolotl users bring:
  prompt-completion    `prompt` + `completion` strings, or TRL's conversational form: both lists of messages
  messages             `messages`: a conversation ({"role", "content"} dicts); assistant turns are learned
  text                 `text`: plain text, every token learned (language modeling)
  alpaca               `instruction`, `input` (may be empty), `output`, with the Stanford Alpaca prompt
  sharegpt             `conversations`: [{"from": "human" | "gpt" | "system", "value": ...}]
Other column layouts are mapped with `prompt_template` / `completion_template` (str.format over a row).
Canonical rows are one of: {prompt, completion} strings; {messages, learn_from} (assistant turns at index >=
learn_from are learned); {text}. Values are read as the file means them: CSV cells are text exactly as written
(no type guessing: "074" stays "074", an empty cell is missing), and a JSON number in a text column is its text
(`"completion": 42` learns "42"). Every malformed row is reported with its column and where the file has it: the
line of a JSON Lines file, the 1-based data row of a CSV (after the header), the 1-based record of a .json file,
the index of any other source (dataset[i]).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bdlora_train.core.errors import DataError, first_line

PACKAGED_DIR = Path(__file__).parent.parent / "data"  # bdlora_train/data
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
FORMATS = ("auto", "prompt-completion", "messages", "text", "alpaca", "sharegpt")
CANONICAL = {"completion": ("prompt", "completion"), "chat": ("messages", "learn_from"), "text": ("text",)}

# Stanford Alpaca's prompts (github.com/tatsu-lab/stanford_alpaca, train.py PROMPT_DICT).
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}

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


@dataclass(frozen=True)
class RowNames:
    """How a source names its rows in messages: `name(i)` for the i-th row read (0-based), and what a missing
    value is in it ("null" in JSON, an empty cell in a CSV)."""

    name: Callable[[int], str] = lambda i: f"index {i}"
    missing: str = "null"


INDEXED = RowNames()


def _row_names(path: Path, lines: list[int] | None) -> RowNames:
    if path.suffix == ".jsonl" and lines is not None:
        return RowNames(lambda i: f"line {lines[i]}" if i < len(lines) else f"index {i}")
    if path.suffix == ".csv":
        return RowNames(lambda i: f"data row {i + 1}", missing="an empty cell")
    if path.suffix == ".json":
        return RowNames(lambda i: f"record {i + 1}")
    return INDEXED


def load_rows(
    spec: str,
    seed: int = 0,
    config: str | None = None,
    split: str = "train",
    prompt_template: str | None = None,
    completion_template: str | None = None,
    max_samples: int | None = None,
    dataset_format: str = "auto",
):
    """A `datasets.Dataset` of canonical rows (see the module docstring), every row checked, non-empty."""
    dataset, names = _load_source(spec, seed, config, split)
    if spec.startswith("glue:") and prompt_template is None and completion_template is None:
        prompt_template, completion_template = GLUE_TASKS[spec.split(":", 1)[1]]
    if prompt_template is not None or completion_template is not None:
        dataset = apply_templates(dataset, prompt_template, completion_template, spec, names)
        dataset_format = "prompt-completion"
    if max_samples is not None:
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    if len(dataset) == 0:
        raise DataError(f"dataset {spec}: is empty (0 rows); point `dataset` at data with at least one row")
    dataset = to_canonical(dataset, detect_format(dataset, dataset_format, spec), spec, names)
    check_rows(dataset, spec, names)
    return dataset


def split_eval(dataset, fraction: float):
    """(train, eval) with `fraction` of the rows held out; deterministic (fixed seed), independent of the run seed."""
    n_eval = max(1, round(len(dataset) * fraction))
    if n_eval >= len(dataset):
        raise DataError(f"eval_fraction={fraction} leaves no training rows out of {len(dataset)}; lower it")
    parts = dataset.train_test_split(test_size=n_eval, seed=0, shuffle=True)
    return parts["train"], parts["test"]


# --------------------------------------------------------------------------------------------------- sources


def _load_source(spec: str, seed: int, config: str | None, split: str):
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
        lines = _check_text_file(path, spec)
        # CSV has no types: every cell is read as the text it is (pandas would guess int, or float once a cell
        # is empty, and turn "74" into 74.0)
        features = _all_text(path) if path.suffix == ".csv" else None
        try:
            dataset = datasets.load_dataset(
                LOCAL_FORMATS[path.suffix], data_files=str(path), split="train", features=features
            )
        except Exception as err:  # datasets raises many types for malformed files
            raise DataError(
                f"dataset {spec}: cannot be read as {LOCAL_FORMATS[path.suffix]} ({first_line(err)})"
            ) from None
        return dataset, _row_names(path, lines)
    if path.exists():
        raise DataError(f"dataset {spec}: unsupported file type; use .jsonl, .json, .csv or .parquet")
    if spec.startswith((".", "/", "~")):
        raise DataError(f"dataset {spec}: no such file or directory")
    return _load_hub(spec, config, split, spec), INDEXED


def _all_text(path: Path):
    """`datasets` features reading every column of a CSV file as text (the header names the columns)."""
    from datasets import Features, Value

    with path.open(newline="", encoding="utf-8-sig") as handle:
        header = next(csv.reader(handle), [])
    return Features({name: Value("string") for name in header}) if header else None


def _check_text_file(path: Path, spec: str) -> list[int] | None:
    """UTF-8 and, for JSON Lines, one JSON object per line: a bad line is reported by number, before `datasets`
    turns it into a parser traceback. Returns the line number of each row of a JSON Lines file (blank lines hold
    none)."""
    if path.suffix == ".parquet":
        return None
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise DataError(f"dataset {spec}: line {line} is not UTF-8 text (byte {err.start}); re-save the file as UTF-8")
    if not text.strip():
        raise DataError(f"dataset {spec}: is empty (0 rows); point `dataset` at data with at least one row")
    if path.suffix != ".jsonl":
        return None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        rows.append(number)
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"dataset {spec}: line {number} is not valid JSON ({err.msg}, column {err.colno})"
            ) from None
        if not isinstance(row, dict):
            raise DataError(f"dataset {spec}: line {number} is a JSON {type(row).__name__}, not an object of columns")
    return rows


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


# --------------------------------------------------------------------------------------------------- formats


def detect_format(dataset, requested: str, spec: str) -> str:
    """The dataset's format: `requested`, or for "auto" the one its columns identify."""
    columns = set(dataset.column_names)
    needed = {
        "prompt-completion": {"prompt", "completion"},
        "messages": {"messages"},
        "text": {"text"},
        "alpaca": {"instruction", "output"},
        "sharegpt": {"conversations"},
    }
    if requested != "auto":
        if requested not in needed:
            raise DataError(f"dataset {spec}: dataset_format={requested!r}; use one of {list(FORMATS)}")
        missing = needed[requested] - columns
        if missing:
            raise DataError(
                f"dataset {spec}: dataset_format={requested} needs columns {sorted(missing)}; "
                f"the data has {sorted(columns)}"
            )
        return requested
    for name, cols in needed.items():
        if cols <= columns:
            return name
    raise DataError(
        f"dataset {spec}: columns {sorted(columns)} match no known format (prompt+completion, messages, text, "
        "alpaca instruction+output, sharegpt conversations); rename them or set prompt_template and "
        "completion_template (e.g. prompt_template='{question}' completion_template=' {answer}')"
    )


def to_canonical(dataset, fmt: str, spec: str, names: RowNames = INDEXED):
    """Rows of one canonical kind (see the module docstring); the source columns are dropped."""
    columns = list(dataset.column_names)
    if fmt == "prompt-completion":
        first = dataset[0]
        if isinstance(first["prompt"], list) or isinstance(first["completion"], list):  # TRL's conversational form
            fn = _conversational_prompt_completion
        else:
            return numbers_as_text(dataset.select_columns(["prompt", "completion"]))
    elif fmt == "messages":
        fn = lambda row: {"messages": row["messages"], "learn_from": 0}  # noqa: E731
    elif fmt == "text":
        return numbers_as_text(dataset.select_columns(["text"]))
    elif fmt == "alpaca":
        dataset = numbers_as_text(dataset, ("instruction", "input", "output"))
        fn = _alpaca
    else:
        fn = _sharegpt

    def convert(row: dict, index: int) -> dict:
        try:
            return fn(row)
        except (DataError, AttributeError, KeyError, TypeError) as err:  # a row the converter cannot read
            raise DataError(f"dataset {spec}: {names.name(index)}: not {fmt} shaped ({first_line(err)})") from None

    return dataset.map(convert, with_indices=True, remove_columns=columns, desc=f"format {fmt}")


def numbers_as_text(dataset, columns=None):
    """Numbers in text columns read as their text, as a reader of the file means them: a JSON `"completion": 42`
    learns "42" (Arrow's cast, which writes an integral float as an integer: a JSON column holding 74 and 2.5 is
    read as floats and still gives "74"); a column mixing text and numbers converts only the numbers. Booleans and
    every other type stay as they are, for check_rows to name."""
    from datasets import Value

    for column in columns or dataset.column_names:
        feature = dataset.features.get(column)
        if isinstance(feature, Value):
            if feature.dtype.startswith(("int", "uint", "float")):
                dataset = dataset.cast_column(column, Value("string"))
        elif feature is not None and any(_is_number(v) for v in dataset[column]):  # mixed JSON values
            rest = [v for v in dataset[column] if not _is_number(v)]
            if any(v is not None and not isinstance(v, str) for v in rest):
                continue  # lists, dicts, booleans: not text, check_rows says which row
            features = dataset.features.copy()
            features[column] = Value("string")

            def text(row, column=column):
                return {column: str(row[column]) if _is_number(row[column]) else row[column]}

            dataset = dataset.map(text, features=features, desc=f"numbers in {column} as text")
    return dataset


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _conversational_prompt_completion(row: dict) -> dict:
    prompt, completion = row["prompt"], row["completion"]
    if not isinstance(prompt, list) or not isinstance(completion, list):
        raise DataError("conversational prompt/completion: both prompt and completion must be lists of messages")
    return {"messages": prompt + completion, "learn_from": len(prompt)}


def _alpaca(row: dict) -> dict:
    instruction, extra = row.get("instruction"), row.get("input") or ""
    template = ALPACA_PROMPT if isinstance(extra, str) and extra.strip() else ALPACA_PROMPT_NO_INPUT
    prompt = template.format(instruction=instruction, input=extra) if isinstance(instruction, str) else instruction
    return {"prompt": prompt, "completion": row.get("output")}


def _sharegpt(row: dict) -> dict:
    messages = []
    for turn in row["conversations"] or []:
        speaker = (turn or {}).get("from")
        if speaker not in SHAREGPT_ROLES:
            raise DataError(f"sharegpt: speaker {speaker!r}; use one of {sorted(SHAREGPT_ROLES)}")
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn.get("value")})
    return {"messages": messages, "learn_from": 0}


def apply_templates(
    dataset, prompt_template: str | None, completion_template: str | None, spec: str, where: RowNames = INDEXED
):
    """prompt/completion columns built from each row with str.format; ClassLabel columns add `<col>_text`."""
    from datasets import ClassLabel

    if prompt_template is None or completion_template is None:
        raise DataError(f"dataset {spec}: set both prompt_template and completion_template (one was given)")
    names = {col: feat.names for col, feat in dataset.features.items() if isinstance(feat, ClassLabel)}
    columns = list(dataset.column_names)

    def fields(row: dict) -> dict:
        out = dict(row)
        for col, labels in names.items():
            value = row[col]
            out[f"{col}_text"] = labels[value].replace("_", " ") if 0 <= value < len(labels) else str(value)
        return out

    if len(dataset):
        sample = fields(dataset[0])
        for label, template in (("prompt_template", prompt_template), ("completion_template", completion_template)):
            try:
                template.format(**sample)
            except (KeyError, IndexError) as err:
                raise DataError(
                    f"dataset {spec}: {label} uses field {err} that rows do not have; available: {sorted(sample)}"
                ) from None
            except (ValueError, TypeError):
                pass  # a format spec the value does not take: render() names the row

    def render(row, index):
        values = fields(row)
        try:
            return {"prompt": prompt_template.format(**values), "completion": completion_template.format(**values)}
        except (ValueError, TypeError) as err:  # e.g. {score:.1f} on a CSV cell, which is text
            raise DataError(
                f"dataset {spec}: {where.name(index)}: the templates cannot format this row ({first_line(err)}); "
                "a format spec needs a value of its type (CSV cells are text: {score}, not {score:.1f})"
            ) from None

    return dataset.map(render, with_indices=True, remove_columns=columns, desc="format")


def row_kind(dataset) -> str:
    """'completion', 'chat' or 'text': which canonical kind the rows are."""
    for kind, columns in CANONICAL.items():
        if set(columns) <= set(dataset.column_names):
            return kind
    raise DataError(f"dataset: columns {sorted(dataset.column_names)} are not canonical rows; use load_rows")


def check_rows(dataset, spec: str, names: RowNames = INDEXED) -> str:
    """Every row has the right types; the first bad one is reported with its column and where the file has it."""
    kind = row_kind(dataset)
    for index, row in enumerate(dataset):
        problem = _row_problem(kind, row, names.missing)
        if problem:
            raise DataError(f"dataset {spec}: {names.name(index)}: {problem}")
    return kind


def _row_problem(kind: str, row: dict, missing: str = "null") -> str | None:
    if kind == "completion":
        for column in ("prompt", "completion"):
            if row[column] is None:
                return f"column '{column}' is {missing}, not a string"
            if not isinstance(row[column], str):
                return f"column '{column}' is {_shown(row[column])}, not a string"
        if not row["completion"]:
            return "column 'completion' is empty: nothing to learn"
        return None
    if kind == "text":
        if isinstance(row["text"], str) and row["text"]:
            return None
        return f"column 'text' is {missing if row['text'] is None else _shown(row['text'])}"
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        return f"column 'messages' is {_shown(messages)}, not a list of messages"
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"messages[{turn}] is {_shown(message)}, not a {{'role', 'content'}} message"
        if not isinstance(message.get("content"), str):
            return f"messages[{turn}].content is {_shown(message.get('content'))}, not a string"
    if not any(m["role"] == "assistant" for m in messages[row["learn_from"] :]):
        return "the conversation has no assistant turn to learn from"
    return None


def _shown(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"
