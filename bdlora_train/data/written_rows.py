"""Rows of local text files as the file writes them (.jsonl, .json, .csv), and how messages name a source's rows.

Parsed here rather than by `datasets.load_dataset("json" | "csv")`: both infer one Arrow type per column and cast
every row to it (pandas, behind the CSV loader and the JSON loader's fallback for mixed columns, also reads the
cells "NA" and "null" as missing), so a check after them sees what the cast made of a row, not what the file
says. json and csv of the standard library keep every value as written; the checked rows become a Dataset
(data/rows.py).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bdlora_train.core.errors import DataError


@dataclass(frozen=True)
class RowNames:
    """How a source names its rows in messages: `name(i)` for the i-th row read (0-based), what a missing value is
    in it ("null" in JSON, an empty cell in a CSV), and how a value is shown (as the JSON the file writes, for JSON
    files: `a JSON array ["4"]`, `a JSON boolean true`)."""

    name: Callable[[int], str] = lambda i: f"index {i}"
    missing: str = "null"
    shown: Callable[[object], str] = lambda value: shown_value(value)


INDEXED = RowNames()


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


def shown_value(value) -> str:
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
