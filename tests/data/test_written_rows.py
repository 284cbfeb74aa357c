"""data/written_rows.py: local files read as they are written, and the names messages give their rows."""

import pytest

from bdlora_train.core.errors import DataError
from bdlora_train.data import written_rows as W


def _read(path, text: str):
    path.write_text(text)
    return W.read_written(path, path.name)


def test_a_json_number_keeps_its_written_text_and_is_still_a_number(tmp_path):
    (row,), _ = _read(tmp_path / "a.jsonl", '{"x": 2.50, "y": 1e3}\n')
    assert isinstance(row["x"], W.WrittenFloat) and str(row["x"]) == "2.50" and f"{row['x']}" == "2.50"
    assert f"{row['x']:.1f}" == "2.5" and row["x"] + 1 == 3.5 and str(row["y"]) == "1e3"


def test_rows_are_named_where_the_file_has_them(tmp_path):
    _, names = _read(tmp_path / "b.jsonl", '{"a": 1}\n\n{"a": 2}\n')
    assert names.name(1) == "line 3" and names.shown([1]) == "a JSON array [1]"
    rows, names = _read(tmp_path / "c.csv", "a,b\n1,\n")
    assert rows == [{"a": "1", "b": None}] and names.name(0) == "data row 1" and names.missing == "an empty cell"
    assert W.INDEXED.name(4) == "index 4" and W.shown_value(None) == "null"


def test_a_csv_header_naming_a_column_twice_is_refused(tmp_path):
    with pytest.raises(DataError, match="names column 'a' twice"):
        _read(tmp_path / "d.csv", "a,a\n1,2\n")
