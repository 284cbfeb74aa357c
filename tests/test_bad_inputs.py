"""Every bad input and fault a new user runs into, in one place, through the real CLI.

Each case asserts the exit code, that stderr is ONE line naming the file / key / row and the fix, and that nothing
was written or lost (no adapter or checkpoint appears; an existing run directory keeps every file byte for byte).
"""

import fcntl
import json
import shutil
from pathlib import Path

import pytest

from bdlora_train import cli

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "tiny" / "bdlora.yaml")
FAST = ["max_steps=4", "save_steps=2", "logging_steps=2"]

pytestmark = pytest.mark.usefixtures("one_thread")


def one_line_error(capsys, argv, code=1) -> str:
    """The error line of a failed command: one line, no traceback (progress bars before it are not errors)."""
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    prefix = f"bdlora {argv[0]}: error: "
    assert err.count(prefix) == 1, err
    return prefix + err.split(prefix, 1)[1].split("\n", 1)[0]


def snapshot(root: Path) -> dict:
    """Every file under root with its bytes (the lock file's pid aside)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".bdlora-lock"
    }


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished tiny run: adapter/, checkpoints, metrics.json, recipe.yaml."""
    out = tmp_path_factory.mktemp("bad") / "run"
    assert cli.main(["train", TINY, f"output_dir={out}", *FAST]) == 0
    return out


@pytest.fixture
def run_copy(finished_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(finished_run, dst)
    return dst


def _write(path: Path, content: bytes | str) -> str:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


# ------------------------------------------------------------------------------------ recipes: refused up front

RECIPE_CASES = {
    "warmup_ratio=1.0": r"warmup_ratio=1.0 must be in \[0, 1\)",
    "lora_alpha_ratio=null lora_alpha=0": r"lora_alpha=0.0 must be > 0",
    "lora_alpha=8": r"lora_alpha=8 and lora_alpha_ratio=2 are both set; with lora_alpha_ratio alpha is ratio x r = 16",
    "match_budget_of_lora_rank=4 lora_r=8": r"lora_r=8 and match_budget_of_lora_rank=4 are both set",
    "eval_steps=5": r"eval_steps=5 without eval_strategy does nothing .*add eval_strategy=steps",
    "learning_rate=0": r"learning_rate=0.0 must be > 0",
    "lora_dropout=1": r"lora_dropout=1.0 must be in \[0, 1\)",
    "max_dropped_fraction=2": r"max_dropped_fraction=2.0 must be in \[0, 1\]",
    "lora_r=8 nblocks=3": r"lora_r=8 is not a multiple of nblocks=3; use lora_r=6 or lora_r=9",
    "max_steps=5 max_steps=6": r"override 'max_steps' is given twice",
    "eval_strategy=steps": r"eval_strategy=steps needs evaluation data",
    "lora_rank=8": r"unknown key 'lora_rank'; did you mean 'lora_r'",
    "eval_stratgy=steps": r"unknown key 'eval_stratgy'; did you mean 'eval_strategy'",
    "remove_unused_columns=true": r"remove_unused_columns is set by bdlora-train",
    "hub_token=hf_x": r"hub_token is set by bdlora-train",
    # the recipe key, not a `--model` flag `train` does not have
    "model=./no/such/dir": r"error: recipe: model=./no/such/dir: no such file or directory",
    "model=tiny:nosuch": r"recipe: model=tiny:nosuch: unknown model type 'nosuch'; no model type is close \(tested",
    "model=tiny:lama": r"unknown model type 'lama'; did you mean tiny:llama",
    "eval_strategy=sometimes eval_fraction=0.1": r"transformers refused the training arguments",
}


@pytest.mark.parametrize("overrides, message", RECIPE_CASES.items(), ids=list(RECIPE_CASES))
def test_recipe_errors_are_one_line_and_write_nothing(tmp_path, capsys, overrides, message):
    import re

    out = tmp_path / "run"
    line = one_line_error(capsys, ["train", TINY, f"output_dir={out}", *overrides.split(" ")])
    assert re.search(message, line), line
    assert len(line) < 500 and "--model" not in line and "[]" not in line
    assert not out.exists()  # a refused run leaves no directory behind (not even one holding only .bdlora-lock)


def test_duplicated_yaml_key_and_missing_logger_package(tmp_path, capsys):
    import importlib.util

    recipe = _write(tmp_path / "r.yaml", Path(TINY).read_text() + "max_steps: 7\n")
    line = one_line_error(capsys, ["train", recipe, f"output_dir={tmp_path / 'o'}"])
    assert "key 'max_steps' appears twice (lines" in line and "r.yaml" in line
    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        pytest.skip("tensorboard is installed here, so report_to=tensorboard is valid")
    line = one_line_error(capsys, ["train", TINY, f"output_dir={tmp_path / 'o'}", "report_to=tensorboard"])
    assert "tensorboard is not installed; pip install tensorboard, or report_to=none" in line


# ------------------------------------------------------------------------------------ data: named by line / row

DATA_CASES = {
    "empty.jsonl": (b"", r"is empty \(0 rows\)"),
    "badline.jsonl": (b'{"prompt": "a", "completion": "b"}\n{"prompt": \n', r"line 2 is not valid JSON"),
    "latin1.jsonl": (b'{"prompt": "caf\xe9", "completion": "b"}\n', r"line 1 is not UTF-8"),
    "null.jsonl": (
        b'{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": null}\n',
        r"line 2: column 'completion' is null",
    ),
    "list.jsonl": (
        b'{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": ["b"]}\n',
        r"line 2: column 'completion' is a JSON array \[\"b\"\], not a string",
    ),
    "quoted.csv": (b'prompt,completion\n"1+1=",2\n"2+2=","4,\n', r"line 3 is not valid CSV \(unexpected end of data\)"),
    "hole.csv": (b'prompt,completion\n"1+1=",2\n"2+2=",4\n"3+3=",\n', r"data row 3: column 'completion' is an empty"),
    "columns.jsonl": (b'{"question": "a", "answer": "b"}\n', r"match no known format"),
}


@pytest.mark.parametrize("name", DATA_CASES)
def test_data_errors_name_the_line_or_row_before_the_model_loads(tmp_path, capsys, monkeypatch, name):
    import bdlora_train.models as models

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(models, "load_model", no_model)
    content, message = DATA_CASES[name]
    data = _write(tmp_path / name, content)
    line = one_line_error(capsys, ["train", TINY, f"output_dir={tmp_path / 'o'}", f"dataset={data}"])
    assert data in line
    assert __import__("re").search(message, line), line


def test_too_many_rows_dropped_by_truncation_fails(tmp_path, capsys):
    rows = [{"prompt": "x" * 80, "completion": "1"}] * 3 + [{"prompt": "1+1=", "completion": "2"}] * 7
    data = _write(tmp_path / "long.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    line = one_line_error(capsys, ["train", TINY, f"output_dir={tmp_path / 'o'}", f"dataset={data}"])
    assert "3 of 10 rows have no completion token left within max_seq_length=64" in line


def test_corrupt_tokenizer_json_is_named(tmp_path, capsys):
    from bdlora_train.models import build_tiny_model

    model_dir = tmp_path / "model"
    build_tiny_model("llama").save_pretrained(model_dir)
    _write(model_dir / "tokenizer.json", "{ this is not json")
    _write(model_dir / "tokenizer_config.json", json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    line = one_line_error(capsys, ["train", TINY, f"output_dir={tmp_path / 'o'}", f"model={model_dir}"])
    assert "tokenizer" in line and str(model_dir) in line and "gave no tokenizer" not in line


# ------------------------------------------------------------------------------------ the run directory: nothing lost


def test_second_run_on_a_locked_output_dir_fails_at_once_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".bdlora-lock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.write("4242")
        holder.flush()
        line = one_line_error(capsys, ["train", TINY, f"output_dir={out}", *FAST])
    assert "in use by another run (pid 4242)" in line
    assert not (out / "adapter").exists()


def test_rerunning_a_finished_run_changes_nothing(run_copy, capsys):
    before = snapshot(run_copy)
    assert cli.main(["train", TINY, f"output_dir={run_copy}", *FAST]) == 0
    assert "nothing to do" in capsys.readouterr().err
    assert snapshot(run_copy) == before


def test_failed_resume_keeps_recipe_and_adapter(run_copy, capsys):
    before = snapshot(run_copy)
    line = one_line_error(
        capsys, ["train", TINY, f"output_dir={run_copy}", "max_steps=6", "save_steps=2", "logging_steps=2", "lora_r=16"]
    )
    assert "checkpoint-4 was trained with r=8, this recipe gives 16" in line and "resume_from_checkpoint=false" in line
    line = one_line_error(
        capsys, ["train", TINY, f"output_dir={run_copy}", "max_steps=6", f"resume_from_checkpoint={run_copy / 'nope'}"]
    )
    assert "is not a complete checkpoint dir" in line
    assert snapshot(run_copy) == before  # recipe.yaml still describes the adapter on disk


def test_startup_removes_only_the_toolkits_own_staging_names(run_copy):
    (run_copy / ".tmp-notes.txt").write_text("mine")
    (run_copy / ".tmp-checkpoint-99").mkdir()
    (run_copy / ".tmp-adapter").mkdir()
    assert cli.main(["train", TINY, f"output_dir={run_copy}", "max_steps=6", "save_steps=2", "logging_steps=2"]) == 0
    assert (run_copy / ".tmp-notes.txt").read_text() == "mine"
    assert not (run_copy / ".tmp-checkpoint-99").exists() and not (run_copy / ".tmp-adapter").exists()
    assert json.loads((run_copy / "metrics.json").read_text())["steps"] == 6


def test_full_disk_at_the_final_save_keeps_the_adapter_elsewhere_and_says_where(tmp_path, monkeypatch, capsys):
    import bdlora_train.train.run as run_mod

    real_save = run_mod.save_adapter

    def full_disk(trainer, path):
        if Path(path).name == ".tmp-adapter":
            raise OSError(28, "No space left on device", str(path))
        real_save(trainer, path)

    monkeypatch.setattr(run_mod, "save_adapter", full_disk)
    out = tmp_path / "run"
    line = one_line_error(capsys, ["train", TINY, f"output_dir={out}", *FAST])
    assert "No space left on device" in line and "the trained adapter was saved to" in line
    rescue = Path(line.split("was saved to ")[1].split(" instead")[0])
    assert (rescue / "adapter_model.safetensors").is_file() and (rescue / "adapter_config.json").is_file()
    assert not (out / "recipe.yaml").exists() and not (out / "adapter").exists()
    shutil.rmtree(rescue.parent)


def test_full_disk_during_a_checkpoint_names_it(tmp_path, monkeypatch, capsys):
    from transformers import Trainer

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Trainer, "_save_checkpoint", full_disk)
    out = tmp_path / "run"
    line = one_line_error(capsys, ["train", TINY, f"output_dir={out}", *FAST])
    assert "checkpoint-2: writing to" in line and "No space left on device" in line and "re-run" in line
    assert not list(out.glob(".tmp-checkpoint-*")) and not list(out.glob("checkpoint-*"))


def test_launcher_world_size_mismatch_is_refused(monkeypatch):
    from types import SimpleNamespace

    from bdlora_train.core.errors import RecipeError
    from bdlora_train.train.setup import check_world_size

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        RecipeError, match="WORLD_SIZE=2 processes but the Trainer sees world size 1.*ACCELERATE_USE_CPU"
    ):
        check_world_size(SimpleNamespace(world_size=1))
    check_world_size(SimpleNamespace(world_size=2))


# ------------------------------------------------------------------------------------ adapters and exports


@pytest.mark.parametrize("out", ["parent", "self", "inside", "file"])
def test_export_never_writes_over_or_into_its_source(run_copy, capsys, out):
    adapter = run_copy / "adapter"
    target = {
        "parent": run_copy,
        "self": adapter,
        "inside": adapter / "sub",
        "file": adapter / "adapter_model.safetensors",
    }[out]
    before = snapshot(run_copy)
    line = one_line_error(capsys, ["export", str(adapter), "--to", "dense-lora", "--out", str(target), "--force"])
    assert "the source" in line and "write to a directory outside it" in line
    assert snapshot(run_copy) == before


@pytest.mark.parametrize("command", ["inspect", "export", "check-serving", "push", "tp-check"])
@pytest.mark.parametrize("damage", ["zero-bytes", "garbage", "bad-json"])
def test_damaged_adapter_files_are_one_line_everywhere(run_copy, capsys, tmp_path, command, damage):
    adapter = run_copy / "adapter"
    if damage == "bad-json":
        _write(adapter / "adapter_config.json", '{"peft_type": "LORA", ')
        expected = "adapter_config.json: not valid JSON"
    else:
        _write(adapter / "adapter_model.safetensors", b"" if damage == "zero-bytes" else b"\x00" * 64)
        expected = "unreadable safetensors"
    extra = {
        "export": ["--to", "dense-lora", "--out", str(tmp_path / "x")],
        "check-serving": ["--tp", "2"],
        "push": ["--repo-id", "me/x"],
        "tp-check": ["--tp", "2"],
    }.get(command, [])
    line = one_line_error(capsys, [command, str(adapter), *extra])
    assert expected in line
    assert not (tmp_path / "x").exists()


def test_edited_nblocks_is_caught_against_the_base(tmp_path, capsys):
    from bdlora_train import BlockDiagLoraConfig, build_tiny_model, get_peft_model

    model = get_peft_model(build_tiny_model("llama"), BlockDiagLoraConfig(r=4, nblocks=2, target_modules=["o_proj"]))
    model.peft_config["default"].base_model_name_or_path = "tiny:llama"
    model.save_pretrained(str(tmp_path / "a"))
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    config["use_bdlora"]["nblocks"] = 4  # a BD-A-only adapter: the file alone still looks consistent
    _write(tmp_path / "a" / "adapter_config.json", json.dumps(config))
    for argv in (
        ["inspect", str(tmp_path / "a")],
        ["export", str(tmp_path / "a"), "--to", "dense-lora", "--out", str(tmp_path / "d")],
    ):
        line = one_line_error(capsys, argv)
        assert "o_proj (bd_a, nblocks=4) factors give 128 -> 64, the base Linear is 64 -> 64" in line
    assert not (tmp_path / "d").exists()


def test_check_serving_with_another_base_is_not_ready(finished_run, capsys):
    assert cli.main(["check-serving", str(finished_run / "adapter"), "--tp", "2", "--model", "tiny:qwen2"]) == 1
    assert "not the base the adapter was trained on (tiny:llama)" in capsys.readouterr().out


def test_tp_check_against_a_base_of_other_shapes_is_one_line(finished_run, capsys):
    line = one_line_error(
        capsys, ["tp-check", str(finished_run / "adapter"), "--tp", "2", "--model", "meta-llama/Llama-3.1-8B"]
    )
    assert "does not exist in the base model" in line or "factors give" in line


def test_budget_with_rank_zero_is_one_line(capsys):
    line = one_line_error(capsys, ["budget", "--model", "tiny:llama", "--lora-ranks", "0"])
    assert "--lora-ranks [0]" in line and "must be >= 1" in line
