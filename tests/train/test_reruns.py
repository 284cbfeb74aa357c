"""Re-running a command into an output_dir that already holds a run (train/rundir.py check_not_behind): a command
whose end is at or before the checkpoint's step, or a different run's finished directory, is refused in one line
before anything is written, for a supervised and a GRPO run; continuing with more steps still works."""

import hashlib
from pathlib import Path

import pytest

from bdlora_train.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "tiny"


def _snapshot(out: Path) -> dict:
    """Every file under out (but the lock) with its content's hash: what a refusal must leave as it found it."""
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".bdlora-lock"}


def _refusal(capsys, argv) -> str:
    assert main(argv) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bdlora train: error:")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("recipe", ["bdlora.yaml", "grpo.yaml"])
def test_a_rerun_never_trains_past_its_end_nor_over_another_finished_run(recipe, tmp_path, capsys):
    out = tmp_path / "run"
    args = [str(RECIPES / recipe), f"output_dir={out}", "save_steps=2", "logging_steps=1"]
    assert main(["train", *args, "max_steps=4"]) == 0
    done = _snapshot(out)
    assert "checkpoint-4/trainer_state.json" in done and "adapter/adapter_model.safetensors" in done
    capsys.readouterr()
    # the same command: the finished run, nothing to do
    assert main(["train", *args, "max_steps=4"]) == 0
    assert "already holds the finished run of this recipe" in capsys.readouterr().err
    # fewer steps, or the same steps with another key: nothing past checkpoint-4 to train
    for extra in (["max_steps=3"], ["max_steps=4", "learning_rate=1e-3"]):
        line = _refusal(capsys, ["train", *args, *extra])
        assert line == (
            f"bdlora train: error: recipe: output_dir={out} holds checkpoint-4 (step 4); "
            f"{extra[0]} would train nothing past it and would overwrite it; use another output_dir, or "
            "max_steps > 4 to continue it"
        )
        assert _snapshot(out) == done
    # more steps continue it, numbered from the checkpoint on
    assert main(["train", *args, "max_steps=6"]) == 0
    assert "resuming from" in capsys.readouterr().err
    assert (out / "checkpoint-6").is_dir()


def test_a_finished_run_without_checkpoints_is_not_trained_over_by_another_recipe(tmp_path, capsys):
    out = tmp_path / "run"
    args = [str(RECIPES / "bdlora.yaml"), f"output_dir={out}", "save_steps=0", "max_steps=3"]
    assert main(["train", *args]) == 0
    done = _snapshot(out)
    capsys.readouterr()
    line = _refusal(capsys, ["train", *args, "learning_rate=1e-3"])
    assert line.startswith(f"bdlora train: error: recipe: output_dir={out} holds the finished run of another recipe "
                           "(learning_rate: 0.003 -> 0.001) and no checkpoint to continue from"), line
    assert line.endswith("use another output_dir, or resume_from_checkpoint=false to train over it"), line
    assert _snapshot(out) == done
    # asked for: resume_from_checkpoint=false trains over it
    assert main(["train", *args, "learning_rate=1e-3", "resume_from_checkpoint=false"]) == 0
    assert _snapshot(out)["adapter/adapter_model.safetensors"] != done["adapter/adapter_model.safetensors"]


def test_an_epoch_counted_rerun_at_its_checkpoint_is_refused_before_any_step(tmp_path, capsys):
    out = tmp_path / "run"
    # the packaged sums: 200 rows, batch 8 -> 25 steps an epoch; a checkpoint every 5 steps
    args = [str(RECIPES / "bdlora.yaml"), f"output_dir={out}", "max_steps=-1", "num_train_epochs=1", "save_steps=5",
            "save_total_limit=1"]
    assert main(["train", *args]) == 0
    done = _snapshot(out)
    assert "checkpoint-25/trainer_state.json" in done
    capsys.readouterr()
    line = _refusal(capsys, ["train", *args, "learning_rate=1e-3"])
    assert line == (
        f"bdlora train: error: recipe: output_dir={out} holds checkpoint-25 (step 25); 25 steps in all would train "
        "nothing past it and would overwrite it; use another output_dir, or max_steps > 25 to continue it"
    )
    assert _snapshot(out) == done
