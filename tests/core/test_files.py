"""Atomic writes leave either the old content or the new, never a partial file or a stray temp."""

import pytest

from bdlora_train.core.files import atomic_file, atomic_write_text, replace_dir


def test_failed_write_keeps_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "metrics.json"
    atomic_write_text(target, "old")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]
    atomic_write_text(target, "new")
    assert target.read_text() == "new"


def test_replace_dir_swaps_in_the_new_directory(tmp_path):
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "stale.bin").write_text("x")
    (tmp_path / "staging").mkdir()
    (tmp_path / "staging" / "adapter_config.json").write_text("{}")
    replace_dir(tmp_path / "staging", tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
