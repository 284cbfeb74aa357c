"""`train(recipe)`: one training run, read top to bottom as setup -> objective.train -> finalize.

Output in `output_dir` (see rundir.py for what is guaranteed there):
  checkpoint-<step>/   complete checkpoints only (trainer/mixins.py stages and renames them); re-running resumes
  adapter/             the final adapter in stock PEFT format, with a model card (README.md)
  metrics.json         method, rank, trainable params, tokens/s, peak memory, final (and eval) loss, world size
  recipe.yaml          the resolved recipe, written last
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bdlora_train import cards
from bdlora_train.adapters.load import load_adapter
from bdlora_train.adapters.reader import read_adapter
from bdlora_train.core import launch_env
from bdlora_train.core.errors import RecipeError
from bdlora_train.core.files import atomic_write_text, replace_dir
from bdlora_train.launch.checks import check_single_process_launch, parallelism, per_rank_parameter_bytes
from bdlora_train.launch.env import scoped_env, scoped_launch_env, wandb_env
from bdlora_train.models import load_trained_base
from bdlora_train.models.float64 import float64_compute
from bdlora_train.quant.quantized import write_side_file
from bdlora_train.recipe.schema import Recipe
from bdlora_train.serving.plan import serving_lines
from bdlora_train.train import rundir
from bdlora_train.train.push import push_run
from bdlora_train.train.setup import Run, setup
from bdlora_train.trainer.mixins import STAGING_PREFIX, resume_notice, save_adapter


@dataclass
class TrainResult:
    """The trained adapter: its directory, its metrics, and the PeftModel (loaded on first use when the run had
    already finished and nothing was trained)."""

    metrics: dict
    adapter_dir: Path
    _model: object = field(default=None, repr=False)
    trained: bool = True  # False: the output_dir already held this recipe's finished run

    @property
    def model(self):
        if self._model is None:
            base = load_trained_base(self.metrics["model"], self.adapter_dir, with_tokenizer=False)[0]
            self._model = load_adapter(base, self.adapter_dir)
        return self._model


def train(recipe: Recipe, model=None, tokenizer=None, train_dataset=None) -> TrainResult:
    """Train one adapter as the recipe says; returns the adapter dir, the metrics and the PeftModel.

    `model`/`tokenizer`/`train_dataset` let a caller (the compare sweep) load the base model once: the model
    is deep-copied, so the caller's stays clean across calls. `train_dataset` holds rows in any format
    data/rows.py reads. All input errors are raised before training starts, data errors before the model loads.
    """
    recipe.validate()
    check_single_process_launch()
    holder = launch_env.is_main_process()  # one process writes output_dir (and holds its lock)
    with scoped_launch_env(recipe.cpu_threads) as launch, rundir.claimed(recipe.output_dir, holder) as output_dir:
        recipe_yaml = recipe.to_yaml()
        done = None if recipe.resume_from_checkpoint is False else rundir.finished(output_dir, recipe_yaml)
        if done is not None:
            adapter_dir = output_dir / rundir.ADAPTER_NAME
            if recipe.push_to_hub and rundir.push_pending(done, recipe.hub_model_id):
                if holder:  # the training is done; the push it owes is not (a failed or interrupted upload)
                    print(
                        f"bdlora train: {output_dir} holds the finished run of this recipe, not yet pushed to "
                        f"{recipe.hub_model_id}; pushing it",
                        file=sys.stderr,
                    )
                    push_run(adapter_dir, recipe.hub_model_id, recipe.hub_private_repo, done, output_dir)
                return TrainResult(metrics=done, adapter_dir=adapter_dir, trained=False)
            print(
                f"bdlora train: {output_dir} already holds the finished run of this recipe "
                f"({adapter_dir}); nothing to do (resume_from_checkpoint=false trains again)",
                file=sys.stderr,
            )
            return TrainResult(metrics=done, adapter_dir=adapter_dir, trained=False)
        rundir.check_not_behind(output_dir, recipe, recipe_yaml)
        run = setup(recipe, recipe_yaml, output_dir, model, tokenizer, train_dataset, launch)  # train/setup.py
        output, wall, state_before = _fit(run)
        return _finalize(run, output, wall, state_before)


def _fit(run: Run) -> tuple[object, float, dict]:
    """The objective's training (resuming if a checkpoint was found); (TrainOutput, wall seconds, state at resume)."""
    with scoped_env(wandb_env(run.args.report_to, run.recipe.wandb_project, run.output_dir, run.is_main)):
        start_peak_memory()
        state_before = {}
        if run.resume:  # read now: checkpoint rotation may delete the dir during training
            state_before = json.loads((Path(run.resume) / "trainer_state.json").read_text())
            # first of the callbacks: its line comes before the progress bar's, not after the bar's first frame
            run.trainer.callback_handler.callbacks.insert(0, resume_notice(run.resume, state_before.get("max_steps")))
        with float64_compute(run.recipe.torch_dtype == "float64"):
            output, wall = run.objective.train(run.trainer, run.resume)
        if "wandb" in run.args.report_to:
            import wandb

            if wandb.run is not None:
                wandb.finish()
    return output, wall, state_before


def _finalize(run: Run, output, wall: float, state_before: dict) -> TrainResult:
    """Save the adapter (all ranks), then on the main rank: model card, metrics.json, recipe.yaml, optional push."""
    recipe, trainer, output_dir = run.recipe, run.trainer, run.output_dir
    peak_mb, peak_kind = peak_memory()
    tokens = trainer.state.num_input_tokens_seen - state_before.get("num_input_tokens_seen", 0)  # TP: trainer/mixins.py
    adapter_dir = output_dir / rundir.ADAPTER_NAME
    staging = output_dir / f"{STAGING_PREFIX}{rundir.ADAPTER_NAME}"
    trained = trainer.accelerator.unwrap_model(trainer.model)
    trained.get_base_model().config.use_cache = run.use_cache
    metrics = _run_metrics(run, output, wall, state_before, tokens, peak_mb, peak_kind, adapter_dir)
    try:
        if run.is_main and staging.exists():
            shutil.rmtree(staging)  # ours (rundir.STAGING_RE): a killed run's half-written adapter
        save_adapter(trainer, staging)
        if run.is_main:
            (staging / "training_args.bin").unlink(missing_ok=True)  # a pickle; recipe.yaml says the same
            write_side_file(staging, run.quant)  # a quantized base's record: export --to merged reads it
            replace_dir(staging, adapter_dir)
    except OSError as err:
        raise RecipeError(rundir.rescue_message(err, adapter_dir, lambda path: save_adapter(trainer, path))) from None
    if run.is_main:
        adapter = read_adapter(adapter_dir)
        serving = serving_lines(adapter, cards.card_base(adapter, metrics), str(adapter_dir.resolve()))
        # in place: the card names the adapter's path; the adapter just read, not read again
        cards.write_model_card(adapter_dir, serving, metrics=metrics, adapter=adapter)
        atomic_write_text(output_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
        atomic_write_text(output_dir / rundir.RECIPE_NAME, run.recipe_yaml)  # last: it describes what is on disk
        if recipe.push_to_hub:
            push_run(adapter_dir, recipe.hub_model_id, recipe.hub_private_repo, metrics, output_dir)
    trainer.accelerator.wait_for_everyone()
    return TrainResult(metrics=metrics, adapter_dir=adapter_dir, _model=trained)


def _run_metrics(run: Run, output, wall, state_before, tokens, peak_mb, peak_kind, adapter_dir) -> dict:
    recipe, trainer = run.recipe, run.trainer
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    return {
        "objective": recipe.objective,
        "method": run.plan.method,
        "model": recipe.model,
        "dataset": run.spec,
        **run.plan.metrics(),  # r, lora_alpha, nblocks, bd_lr_ratio, loraplus_lr_ratio, target_modules, matched_*
        "trainable_params": run.trainable,
        "steps": trainer.state.global_step,
        "steps_this_run": trainer.state.global_step - state_before.get("global_step", 0),
        "resumed_from": run.resume,
        "train_wall_time_s": round(wall, 3),
        "tokens_seen": int(tokens),
        "tokens_per_second": round(tokens / wall, 2) if wall > 0 else None,
        "peak_memory_mb": round(peak_mb, 1),
        "peak_memory_kind": peak_kind,
        "final_loss": final_loss(trainer.state.log_history) or round(float(output.training_loss), 6),
        "train_loss_mean": round(float(output.training_loss), 6),
        "eval_loss": round(float(evals[-1]), 6) if evals else None,
        "world_size": run.args.world_size,
        "parallelism": parallelism(trainer),
        "per_rank_parameter_bytes": per_rank_parameter_bytes(trainer),  # None for one process
        "seed": recipe.seed,
        "device": str(run.args.device),
        "adapter_dir": str(adapter_dir),
        **run.objective.metrics(recipe, trainer),
    }


def start_peak_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM so the peak is this run's


def peak_memory() -> tuple[float, str]:
    import torch

    if torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0:
        return torch.cuda.max_memory_allocated() / 2**20, "cuda_max_allocated"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024, "cpu_peak_rss"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu_max_rss"


def final_loss(log_history: list[dict]) -> float | None:
    for entry in reversed(log_history):
        if "loss" in entry:
            return float(entry["loss"])
    return None
