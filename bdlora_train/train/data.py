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
learn_from are learned); {text}. Values are read as the file writes them: a local .jsonl / .json / .csv file is
parsed here, row by row, and each value is checked and converted with the type it has in its own row (`datasets`
would infer one type per column and cast every row to it: text "true" beside a number became a bool, "[1, 2]" a
list, and the first row was blamed for the odd one). CSV cells are text exactly as written (no type guessing:
"074" stays "074", "NA" stays "NA", an empty cell is missing), and a JSON number in a text column is its text as
written (`"completion": 42` learns "42", `2.50` learns "2.50"), whatever the other rows hold. Parquet, save_to_disk
and Hub data keep the types their features declare. Every malformed row is reported with its column, the type it
holds and where the file has it: the line of a JSON Lines file, the 1-based data row of a CSV (after the header),
the 1-based record of a .json file, the index of any other source (dataset[i]).
"""

from __future__ import annotations

import csv
import io
import json
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bdlora_train.core.errors import DataError, first_line

PACKAGED_DIR = Path(__file__).parent.parent / "packaged_data"  # bdlora_train/packaged_data
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
    """How a source names its rows in messages: `name(i)` for the i-th row read (0-based), what a missing value is
    in it ("null" in JSON, an empty cell in a CSV), and how a value is shown (as the JSON the file writes, for JSON
    files: `a JSON array ["4"]`, `a JSON boolean true`)."""

    name: Callable[[int], str] = lambda i: f"index {i}"
    missing: str = "null"
    shown: Callable[[object], str] = lambda value: _shown(value)


INDEXED = RowNames()


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
    if isinstance(dataset, list):  # a local JSON / JSON Lines / CSV file: its rows as written
        return _written_dataset(dataset, spec, names, prompt_template, completion_template, max_samples, dataset_format)
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


# ------------------------------------------------------------------------------- local text files, as written
#
# Parsed here rather than by `datasets.load_dataset("json" | "csv")`: both infer one Arrow type per column and cast
# every row to it (pandas, behind the CSV loader and the JSON loader's fallback for mixed columns, also reads the
# cells "NA" and "null" as missing), so a check after them sees what the cast made of a row, not what the file
# says. json and csv of the standard library keep every value as written; the checked rows become a Dataset.


class WrittenFloat(float):
    """A JSON number with a fraction or an exponent, which keeps the text the file writes it with: as text
    (`str`, `{x}` in a template) it is that text ("2.50", "1e3"); as a number (`{x:.1f}`, arithmetic) a float."""

    written: str

    def __new__(cls, text: str):
        number = super().__new__(cls, text)
        number.written = text
        return number

    def __str__(self) -> str:
        return self.written

    def __format__(self, spec: str) -> str:
        return self.written if not spec else super().__format__(spec)


def _parse_json(text: str):
    return json.loads(text, parse_float=WrittenFloat)


def read_written(path: Path, spec: str) -> tuple[list[dict], RowNames]:
    """The rows of a local .jsonl / .json / .csv file as the file writes them, and how messages name them."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise DataError(f"dataset {spec}: line {line} is not UTF-8 text (byte {err.start}); re-save the file as UTF-8")
    text = text.removeprefix("\ufeff")  # a byte-order mark, as spreadsheet programs write it
    if not text.strip():
        raise DataError(f"dataset {spec}: is empty (0 rows); point `dataset` at data with at least one row")
    if path.suffix == ".csv":
        return _csv_rows(text, spec), RowNames(lambda i: f"data row {i + 1}", missing="an empty cell")
    if path.suffix == ".json":
        try:
            records = _parse_json(text)
        except json.JSONDecodeError as err:
            if err.msg != "Extra data":  # "Extra data": one object per line, JSON Lines in a .json file
                raise DataError(
                    f"dataset {spec}: line {err.lineno} is not valid JSON ({err.msg}, column {err.colno})"
                ) from None
        else:
            records = records if isinstance(records, list) else [records]
            rows = []
            for number, record in enumerate(records, 1):
                if isinstance(record, str):  # a list of strings: a text column, as `datasets` reads it
                    record = {"text": record}
                if not isinstance(record, dict):
                    raise DataError(
                        f"dataset {spec}: record {number} is a JSON {_json_type(record)}, not an object of columns"
                    )
                rows.append(record)
            return rows, RowNames(lambda i: f"record {i + 1}", shown=_json_shown)
    rows, lines = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = _parse_json(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"dataset {spec}: line {number} is not valid JSON ({err.msg}, column {err.colno})"
            ) from None
        if not isinstance(row, dict):
            raise DataError(f"dataset {spec}: line {number} is a JSON {_json_type(row)}, not an object of columns")
        rows.append(row)
        lines.append(number)
    return rows, RowNames(lambda i: f"line {lines[i]}", shown=_json_shown)


def _csv_rows(text: str, spec: str) -> list[dict]:
    """Every cell the text it holds; an empty cell None (missing). Blank lines hold no row, as pandas reads them."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    rows = []
    try:
        header = next(reader, [])
        duplicated = sorted({name for name in header if header.count(name) > 1})
        if duplicated:
            raise DataError(f"dataset {spec}: the header names column {duplicated[0]!r} twice; rename one")
        for cells in reader:
            if not cells or cells == [""]:
                continue
            if len(cells) != len(header):
                raise DataError(
                    f"dataset {spec}: data row {len(rows) + 1} has {len(cells)} cells, the header names "
                    f"{len(header)} columns; quote cells that hold a comma"
                )
            rows.append({name: cell if cell != "" else None for name, cell in zip(header, cells)})
    except csv.Error as err:  # e.g. a quote never closed
        raise DataError(f"dataset {spec}: line {reader.line_num} is not valid CSV ({err})") from None
    return rows


def _written_dataset(
    rows: list[dict],
    spec: str,
    names: RowNames,
    prompt_template: str | None,
    completion_template: str | None,
    max_samples: int | None,
    dataset_format: str,
):
    """load_rows for rows as written: each row converted to a canonical row and checked with the types it holds, the
    first bad one named; only then the rows become a `datasets.Dataset` (canonical rows have one type per column)."""
    import datasets

    if prompt_template is not None or completion_template is not None:
        render = _renderer(prompt_template, completion_template, spec, names, rows[0] if rows else {})
        rows = [render(row, index) for index, row in enumerate(rows)]
        dataset_format = "prompt-completion"
    if max_samples is not None:
        rows = rows[:max_samples]
    if not rows:
        raise DataError(f"dataset {spec}: is empty (0 rows); point `dataset` at data with at least one row")
    fmt = _format_of(list(dict.fromkeys(name for row in rows for name in row)), dataset_format, spec)
    convert, kind = _written_converter(fmt, rows, names)
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


def _as_text(value):
    """A JSON number in a text column is its text as written; anything else is left for the check to name."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


def _written_converter(fmt: str, rows: list[dict], names: RowNames):
    """(row -> canonical row, canonical kind) for rows as written."""
    if fmt == "prompt-completion":
        # TRL's conversational form when most rows hold lists of messages in both columns: the odd row is named
        # whichever line it is on (the first row alone would blame every other row when the odd one comes first)
        lists = sum(isinstance(r.get("prompt"), list) and isinstance(r.get("completion"), list) for r in rows)
        if 2 * lists > len(rows):
            return (lambda row: _conversational_prompt_completion(row, names.shown)), "chat"
        return (
            lambda row: {"prompt": _as_text(row["prompt"]), "completion": _as_text(row["completion"])}
        ), "completion"
    if fmt == "messages":
        return (lambda row: {"messages": row["messages"], "learn_from": 0}), "chat"
    if fmt == "text":
        return (lambda row: {"text": _as_text(row["text"])}), "text"
    if fmt == "alpaca":
        return (lambda row: _alpaca({name: _as_text(row.get(name)) for name in ALPACA_COLUMNS})), "completion"
    return _sharegpt, "chat"


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


NEEDED = {
    "prompt-completion": ("prompt", "completion"),
    "messages": ("messages",),
    "text": ("text",),
    "alpaca": ("instruction", "output"),
    "sharegpt": ("conversations",),
}
ALPACA_COLUMNS = ("instruction", "input", "output")


def detect_format(dataset, requested: str, spec: str) -> str:
    """The dataset's format: `requested`, or for "auto" the one its columns identify."""
    return _format_of(list(dataset.column_names), requested, spec)


def _format_of(column_names: list[str], requested: str, spec: str) -> str:
    columns = set(column_names)
    if requested != "auto":
        if requested not in NEEDED:
            raise DataError(f"dataset {spec}: dataset_format={requested!r}; use one of {list(FORMATS)}")
        missing = set(NEEDED[requested]) - columns
        if missing:
            raise DataError(
                f"dataset {spec}: dataset_format={requested} needs columns {sorted(missing)}; "
                f"the data has {sorted(columns)}"
            )
        return requested
    for name, cols in NEEDED.items():
        if set(cols) <= columns:
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
        dataset = numbers_as_text(dataset, ALPACA_COLUMNS)
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


def _conversational_prompt_completion(row: dict, shown: Callable[[object], str] | None = None) -> dict:
    shown = shown or _shown
    for column in ("prompt", "completion"):
        if not isinstance(row[column], list):
            raise DataError(
                f"column '{column}' is {shown(row[column])} where TRL's conversational form has a list of messages"
            )
    return {"messages": row["prompt"] + row["completion"], "learn_from": len(row["prompt"])}


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

    names = {col: feat.names for col, feat in dataset.features.items() if isinstance(feat, ClassLabel)}
    columns = list(dataset.column_names)

    def fields(row: dict) -> dict:
        out = dict(row)
        for col, labels in names.items():
            value = row[col]
            out[f"{col}_text"] = labels[value].replace("_", " ") if 0 <= value < len(labels) else str(value)
        return out

    sample = fields(dataset[0]) if len(dataset) else {}
    render = _renderer(prompt_template, completion_template, spec, where, sample, fields)
    return dataset.map(render, with_indices=True, remove_columns=columns, desc="format")


def _renderer(
    prompt_template: str | None,
    completion_template: str | None,
    spec: str,
    where: RowNames,
    sample: dict,
    fields: Callable[[dict], dict] = dict,
):
    """`render(row, index)` -> {prompt, completion}, once both templates are known to name fields of `sample`."""
    if prompt_template is None or completion_template is None:
        raise DataError(f"dataset {spec}: set both prompt_template and completion_template (one was given)")
    if sample:
        for label, template in (("prompt_template", prompt_template), ("completion_template", completion_template)):
            try:
                template.format(**sample)
            except (KeyError, IndexError) as err:
                raise DataError(
                    f"dataset {spec}: {label} uses field {err} that rows do not have; available: {sorted(sample)}"
                ) from None
            except (ValueError, TypeError):
                pass  # a format spec the value does not take: render() names the row
    try:
        used = {
            name.split(".")[0].split("[")[0]
            for template in (prompt_template, completion_template)
            for _, name, _, _ in string.Formatter().parse(template)
            if name
        }
    except ValueError:  # not a str.format template ("{x"): render() names the first row it cannot format
        used = set()

    def render(row, index):
        values = fields(row)
        absent = sorted(used - set(values))
        if absent:  # only rows read as written can lack a column the first row has
            raise DataError(f"dataset {spec}: {where.name(index)}: has no column '{absent[0]}' the templates use")
        try:
            return {"prompt": prompt_template.format(**values), "completion": completion_template.format(**values)}
        except (ValueError, TypeError) as err:  # e.g. {score:.1f} on a CSV cell, which is text
            raise DataError(
                f"dataset {spec}: {where.name(index)}: the templates cannot format this row ({first_line(err)}); "
                "a format spec needs a value of its type (CSV cells are text: {score}, not {score:.1f})"
            ) from None

    return render


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


def _shown(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"


JSON_TYPES = ((bool, "boolean"), (str, "string"), ((int, float), "number"), (list, "array"), (dict, "object"))


def _json_shown(value) -> str:
    """A value of a JSON file as the file writes it: `a JSON array ["4"]`, `a JSON boolean true`."""
    if value is None:
        return "null"
    text = json.dumps(value, ensure_ascii=False, default=str)
    return f"a JSON {_json_type(value)} {text if len(text) <= 40 else text[:37] + '...'}"


def _json_type(value) -> str:
    return next((name for types, name in JSON_TYPES if isinstance(value, types)), type(value).__name__)
