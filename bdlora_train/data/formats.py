"""The formats practitioners bring, as canonical rows: detecting a dataset's format from its columns, converting
prompt-completion (TRL's conversational form too), messages, text, alpaca and sharegpt rows, and the
prompt_template / completion_template mapping of any other column layout (data/rows.py describes the rows)."""

from __future__ import annotations

import string
from collections.abc import Callable

from bdlora_train.core.errors import DataError, first_line
from bdlora_train.data.written_rows import INDEXED, RowNames, shown_value

FORMATS = ("auto", "prompt-completion", "messages", "text", "alpaca", "sharegpt")

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
    return format_of(list(dataset.column_names), requested, spec)


def format_of(column_names: list[str], requested: str, spec: str) -> str:
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
    shown = shown or shown_value
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
    render = renderer(prompt_template, completion_template, spec, where, sample, fields)
    return dataset.map(render, with_indices=True, remove_columns=columns, desc="format")


def renderer(
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


def _as_text(value):
    """A JSON number in a text column is its text as written; anything else is left for the check to name."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


def written_converter(fmt: str, rows: list[dict], names: RowNames):
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
