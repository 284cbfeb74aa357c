"""The run directory (`output_dir`): one run at a time, nothing of the user's deleted, nothing half-written.

  .bdlora-lock         held (flock) for the whole run: a second run on the same directory fails at once
  checkpoint-<step>/   complete checkpoints only, each with the recipe.yaml it was trained with
  adapter/             the final adapter; metrics.json and recipe.yaml are written after it, so recipe.yaml
                       always describes what is on disk
  metrics.json         with push_to_hub: `pushed` (true / false), `hub_repo_id` and `hub_url` (null until pushed),
                       rewritten atomically after every push attempt (record_push)
A finished run re-run with the same recipe does nothing, except the push it still owes: push_to_hub with no
`"pushed": true` for hub_model_id in metrics.json (a failed or interrupted upload) is retried without training.
The push keys are no part of what makes two recipes the same run: turning push_to_hub on for a finished run pushes
it. A resume whose checkpoint has other adapter shapes is refused before any training.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import sys
from pathlib import Path

import yaml

from bdlora_train.core.errors import RecipeError, first_line
from bdlora_train.core.files import atomic_write_text
from bdlora_train.trainer.mixins import behind_message, complete_checkpoints, last_checkpoint

LOCK_NAME = ".bdlora-lock"
RECIPE_NAME = "recipe.yaml"
ADAPTER_NAME = "adapter"
METRICS_NAME = "metrics.json"
PUSH_KEYS = ("push_to_hub", "hub_model_id", "hub_private_repo")  # where a copy goes, not what was trained
# Staging names this toolkit writes inside output_dir (trainer/mixins.py, run.py, files.py); nothing else is ever
# removed.
STAGING_RE = re.compile(
    r"^\.tmp-(?:checkpoint-\d+|adapter|old-[0-9a-f]{8}-(?:adapter|checkpoint-\d+)|write-test-\d+"
    r"|\d+-(?:metrics\.json|recipe\.yaml))$"
)


def check_output_dir(output_dir: str) -> Path:
    """Create output_dir and prove it is writable, before any model is loaded."""
    root = Path(output_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".tmp-write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink(missing_ok=True)
    except OSError as err:
        raise RecipeError(
            f"recipe: output_dir={output_dir} is not writable ({err.strerror}); choose another output_dir"
        ) from None
    return root


@contextlib.contextmanager
def run_lock(output_dir: Path, holder: bool = True):
    """Hold an exclusive lock on output_dir for the block (only on the process that writes: `holder`)."""
    if not holder:
        yield
        return
    path = output_dir / LOCK_NAME
    handle = open(path, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            handle.seek(0)
            pid = handle.read().strip() or "unknown"
            raise RecipeError(
                f"recipe: output_dir={output_dir} is in use by another run (pid {pid}); wait for it to finish or "
                "choose another output_dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        handle.close()  # closing releases the flock


@contextlib.contextmanager
def claimed(output_dir: str, holder: bool = True):
    """output_dir checked writable and locked for the block (yields its Path). A run that fails before writing
    anything leaves no trace: the directory it created goes, or in a directory that existed, the lock file it
    created. Nothing but the lock and the toolkit's own staging names is ever removed. Only the holder (rank 0)
    creates the directory: another rank that made it could leave it behind after rank 0 removed it (a refusal)."""
    root = Path(output_dir)
    if not holder:
        yield root
        return
    created = [p for p in (root, *root.parents) if not p.exists()]  # what mkdir will create, deepest first
    lock_created = not (root / LOCK_NAME).exists()
    root = check_output_dir(output_dir)
    try:
        with run_lock(root):
            yield root
    except BaseException:
        _forget_failed_start(root, created, lock_created)
        raise


def _forget_failed_start(root: Path, created: list[Path], lock_created: bool) -> None:
    try:
        left = [e for e in root.iterdir() if e.name != LOCK_NAME and not STAGING_RE.match(e.name)]
        if created and not left:
            shutil.rmtree(root)
            for parent in created[1:]:  # the parents mkdir made for it, while nothing else moved in
                if any(parent.iterdir()):
                    break
                parent.rmdir()
        elif lock_created:
            (root / LOCK_NAME).unlink(missing_ok=True)
    except OSError:
        pass  # tidying up must never hide the error that got us here


def remove_stale_staging(output_dir: Path) -> None:
    """Leftovers of a killed run of ours (never resumed from); any other file is the user's and stays."""
    for entry in output_dir.iterdir():
        if STAGING_RE.match(entry.name):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)


def finished(output_dir: Path, recipe_yaml: str) -> dict | None:
    """metrics.json of a finished run of exactly this recipe in output_dir, else None."""
    recipe_file, metrics_file = output_dir / RECIPE_NAME, output_dir / METRICS_NAME
    if finished_files_missing(output_dir):
        return None
    if _comparable(recipe_file.read_text()) != _comparable(recipe_yaml):
        return None
    try:
        return json.loads(metrics_file.read_text())
    except json.JSONDecodeError:
        return None


def check_not_behind(output_dir: Path, recipe, recipe_yaml: str) -> None:
    """A run never trains over what output_dir holds without being asked to (resume_from_checkpoint=false):

    - with a checkpoint to resume from at step S, a `max_steps` at or below S is refused: the Trainer would take a
      step past its own end anyway, label it S and overwrite checkpoint-S and the finished adapter;
    - with none, a finished run of another recipe (its adapter, metrics.json and recipe.yaml) is refused: training
      from scratch would replace that run's adapter.
    An epoch-counted run (max_steps -1) is checked once the Trainer knows its total (trainer.resume_notice)."""
    resume = resolve_resume(recipe.resume_from_checkpoint, output_dir)
    if resume is not None:
        step = json.loads((Path(resume) / "trainer_state.json").read_text()).get("global_step", 0)
        if 0 < recipe.max_steps <= step:
            raise RecipeError(behind_message(output_dir, Path(resume).name, step, f"max_steps={recipe.max_steps}"))
        return
    if recipe.resume_from_checkpoint is False or finished_files_missing(output_dir):
        return
    before, now = _comparable((output_dir / RECIPE_NAME).read_text()), _comparable(recipe_yaml)
    changed = [f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(before) | set(now))
               if before.get(k) != now.get(k)]
    raise RecipeError(
        f"recipe: output_dir={output_dir} holds the finished run of another recipe ({'; '.join(changed[:4])}"
        f"{'; ...' if len(changed) > 4 else ''}) and no checkpoint to continue from: training would replace its "
        "adapter; use another output_dir, or resume_from_checkpoint=false to train over it"
    )


def finished_files_missing(output_dir: Path) -> bool:
    """Not a finished run: one of what a run writes last (its adapter, metrics.json, recipe.yaml) is missing."""
    finished = (RECIPE_NAME, METRICS_NAME, f"{ADAPTER_NAME}/adapter_model.safetensors")
    return not all((output_dir / name).is_file() for name in finished)


def _comparable(recipe_yaml: str) -> dict:
    """A recipe as a dict, without the keys that name where the run lives (a moved run directory is the same run)."""
    data = yaml.safe_load(recipe_yaml) or {}
    for key in ("output_dir", "resume_from_checkpoint", *PUSH_KEYS):
        data.pop(key, None)
    return data


def push_pending(metrics: dict, repo_id: str | None) -> bool:
    """Whether a finished run still owes its push to `repo_id`: no `"pushed": true` for that repo in metrics.json
    (a failed upload, a killed one, or push_to_hub turned on after the run). Runs pushed before `pushed` was
    recorded have a hub_url and no hub_repo_id."""
    if metrics.get("pushed") is True:
        return metrics.get("hub_repo_id") != repo_id
    return not ("pushed" not in metrics and metrics.get("hub_url") and "hub_repo_id" not in metrics)


def record_push(output_dir: Path, metrics: dict, repo_id: str, url: str | None) -> None:
    """metrics.json (and `metrics`) say whether the run's adapter is on the Hub: `pushed`, `hub_repo_id`, `hub_url`
    (None when the push failed); written atomically, so a reader sees the old record or the new one."""
    metrics.update(pushed=url is not None, hub_repo_id=repo_id, hub_url=url)
    atomic_write_text(Path(output_dir) / METRICS_NAME, json.dumps(metrics, indent=2) + "\n")


def resolve_resume(spec, output_dir: Path) -> str | None:
    """The checkpoint to resume from: None for a fresh start."""
    if spec is False:
        return None
    if spec is None or spec is True:
        found = last_checkpoint(output_dir)
        if spec is True and found is None:
            raise RecipeError(
                f"recipe: resume_from_checkpoint=true but {output_dir} has no complete checkpoint-<step>/"
            )
        return str(found) if found else None
    path = Path(spec)
    if not (path / "trainer_state.json").is_file():
        raise RecipeError(
            f"recipe: resume_from_checkpoint={spec} is not a complete checkpoint dir (no trainer_state.json)"
        )
    return str(path)


def start_over(output_dir: Path) -> None:
    """resume_from_checkpoint=false: old checkpoints must not be resumed by a later run of the new recipe."""
    for old in complete_checkpoints(output_dir):
        shutil.rmtree(old)


def check_checkpoint_matches(checkpoint: str, peft_config) -> None:
    """A checkpoint trained with other adapter shapes cannot be resumed: say which key changed, before training."""
    saved_file = Path(checkpoint) / "adapter_config.json"
    if not saved_file.is_file():
        return
    saved = json.loads(saved_file.read_text())
    now = peft_config.to_dict()
    name = Path(checkpoint).name
    for key in ("r", "use_bdlora", "target_modules", "rank_pattern", "modules_to_save"):
        before, after = _normalized(saved.get(key)), _normalized(now.get(key))
        if key == "use_bdlora":
            before, after = (before or {}).get("nblocks"), (after or {}).get("nblocks")
            key = "nblocks"
        if before != after:
            raise RecipeError(
                f"recipe: {name} was trained with {key}={before!r}, this recipe gives {after!r}; resume with the same "
                "adapter shape, or start over with resume_from_checkpoint=false (or another output_dir)"
            )


def _normalized(value):
    if isinstance(value, (set, list, tuple)):
        return sorted(value)
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return dict(vars(value))
    return value or None


def report_changed_keys(checkpoint: str, output_dir: Path, recipe_yaml: str) -> None:
    """Resuming with a different recipe is allowed (e.g. more steps) but said out loud."""
    previous = Path(checkpoint) / RECIPE_NAME
    previous = previous if previous.is_file() else output_dir / RECIPE_NAME
    if not previous.is_file():
        return
    before, now = yaml.safe_load(previous.read_text()) or {}, yaml.safe_load(recipe_yaml)
    changed = [
        f"{k} ({before[k]!r} -> {now[k]!r})"
        for k in now
        if k in before and before[k] != now[k] and k not in ("output_dir", "resume_from_checkpoint")
    ]
    if changed:
        print(f"bdlora train: resuming {checkpoint} with changed keys: {', '.join(changed)}", file=sys.stderr)


def rescue_message(err: OSError, target: Path, save) -> str:
    """A final save failed: save the adapter somewhere else (the temp dir, often another filesystem) and say where.

    `save(path)` writes the adapter. The message always names what is left: the rescue copy, or the last checkpoint.
    """
    import tempfile

    reason = first_line(err)
    last = last_checkpoint(target.parent)
    fallback = f"the last complete checkpoint is {last}" if last else "no complete checkpoint exists"
    try:
        rescue = Path(tempfile.mkdtemp(prefix="bdlora-rescue-")) / ADAPTER_NAME
        save(rescue)
    except OSError as second:
        return (
            f"final save to {target} failed ({reason}) and so did the rescue copy ({first_line(second)}); "
            f"the trained weights are lost; {fallback}: free space and re-run to resume"
        )
    return (
        f"final save to {target} failed ({reason}); the trained adapter was saved to {rescue} instead: move it to "
        f"{target} once there is space ({fallback})"
    )
