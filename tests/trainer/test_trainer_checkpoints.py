"""train.trainer: checkpoints are never half-written (staged in .tmp-checkpoint-<step>/, renamed when complete),
rotation keeps the newest complete ones, and a failed write says where and why. Tiny Llama runs of 2-4 steps."""

import os
from pathlib import Path

import pytest

from bdlora_train.core.errors import RecipeError
from bdlora_train.objectives import supervised as supervised_objective
from bdlora_train.train import train
from bdlora_train.trainer.mixins import (
    STAGING_PREFIX,
    complete_checkpoints,
    last_checkpoint,
    make_trainer_class,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _checkpoint(root, name, complete=True):
    path = root / name
    path.mkdir(parents=True)
    if complete:
        (path / "trainer_state.json").write_text("{}")
    return path


# ------------------------------------------------------------------------------------------- which checkpoints


def test_complete_checkpoints_are_numbered_dirs_with_a_trainer_state_oldest_first(tmp_path):
    _checkpoint(tmp_path, "checkpoint-10")
    _checkpoint(tmp_path, "checkpoint-2")
    _checkpoint(tmp_path, "checkpoint-100")
    _checkpoint(tmp_path, "checkpoint-5", complete=False)  # Trainer writes trainer_state.json last: cut short
    _checkpoint(tmp_path, ".tmp-checkpoint-200")  # staged, never renamed
    _checkpoint(tmp_path, "checkpoint-x")
    _checkpoint(tmp_path, "old-checkpoint-300")
    _checkpoint(tmp_path, "checkpoint-100-old")  # a user's copy of the newest
    (tmp_path / "checkpoint-400").write_text("a file, not a dir")
    # numeric order: 2 < 10 < 100 (as text "checkpoint-10" < "checkpoint-100" < "checkpoint-2")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-10", "checkpoint-100"]
    assert last_checkpoint(tmp_path) == tmp_path / "checkpoint-100"
    assert last_checkpoint(str(tmp_path)) == tmp_path / "checkpoint-100"


def test_no_checkpoints(tmp_path):
    assert complete_checkpoints(tmp_path / "missing") == [] and last_checkpoint(tmp_path / "missing") is None
    _checkpoint(tmp_path, "checkpoint-3", complete=False)
    assert complete_checkpoints(tmp_path) == [] and last_checkpoint(tmp_path) is None


def test_a_staging_dir_is_taken_for_a_checkpoint_neither_by_resume_nor_by_transformers(tmp_path):
    """A save cut short leaves <run>/.tmp-checkpoint-<step>/checkpoint-<step>/, newer than every checkpoint and
    complete-looking inside: `last_checkpoint` (what resume reads) and transformers' own `get_last_checkpoint` pick
    the newest checkpoint Trainer named (PREFIX_CHECKPOINT_DIR-<step>), and Trainer's rotation neither deletes the
    staging dir nor counts it against save_total_limit."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

    for step in (2, 12):
        _checkpoint(tmp_path, f"{PREFIX_CHECKPOINT_DIR}-{step}")
    staging = tmp_path / f"{STAGING_PREFIX}{PREFIX_CHECKPOINT_DIR}-40"
    _checkpoint(staging, f"{PREFIX_CHECKPOINT_DIR}-40")  # as Trainer writes it under _get_output_dir
    (staging / "trainer_state.json").write_text("{}")
    assert last_checkpoint(tmp_path) == tmp_path / "checkpoint-12"
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-12")
    rotate_checkpoints(output_dir=str(tmp_path), save_total_limit=1, use_mtime=False)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["checkpoint-12"]
    assert (staging / "checkpoint-40" / "trainer_state.json").is_file()


# ----------------------------------------------------------------------------------------------- real runs


def _run(recipe, tiny_inputs):
    model, tokenizer, rows = tiny_inputs
    return train(recipe, model, tokenizer, rows)


def test_checkpoints_appear_complete_and_rotation_keeps_the_newest(tmp_path, tiny_recipe, tiny_inputs):
    out = tmp_path / "run"
    _run(tiny_recipe(out, max_steps=3, save_steps=1, save_total_limit=2), tiny_inputs)
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]  # 1 rotated out
    assert not list(out.glob(f"{STAGING_PREFIX}*"))
    for step in (2, 3):
        checkpoint = out / f"checkpoint-{step}"
        assert (checkpoint / "adapter_model.safetensors").is_file() and (checkpoint / "optimizer.pt").is_file()
        assert not (checkpoint / f"checkpoint-{step}").exists()  # renamed from staging, not nested
        recipe_yaml = (checkpoint / "recipe.yaml").read_text()  # what it was trained with
        assert "max_steps: 3" in recipe_yaml and "save_steps: 1" in recipe_yaml


def test_trainers_own_save_writes_into_the_staging_dir_never_in_place(tmp_path, tiny_recipe, tiny_inputs, monkeypatch):
    """Seen from inside transformers' Trainer._save_checkpoint (at its RNG-state step: weights, optimizer and
    scheduler written): the files go to .tmp-checkpoint-<step>/checkpoint-<step>/ and nothing named checkpoint-<step>
    is in the run dir yet. The staging works only while Trainer's save reads the trainer's output dir."""
    from transformers import Trainer

    out, saves = tmp_path / "run", []
    original = Trainer._save_rng_state

    def spy(self, output_dir):
        step = self.state.global_step
        assert Path(output_dir) == out / f"{STAGING_PREFIX}checkpoint-{step}" / f"checkpoint-{step}"
        written = {p.name for p in Path(output_dir).iterdir()}
        assert {"adapter_model.safetensors", "optimizer.pt", "scheduler.pt"} <= written
        assert not (out / f"checkpoint-{step}").exists()  # nothing under the final name yet
        saves.append(step)
        return original(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", spy)
    _run(tiny_recipe(out, max_steps=2, save_steps=1), tiny_inputs)
    assert saves == [1, 2] and [p.name for p in complete_checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]


def test_a_stale_staging_dir_is_replaced_not_merged(tmp_path, tiny_recipe, tiny_inputs, monkeypatch):
    """A staging dir left by an earlier kill (created here just before the save, after the run dir was claimed)."""
    base = make_trainer_class()

    class LeavesStaleStaging(base):
        def _save_checkpoint(self, model, trial):
            stale = tmp_path / "run" / f"{STAGING_PREFIX}checkpoint-{self.state.global_step}" / "checkpoint-2"
            stale.mkdir(parents=True, exist_ok=True)
            (stale / "stale.bin").write_text("from a killed save")
            return super()._save_checkpoint(model, trial)

    monkeypatch.setattr(supervised_objective, "make_trainer_class", lambda **_: LeavesStaleStaging)
    out = tmp_path / "run"
    _run(tiny_recipe(out, max_steps=2, save_steps=2), tiny_inputs)
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-2"]
    assert not (out / "checkpoint-2" / "stale.bin").exists()
    assert not list(out.glob(f"{STAGING_PREFIX}*"))


def test_a_save_interrupted_midway_never_appears_as_a_checkpoint(tmp_path, tiny_recipe, tiny_inputs, monkeypatch):
    from transformers import Trainer

    original = Trainer._save_checkpoint

    def killed_at_step_4(self, model, trial):
        if self.state.global_step == 4:
            partial = self._get_output_dir(trial) + "/checkpoint-4"
            os.makedirs(partial)
            open(partial + "/adapter_model.safetensors", "w").close()  # half-written
            raise KeyboardInterrupt  # the process is killed mid-save
        return original(self, model, trial)

    monkeypatch.setattr(Trainer, "_save_checkpoint", killed_at_step_4)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        _run(tiny_recipe(out, max_steps=4, save_steps=2), tiny_inputs)
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-2"]
    assert last_checkpoint(out) == out / "checkpoint-2"  # what a re-run resumes from
    assert not (out / "checkpoint-4").exists()


def test_a_failed_write_is_one_line_naming_the_checkpoint_and_leaves_nothing(
    tmp_path, tiny_recipe, tiny_inputs, monkeypatch
):
    from transformers import Trainer

    def disk_full(self, model, trial):
        staging = self._get_output_dir(trial)
        os.makedirs(staging + "/checkpoint-2")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Trainer, "_save_checkpoint", disk_full)
    out = tmp_path / "run"
    with pytest.raises(RecipeError) as info:
        _run(tiny_recipe(out, max_steps=2, save_steps=2), tiny_inputs)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint-2: writing to {out / '.tmp-checkpoint-2'} failed (")
    assert "No space left on device" in message
    assert "free disk space, then re-run the same command to resume from the last complete checkpoint" in message
    assert not (out / ".tmp-checkpoint-2").exists() and not (out / "checkpoint-2").exists()
