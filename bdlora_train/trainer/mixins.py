"""Checkpoints that are never half-written, and an adapter save that is complete under every launch mode.

transformers' Trainer writes checkpoint-<step>/ in place, so a kill mid-save leaves a directory that resume would
pick. `AtomicCheckpoints` lets it write into a staging directory and renames it once every rank is done;
`TensorParallelAdapter` adds a TP run's state. Both are mixins over any `transformers.Trainer` subclass
(`make_trainer_class`). They override six private Trainer methods (`_save_checkpoint`, `_get_output_dir`, and for
TP runs `_load_from_checkpoint`, `_save_optimizer_and_scheduler`, `_load_optimizer_and_scheduler`,
`_track_num_input_tokens`) and relies on a seventh (`_save_rng_state`); tests/peft_integration/test_peft_contract.py
checks they still
exist with these signatures, and pyproject caps transformers at the versions it passed on.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from bdlora_train.core.errors import RecipeError, first_line
from bdlora_train.core.files import replace_dir
from bdlora_train.peft_integration.storage import quiet_peft_save
from bdlora_train.tp_runtime import mesh

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STAGING_PREFIX = ".tmp-"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """checkpoint-<step> dirs that hold a trainer_state.json (what Trainer writes last), oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = CHECKPOINT_RE.match(entry.name)
        if match and entry.is_dir() and (entry / "trainer_state.json").is_file():
            found.append((int(match.group(1)), entry))
    return [path for _, path in sorted(found)]


def last_checkpoint(output_dir: str | Path) -> Path | None:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def resume_lines(checkpoint: str, step: int, total: int, planned: int | None) -> list[str]:
    """What a resumed run says on rank 0 before its first step: where it resumes, and, when the checkpoint was
    trained toward another number of steps (max_steps or the epochs changed), that the result is not a fresh run's:
    the steps before it followed the learning-rate schedule of the old total."""
    lines = [f"bdlora train: resuming from {checkpoint} (step {step} of {total})"]
    if planned is not None and planned != total:
        lines.append(
            f"bdlora train: warning: {Path(checkpoint).name} was trained on a {planned}-step learning-rate schedule, "
            f"this run has {total} steps: the result differs from a fresh run of {total} steps; for a fresh run use "
            "resume_from_checkpoint=false or a new output_dir"
        )
    return lines


def behind_message(output_dir, checkpoint: str, step: int, total: str) -> str:
    """The refusal of a run whose end is at or before its checkpoint's step (rundir.check_not_behind)."""
    return (
        f"recipe: output_dir={output_dir} holds {checkpoint} (step {step}); {total} would train nothing past it and "
        f"would overwrite it; use another output_dir, or max_steps > {step} to continue it"
    )


def resume_notice(checkpoint: str, planned: int | None):
    """A Trainer callback that prints `resume_lines` on the main process when training begins (the step and the
    total are the Trainer's own, after it loaded the checkpoint's state), and refuses a total at or below the
    checkpoint's step before any step (an epoch-counted run: rundir.check_not_behind refuses a max_steps one
    before the model loads); the Trainer would take one step past its end and overwrite the checkpoint."""
    import sys

    from transformers import TrainerCallback

    class ResumeNotice(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if state.global_step >= state.max_steps:
                path = Path(checkpoint)
                raise RecipeError(behind_message(path.parent, path.name, state.global_step,
                                                 f"{state.max_steps} steps in all"))
            if state.is_world_process_zero:
                for line in resume_lines(checkpoint, state.global_step, state.max_steps, planned):
                    print(line, file=sys.stderr, flush=True)

    return ResumeNotice()


class AtomicCheckpoints:
    """A `transformers.Trainer` mixin (any subclass, TRL's included): checkpoints appear under their final name only
    once fully written. Trainer writes checkpoint-<step>/ in place, so a kill mid-save leaves a directory that resume
    would pick; this lets it write into <output_dir>/.tmp-checkpoint-<step>/ and renames once all ranks are done."""

    _staging: str | None = None
    recipe_yaml: str | None = None  # written into every checkpoint: what it was trained with

    def _get_output_dir(self, trial):
        return self._staging or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        from transformers.trainer_utils import rotate_checkpoints

        run_dir = Path(self.args.output_dir)
        name = f"checkpoint-{self.state.global_step}"
        staging = run_dir / f"{STAGING_PREFIX}{name}"
        if self.args.should_save and staging.exists():
            shutil.rmtree(staging)
        self.accelerator.wait_for_everyone()
        self._staging = str(staging)
        try:
            with quiet_peft_save():
                super()._save_checkpoint(model, trial)
            self.save_checkpoint_extras(str(staging / name))
            if self.args.should_save and self.recipe_yaml is not None:
                (staging / name / "recipe.yaml").write_text(self.recipe_yaml)
        except OSError as err:  # e.g. a full disk: the staging dir is never resumed from; say where and why
            if self.args.should_save:
                shutil.rmtree(staging, ignore_errors=True)
            raise RecipeError(
                f"{name}: writing to {staging} failed ({first_line(err)}); free disk space, then re-run the "
                "same command to resume from the last complete checkpoint"
            ) from None
        finally:
            self._staging = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            replace_dir(staging / name, run_dir / name)
            shutil.rmtree(staging, ignore_errors=True)
            rotate_checkpoints(
                output_dir=str(run_dir),
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=False,
            )
        self.accelerator.wait_for_everyone()

    def save_checkpoint_extras(self, checkpoint_dir: str) -> None:
        """What a checkpoint holds besides what Trainer wrote (nothing here; a TP run adds its gathered state)."""

    def create_model_card(self, *args, **kwargs):
        """Nothing: the run's model card is the toolkit's, in adapter/README.md (cards.py). TRL's trainers write a
        generic card into output_dir at every checkpoint save ("a fine-tuned version of [None]" for a base that is a
        local directory); transformers' Trainer calls this only from its own push_to_hub, which runs never use."""


class TensorParallelAdapter:
    """A `transformers.Trainer` mixin for a base sharded by transformers (tp_size / ep_size > 1) whose adapter
    tp_runtime/dispatch.py made rank-local: the data mesh, the data-parallel gradient average, one count of a TP group's
    tokens, and the adapter and optimizer state gathered into PEFT's layout at a save and sliced back at resume.

    Trainer hands accelerate a ParallelismConfig for a TP-loaded model, which accelerate refuses on CPU (gloo); the
    run needs nothing from it but data placement, so the same path runs on CPU and GPU: no ParallelismConfig, and
    accelerate's data loaders get the mesh that gives every TP rank the same batch. `sharded_adapter`: what
    `shard_adapters` returned for the model (tp_runtime/adapter.py)."""

    def __init__(self, *args, sharded_adapter, **kwargs):
        self.sharded_adapter = sharded_adapter
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self):
        with mesh.hidden_tp_size(self.model):
            super().create_accelerator_and_postprocess()
        self.accelerator.state.device_mesh = mesh.data_mesh(self.model)
        self._bdlora_dp_group = mesh.data_parallel_group(self.model)

    def _track_num_input_tokens(self, inputs):
        # Trainer sums every process's tokens, but the ranks of a TP group read the same batch: counted once, as
        # data parallelism counts its replicas, the live log, trainer_state.json and metrics.json agree with one
        # process (every rank of a group adds the same count, so the sum divides exactly)
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        tp = mesh.mesh_sizes(self.model)[2]
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // tp

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients:  # end of an accumulation
            self.sharded_adapter.average_over_data_parallel(self._bdlora_dp_group)
        return loss

    def save_model(self, output_dir=None, _internal_call=False):
        output_dir = output_dir or self.args.output_dir
        write_adapter(self, Path(output_dir))  # collective: the rank-local blocks gathered
        if self.args.should_save and self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        self.accelerator.wait_for_everyone()

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        self.sharded_adapter.load_checkpoint(resume_from_checkpoint)

    def _save_optimizer_and_scheduler(self, output_dir):
        self.sharded_adapter.save_optimizer(self.optimizer, output_dir, self.args.should_save)  # collective
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / "scheduler.pt")

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.sharded_adapter.load_optimizer(self.optimizer, checkpoint)
        self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / "scheduler.pt", weights_only=True))

    def save_checkpoint_extras(self, checkpoint_dir: str) -> None:
        # save_only_model (training_arguments): the optimizer state is saved here, gathered
        self._save_optimizer_and_scheduler(checkpoint_dir)
        self._save_rng_state(checkpoint_dir)


def make_trainer_class(tensor_parallel: bool = False, base=None) -> type:
    """The toolkit's Trainer: `base` (transformers' Trainer, or any subclass of it, TRL's included) with atomic
    checkpoints, and for a run whose adapter tp_runtime/dispatch.py made rank-local (`tensor_parallel`) its TP state."""
    from transformers import Trainer

    base = base or Trainer
    mixins = (TensorParallelAdapter, AtomicCheckpoints) if tensor_parallel else (AtomicCheckpoints,)
    name = ("TensorParallel" if tensor_parallel else "AtomicCheckpoint") + base.__name__
    return type(name, (*mixins, base), {"__module__": __name__})


def save_adapter(trainer, path: Path) -> None:
    """The adapter in stock PEFT format, complete under every launch mode (collective: call on all ranks).

    ZeRO-3 partitions every parameter, so a plain save_pretrained writes empty tensors; we gather only the
    adapter's parameters (not the frozen base) and save from rank 0. Under TP the trainer's `save_model` gathers the
    rank-local blocks the same way.
    """
    if _zero3(trainer):
        write_adapter(trainer, path)
        if trainer.args.should_save and trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(str(path))
        trainer.accelerator.wait_for_everyone()
        return
    with quiet_peft_save():
        trainer.save_model(str(path))
    trainer.accelerator.wait_for_everyone()


def write_adapter(trainer, path: Path) -> None:
    """Only the adapter's tensors and config (no tokenizer, no training arguments), complete under every launch mode:
    a ZeRO-3 partition and a TP run's rank-local blocks are gathered (the adapter only, never the base), accelerate's
    FSDP through its full state dict (as Trainer saves it), and the main process writes (collective: call on all
    ranks)."""
    from peft import get_peft_model_state_dict

    model = trainer.accelerator.unwrap_model(trainer.model)
    sharded = getattr(trainer, "sharded_adapter", None)
    if _zero3(trainer):
        import deepspeed

        params = [p for p in model.parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    elif sharded is not None:
        state = get_peft_model_state_dict(model, state_dict=sharded.gathered_state())
    elif trainer.is_fsdp_enabled:  # accelerate's FSDP: the full state dict on the main process (as Trainer saves)
        full = trainer.accelerator.get_state_dict(trainer.model)
        state = get_peft_model_state_dict(model, state_dict=full) if trainer.args.should_save else None
    else:
        state = None  # PEFT's own state dict of the model
    if trainer.args.should_save:
        with quiet_peft_save():
            model.save_pretrained(str(path), state_dict=state, safe_serialization=True)


def _zero3(trainer) -> bool:
    ds_plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return bool(trainer.is_deepspeed_enabled and ds_plugin is not None and ds_plugin.zero_stage == 3)
