"""Training data: any source, in any of the formats practitioners bring, as canonical rows, checked row by row.

Sources (the recipe's `dataset` / `eval_dataset` key):
  task:<name>          a built-in task (bdlora_train/tasks: analogies, news-ppl, arithmetic, ...)
  glue:<task>          a GLUE task from the Hub (nyu-mll/glue), verbalized as prompt -> label word
  packaged:<file>      a file shipped in bdlora_train/packaged_data/ (the tiny recipe's data)
  a local .jsonl/.json/.csv/.parquet file, a directory written by `datasets`' save_to_disk, or a Hub dataset
Formats (`dataset_format`, "auto" detects them from the columns), the ones TRL and axolotl users bring:
  prompt-completion    `prompt` + `completion` strings, or TRL's conversational form: both lists of messages
  messages             `messages`: a conversation ({"role", "content"} dicts); assistant turns are learned
  text                 `text`: plain text, every token learned (language modeling)
  alpaca               `instruction`, `input` (may be empty), `output`, with the Stanford Alpaca prompt
  sharegpt             `conversations`: [{"from": "human" | "gpt" | "system", "value": ...}]
Other column layouts are mapped with `prompt_template` / `completion_template` (str.format over a row).
Canonical rows are one of: {prompt, completion} strings; {messages, learn_from} (assistant turns at index >=
learn_from are learned); {text}. Values are read as the file writes them: a local .jsonl / .json / .csv file is parsed
by data/written_rows.py, row by row, and each value is checked and converted with the type it has in its own row
(`datasets` would infer one type per column and cast every row to it: text "true" beside a number became a bool,
"[1, 2]" a list, and the first row was blamed for the odd one). CSV cells are text exactly as written (no type guessing:
"074" stays "074", "NA" stays "NA", an empty cell is missing), and a JSON number in a text column is its text as
written (`"completion": 42` learns "42", `2.50` learns "2.50"), whatever the other rows hold. Parquet, save_to_disk
and Hub data keep the types their features declare. Every malformed row is reported with its column, the type it holds
and where the file has it: the line of a JSON Lines file, the 1-based data row of a CSV (after the header),
the 1-based record of a .json file, the index of any other source (dataset[i]).

Here: `load_rows` (a `DataSpec` -> checked canonical rows) and the row check; the sources are read in
data/sources.py, the formats converted in data/formats.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bdlora_train.core.errors import DataError, first_line
from bdlora_train.data.formats import (
    NEEDED,
    apply_templates,
    detect_format,
    format_of,
    renderer,
    to_canonical,
    written_converter,
)
from bdlora_train.data.sources import GLUE_TASKS, read_source
from bdlora_train.data.written_rows import INDEXED, RowNames

CANONICAL = {"completion": ("prompt", "completion"), "chat": ("messages", "learn_from"), "text": ("text",)}


@dataclass(frozen=True)
class DataSpec:
    """Which rows to load: `source` a `dataset` spec (see the module docstring), the run's `seed` (a built-in task
    draws its rows with it), the Hub `config` and `split`, the templates that map other column layouts, a row cap and
    the format ("auto": detected from the columns)."""

    source: str
    seed: int = 0
    config: str | None = None
    split: str = "train"
    prompt_template: str | None = None
    completion_template: str | None = None
    max_samples: int | None = None
    dataset_format: str = "auto"

    @classmethod
    def train_of(cls, recipe) -> DataSpec:
        """A recipe's training data: its `dataset`, split `dataset_split`, capped at `max_train_samples`."""
        return cls(
            recipe.dataset,
            seed=recipe.seed,
            config=recipe.dataset_config,
            split=recipe.dataset_split,
            prompt_template=recipe.prompt_template,
            completion_template=recipe.completion_template,
            max_samples=recipe.max_train_samples,
            dataset_format=recipe.dataset_format,
        )

    @classmethod
    def eval_of(cls, recipe) -> DataSpec:
        """A recipe's `eval_dataset`: its "validation" split, read with the training data's config and templates."""
        return replace(cls.train_of(recipe), source=recipe.eval_dataset, split="validation", max_samples=None)


def load_rows(data: DataSpec):
    """A `datasets.Dataset` of canonical rows (see the module docstring), every row checked, non-empty."""
    spec, prompt_template, completion_template = data.source, data.prompt_template, data.completion_template
    max_samples, dataset_format = data.max_samples, data.dataset_format
    dataset, names = read_source(spec, data.seed, data.config, data.split)
    if isinstance(dataset, list):  # a local JSON / JSON Lines / CSV file: its rows as written
        return _written_dataset(dataset, data, names)
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


def _written_dataset(rows: list[dict], data: DataSpec, names: RowNames):
    """load_rows for rows as written: each row converted to a canonical row and checked with the types it holds, the
    first bad one named; only then the rows become a `datasets.Dataset` (canonical rows have one type per column)."""
    import datasets

    spec, prompt_template, completion_template = data.source, data.prompt_template, data.completion_template
    max_samples, dataset_format = data.max_samples, data.dataset_format
    if prompt_template is not None or completion_template is not None:
        render = renderer(prompt_template, completion_template, spec, names, rows[0] if rows else {})
        rows = [render(row, index) for index, row in enumerate(rows)]
        dataset_format = "prompt-completion"
    if max_samples is not None:
        rows = rows[:max_samples]
    if not rows:
        raise DataError(f"dataset {spec}: is empty (0 rows); point `dataset` at data with at least one row")
    fmt = format_of(list(dict.fromkeys(name for row in rows for name in row)), dataset_format, spec)
    convert, kind = written_converter(fmt, rows, names)
    canonical = []
    for index, row in enumerate(rows):
        absent = [name for name in NEEDED[fmt] if name not in row]
        if absent:
            raise DataError(f"dataset {spec}: {names.name(index)}: has no column '{absent[0]}'")
        try:
            out = convert(row)
        except (DataError, AttributeError, KeyError, TypeError) as err:  # a row the converter cannot read
            raise DataError(f"dataset {spec}: {names.name(index)}: not {fmt} shaped ({first_line(err)})") from None
        problem = _row_problem(kind, out, names)
        if problem:
            raise DataError(f"dataset {spec}: {names.name(index)}: {problem}")
        canonical.append(out)
    try:
        return datasets.Dataset.from_list(canonical)
    except Exception as err:  # pyarrow: other keys of the messages whose types differ between rows
        raise DataError(f"dataset {spec}: cannot be read as one table ({first_line(err)})") from None


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
        problem = _row_problem(kind, row, names)
        if problem:
            raise DataError(f"dataset {spec}: {names.name(index)}: {problem}")
    return kind


def _row_problem(kind: str, row: dict, names: RowNames = INDEXED) -> str | None:
    missing, _shown = names.missing, names.shown
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
