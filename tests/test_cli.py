"""The CLI contract: user errors are one line (exit 1), Ctrl-C exits 130, bugs keep their traceback, --traceback
shows every traceback, and the documented recipe-key table is the one the code generates."""

import re
import sys
import types
from pathlib import Path

import pytest

from bdlora_train import cli

ROOT = Path(__file__).resolve().parents[1]


def _run_with(monkeypatch, capsys, exc, argv=("budget",)):
    """Run `bdlora budget` with the command replaced by one that raises `exc`."""

    def boom(argv):
        raise exc

    monkeypatch.setitem(sys.modules, "fake_command", types.SimpleNamespace(main=boom))
    monkeypatch.setitem(cli.COMMANDS, "budget", ("fake_command:main", "test"))
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


def test_user_errors_are_one_line_exit_1(monkeypatch, capsys):
    from bdlora_train.core.errors import RecipeError

    code, err = _run_with(monkeypatch, capsys, RecipeError("budget: lora_r=0 must be >= 1"))
    assert code == 1
    assert err == "bdlora budget: error: lora_r=0 must be >= 1\n"  # no doubled "budget:" prefix


def test_empty_message_and_foreign_user_errors(monkeypatch, capsys):
    from safetensors import SafetensorError

    code, err = _run_with(monkeypatch, capsys, OSError(28, "No space left on device", "/full/disk/x"))
    assert code == 1 and err.count("\n") == 1 and "No space left on device" in err and "/full/disk/x" in err
    code, err = _run_with(monkeypatch, capsys, SafetensorError("Error while deserializing header"))
    assert code == 1 and "deserializing header" in err
    from bdlora_train.core.errors import BdloraError

    code, err = _run_with(monkeypatch, capsys, BdloraError(""))  # an empty message must not crash the handler
    assert code == 1 and err == "bdlora budget: error: BdloraError\n"


def test_ctrl_c_exits_130_with_a_resume_hint(monkeypatch, capsys):
    code, err = _run_with(monkeypatch, capsys, KeyboardInterrupt())
    assert code == 130 and "interrupted; re-run the same command to resume" in err


def test_bugs_keep_their_traceback_and_traceback_flag_shows_user_errors(monkeypatch, capsys):
    with pytest.raises(ZeroDivisionError):
        _run_with(monkeypatch, capsys, ZeroDivisionError("a bug"))
    from bdlora_train.core.errors import RecipeError

    with pytest.raises(RecipeError):
        _run_with(monkeypatch, capsys, RecipeError("x"), argv=("budget", "--traceback"))


def test_version_and_unknown_command(capsys):
    assert cli.main(["--version"]) == 0
    assert re.match(r"bdlora \S+", capsys.readouterr().out)
    assert cli.main(["bugdet"]) == 2
    assert "did you mean 'budget'" in capsys.readouterr().err


def test_corrupt_adapter_file_is_one_line(tmp_path, capsys):
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    assert cli.main(["inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unreadable safetensors" in err and "adapter_model.safetensors" in err
    (tmp_path / "adapter_config.json").write_text("{not json")
    assert cli.main(["inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "adapter_config.json: not valid JSON" in err


def test_recipe_key_table_in_docs_is_generated_from_the_code():
    from tools.recipe_keys import doc_table, keys_markdown

    assert doc_table() == keys_markdown(), "docs/training.md's key table is stale; run `python -m tools.recipe_keys`"


def test_docs_cite_nothing_outside_the_repository_and_links_resolve():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for path in files:
        text = path.read_text()
        assert "NOTES" not in text and "../shared" not in text, f"{path} cites a file outside the repository"
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to missing {target}"
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
