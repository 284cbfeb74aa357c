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
learn_from are learned); {text}. Every malformed row is reported with its row number and column.
"""

from __future__ import annotations

import json
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
    dataset = _load_source(spec, seed, config, split)
    if spec.startswith("glue:") and prompt_template is None and completion_template is None:
        prompt_template, completion_template = GLUE_TASKS[spec.split(":", 1)[1]]
    if prompt_template is not None or completion_template is not None:
        dataset = apply_templates(dataset, prompt_template, completion_template, spec)
        dataset_format = "prompt-completion"
    if max_samples is not None:
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    if len(dataset) == 0:
        raise DataError(f"dataset {spec}: is empty (0 rows); point `dataset` at data with at least one row")
    dataset = to_canonical(dataset, detect_format(dataset, dataset_format, spec), spec)
    check_rows(dataset, spec)
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
    import datasets

    if spec.startswith("task:"):
        from bdlora_train.tasks.registry import get_task  # lazy: tasks import torch and their data on first use

        return get_task(spec.split(":", 1)[1]).train_dataset(seed)
    if spec.startswith("glue:"):
        task = spec.split(":", 1)[1]
        if task not in GLUE_TASKS:
            raise DataError(f"dataset {spec}: unknown GLUE task; use one of {sorted(GLUE_TASKS)}")
        return _load_hub("nyu-mll/glue", task, split, spec)
    if spec.startswith("packaged:"):
        path = PACKAGED_DIR / spec.split(":", 1)[1]
        if not path.is_file():
            known = sorted(p.name for p in PACKAGED_DIR.iterdir() if p.suffix in LOCAL_FORMATS)
            raise DataError(f"dataset {spec}: no such packaged file; packaged files are {known}")
        spec = str(path)
    path = Path(spec)
    if path.is_dir():
        return _load_saved(path, split, spec)
    if path.suffix in LOCAL_FORMATS:
        if not path.is_file():
            raise DataError(f"dataset {spec}: file not found; give an existing .jsonl/.json/.csv/.parquet path")
        _check_text_file(path, spec)
        try:
            return datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
        except Exception as err:  # datasets raises many types for malformed files
            raise DataError(
                f"dataset {spec}: cannot be read as {LOCAL_FORMATS[path.suffix]} ({first_line(err)})"
            ) from None
    if path.exists():
        raise DataError(f"dataset {spec}: unsupported file type; use .jsonl, .json, .csv or .parquet")
    if spec.startswith((".", "/", "~")):
        raise DataError(f"dataset {spec}: no such file or directory")
    return _load_hub(spec, config, split, spec)


def _check_text_file(path: Path, spec: str) -> None:
    """UTF-8 and, for JSON Lines, one JSON object per line: a bad line is reported by number, before `datasets`
    turns it into a parser traceback."""
    if path.suffix == ".parquet":
        return
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise DataError(f"dataset {spec}: line {line} is not UTF-8 text (byte {err.start}); re-save the file as UTF-8")
    if not text.strip():
        raise DataError(f"dataset {spec}: is empty (0 rows); point `dataset` at data with at least one row")
    if path.suffix != ".jsonl":
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"dataset {spec}: line {number} is not valid JSON ({err.msg}, column {err.colno})"
            ) from None
        if not isinstance(row, dict):
            raise DataError(f"dataset {spec}: line {number} is a JSON {type(row).__name__}, not an object of columns")


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


def to_canonical(dataset, fmt: str, spec: str):
    """Rows of one canonical kind (see the module docstring); the source columns are dropped."""
    columns = list(dataset.column_names)
    if fmt == "prompt-completion":
        first = dataset[0]
        if isinstance(first["prompt"], list) or isinstance(first["completion"], list):  # TRL's conversational form
            fn = _conversational_prompt_completion
        else:
            return dataset.select_columns(["prompt", "completion"])
    elif fmt == "messages":
        fn = lambda row: {"messages": row["messages"], "learn_from": 0}  # noqa: E731
    elif fmt == "text":
        return dataset.select_columns(["text"])
    elif fmt == "alpaca":
        fn = _alpaca
    else:
        fn = _sharegpt

    def convert(row: dict, index: int) -> dict:
        try:
            return fn(row)
        except (DataError, AttributeError, KeyError, TypeError) as err:  # a row the converter cannot read
            raise DataError(f"dataset {spec}: row {index}: not {fmt} shaped ({first_line(err)})") from None

    return dataset.map(convert, with_indices=True, remove_columns=columns, desc=f"format {fmt}")


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


def apply_templates(dataset, prompt_template: str | None, completion_template: str | None, spec: str):
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

    def render(row):
        values = fields(row)
        return {"prompt": prompt_template.format(**values), "completion": completion_template.format(**values)}

    return dataset.map(render, remove_columns=columns, desc="format")


def row_kind(dataset) -> str:
    """'completion', 'chat' or 'text': which canonical kind the rows are."""
    for kind, columns in CANONICAL.items():
        if set(columns) <= set(dataset.column_names):
            return kind
    raise DataError(f"dataset: columns {sorted(dataset.column_names)} are not canonical rows; use load_rows")


def check_rows(dataset, spec: str) -> str:
    """Every row has the right types; the first bad one is reported with its row number and column."""
    kind = row_kind(dataset)
    for index, row in enumerate(dataset):
        problem = _row_problem(kind, row)
        if problem:
            raise DataError(f"dataset {spec}: row {index}: {problem}")
    return kind


def _row_problem(kind: str, row: dict) -> str | None:
    if kind == "completion":
        for column in ("prompt", "completion"):
            if not isinstance(row[column], str):
                return f"column '{column}' is {_shown(row[column])}, not a string"
        if not row["completion"]:
            return "column 'completion' is empty: nothing to learn"
        return None
    if kind == "text":
        return None if isinstance(row["text"], str) and row["text"] else f"column 'text' is {_shown(row['text'])}"
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
