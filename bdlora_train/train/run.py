"""`train(recipe)`: one training run, read top to bottom as setup -> fit -> finalize.

Output in `output_dir` (see rundir.py for what is guaranteed there):
  checkpoint-<step>/   complete checkpoints only (trainer.py stages and renames them); re-running resumes
  adapter/             the final adapter in stock PEFT format, with a model card (README.md)
  metrics.json         method, rank, trainable params, tokens/s, peak memory, final (and eval) loss, world size
  recipe.yaml          the resolved recipe, written last
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bdlora_train import cards, hub
from bdlora_train.adapters.load import load_adapter
from bdlora_train.adapters.reader import read_adapter
from bdlora_train.core import launch_env
from bdlora_train.core.dtypes import dtype_of
from bdlora_train.core.errors import ModelSpecError, RecipeError, RolloutError
from bdlora_train.core.files import atomic_write_text, replace_dir
from bdlora_train.models import load_model, load_tokenizer, load_trained_base
from bdlora_train.models.embedded import drop_gguf_marker
from bdlora_train.models.float64 import float64_compute
from bdlora_train.peft_integration.config import get_peft_model
from bdlora_train.quant.keys import QuantKeys
from bdlora_train.quant.quantized import prepare_for_training, quantization_config, write_side_file
from bdlora_train.serving.plan import serving_lines
from bdlora_train.tp_runtime.dispatch import global_adapter_shapes, shard_adapters
from bdlora_train.train import rundir
from bdlora_train.train.data import DataSpec, check_rows, load_rows, split_eval
from bdlora_train.train.data_formats import detect_format, to_canonical
from bdlora_train.train.deepspeed_setup import check_deepspeed_dtype
from bdlora_train.train.grpo import grpo_metrics, grpo_trainer, keep_last_step
from bdlora_train.train.launch import (
    check_model_parallel,
    check_parallelism,
    check_single_process_launch,
    model_parallel_config,
    parallelism,
)
from bdlora_train.train.optim import apply_lr_ratios
from bdlora_train.train.push import push_run
from bdlora_train.train.recipe import Recipe
from bdlora_train.train.run_env import scoped_env, scoped_launch_env, wandb_env
from bdlora_train.train.run_plan import RunPlan, plan_run
from bdlora_train.train.tokenize import collator, prepare_tokenizer, tokenize
from bdlora_train.train.trainer import STAGING_PREFIX, make_trainer_class, resume_notice, save_adapter
from bdlora_train.train.training_args import training_arguments


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
    train/data.py reads. All input errors are raised before training starts, data errors before the model loads.
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
        run = _setup(recipe, recipe_yaml, output_dir, model, tokenizer, train_dataset, launch)
        output, wall, state_before = _fit(run)
        return _finalize(run, output, wall, state_before)


@dataclass
class _Run:
    """Everything setup produced and fit / finalize need."""

    recipe: Recipe
    recipe_yaml: str
    output_dir: Path
    resume: str | None
    args: object  # TrainingArguments
    trainer: object
    plan: RunPlan
    quant: QuantKeys
    trainable: int
    spec: str
    use_cache: object
    is_main: bool


def _setup(recipe: Recipe, recipe_yaml: str, output_dir: Path, model, tokenizer, train_dataset, launch) -> _Run:
    """Check everything, read the data, then load the model and build the PEFT model and the Trainer."""
    from transformers import set_seed
    from transformers.trainer_callback import ProgressCallback
    from transformers.utils import logging as hf_logging

    check_deepspeed_dtype(recipe.torch_dtype, bool(recipe.deepspeed or launch["deepspeed"]))
    resume = rundir.resolve_resume(recipe.resume_from_checkpoint, output_dir)
    distributed = model_parallel_config(recipe)  # tp_size / fsdp_size: transformers shards the base at load
    quant = recipe.quant_keys  # QLoRA keys, if any: the load, the kbit prep and the adapter's side file read them
    plan = None
    if distributed is not None:  # every check TP needs, on the meta-device model, before any process group or weight
        if model is not None:
            raise RecipeError("train(): with tp_size / fsdp_size the base is loaded sharded by the run; pass no model")
        plan = check_model_parallel(recipe)  # the run's plan, made once on the meta-device model and reused below
    args = training_arguments(recipe, output_dir, distributed)
    check_world_size(args)
    is_main = args.process_index == 0

    # Tokenizer and data first: a bad column or row fails in seconds, not after the weights are read.
    if tokenizer is None:
        with model_key(recipe.model):
            tokenizer = load_tokenizer(recipe.model)
    else:
        tokenizer = copy.deepcopy(tokenizer)
    prepare_tokenizer(tokenizer)
    spec = recipe.dataset if train_dataset is None else "train_dataset"
    examples, eval_examples = _examples(recipe, tokenizer, train_dataset, spec, is_main)

    if model is None:
        with model_key(recipe.model):
            model = load_model(recipe.model, dtype_of(recipe.torch_dtype), recipe.seed, False,
                               quantization_config(quant), distributed)[0]
    else:
        model = copy.deepcopy(model)  # get_peft_model injects layers in place; the caller's model stays untouched
    drop_gguf_marker(model)  # a GGUF model the caller loaded with plain transformers still carries it
    # a quantized base: as the recipe says, never repacked; PEFT's kbit prep
    model = prepare_for_training(model, quant, recipe.gradient_checkpointing)
    prepare_tokenizer(tokenizer, model)
    align_special_tokens(model, tokenizer)
    if plan is None:
        plan = plan_run(recipe, model)
    if resume:
        rundir.check_checkpoint_matches(resume, plan.peft_config)
    if recipe.push_to_hub:
        hub.require_token()
        hub.check_repo_id(recipe.hub_model_id)

    set_seed(recipe.seed)  # same adapter init in a fresh and a resumed run
    # Training needs no KV cache, and with one transformers ignores packed position_ids (examples would leak).
    use_cache, model.config.use_cache = getattr(model.config, "use_cache", None), False
    if plan.tp_styles is None:
        peft_model = get_peft_model(model, plan.peft_config, prepared=True)
        # as PEFT saves it: a ZeRO-3 partition counts as its full size (a TP run's pieces: ShardedAdapter.numel)
        sharded, numel = None, lambda name, param: getattr(param, "ds_numel", param.numel())
    else:
        with global_adapter_shapes(model):
            peft_model = get_peft_model(model, plan.peft_config, prepared=True)
        # each rank keeps its blocks (tp_runtime/dispatch.py)
        sharded = shard_adapters(peft_model, dict(plan.tp_styles), plan.targets)
        numel = sharded.numel
    trainable = sum(numel(name, p) for name, p in peft_model.named_parameters() if p.requires_grad)

    if is_main:
        rundir.remove_stale_staging(output_dir)
        if recipe.resume_from_checkpoint is False:
            rundir.start_over(output_dir)
        if resume:
            rundir.report_changed_keys(resume, output_dir, recipe_yaml)
    if recipe.objective == "grpo":  # TRL's GRPOTrainer: prompts, rewards, rollouts (train/grpo.py)
        trainer = grpo_trainer(recipe, peft_model, args, examples, eval_examples, tokenizer, output_dir)
    else:
        trainer = make_trainer_class(tensor_parallel=sharded is not None)(
            **({} if sharded is None else {"sharded_adapter": sharded}),
            model=peft_model,
            args=args,
            train_dataset=examples,
            eval_dataset=eval_examples,
            data_collator=collator(tokenizer, recipe.packing),
            processing_class=tokenizer,
        )
    trainer.recipe_yaml = recipe_yaml
    if not hf_logging.is_progress_bar_enabled():  # e.g. `bdlora compare --quiet`: no bar, no log dicts
        trainer.remove_callback(ProgressCallback)
    check_parallelism(trainer, launch)
    # after the Trainer exists: it builds the optimizer's param groups (bd_lr_ratio resolved, "auto" -> nblocks)
    apply_lr_ratios(trainer, *plan.lr_ratios)
    return _Run(recipe, recipe_yaml, output_dir, resume, args, trainer, plan, quant, trainable, spec, use_cache,
                is_main)


def _examples(recipe: Recipe, tokenizer, train_dataset, spec: str, is_main: bool):
    """(train examples, eval examples or None), tokenized, with what truncation did said out loud."""
    if train_dataset is None:
        rows = load_rows(DataSpec.train_of(recipe))
    else:
        rows = to_canonical(train_dataset, detect_format(train_dataset, recipe.dataset_format, spec), spec)
        if recipe.max_train_samples is not None:  # the same cap load_rows applies to a recipe's own dataset
            rows = rows.select(range(min(recipe.max_train_samples, len(rows))))
        check_rows(rows, spec)
    eval_rows = None
    if recipe.eval_fraction:
        rows, eval_rows = split_eval(rows, recipe.eval_fraction)
    elif recipe.eval_dataset:
        eval_rows = load_rows(DataSpec.eval_of(recipe))
    if recipe.objective == "grpo":  # prompts: the completions are generated, the rows' are the rewards' reference
        return rows, eval_rows
    examples, stats = tokenize(rows, tokenizer, recipe.max_seq_length, spec, recipe.max_dropped_fraction)
    if is_main and (stats.truncated or stats.dropped):
        print(f"bdlora train: {stats.summary(spec, recipe.max_seq_length)}", file=sys.stderr)
    eval_examples = None
    if eval_rows is not None:
        eval_examples = tokenize(eval_rows, tokenizer, recipe.max_seq_length, "eval data", 1.0)[0]
    return examples, eval_examples


def align_special_tokens(model, tokenizer) -> None:
    """The model's pad/bos/eos ids follow the tokenizer, as Trainer would do itself (with a log line per run)."""
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is None:
            continue
        for config in (model.config, getattr(model, "generation_config", None)):
            if config is not None and getattr(config, name, None) != value:
                setattr(config, name, value)


@contextlib.contextmanager
def model_key(spec: str):
    """A model spec that names no model, reported as the recipe key it came from (`model=`), not as a flag."""
    try:
        yield
    except ModelSpecError as err:
        text = str(err)
        for prefix in (f"--model {spec}: ", f"--model {spec} "):
            if text.startswith(prefix):
                text = f"recipe: model={spec}: " + text.removeprefix(prefix)
                break
        raise ModelSpecError(text) from None


def check_world_size(args) -> None:
    """A launcher started N processes; the Trainer must see all N in one group, not N independent trainings."""
    launched = launch_env.world_size()
    if launched != args.world_size:
        fix = (
            "on CPU set ACCELERATE_USE_CPU=true (or use_cpu=true) so the processes join one gloo group"
            if not _cuda()
            else "check the launcher's --nproc_per_node / --num_processes against the GPUs"
        )
        raise RecipeError(
            f"recipe: the launcher started WORLD_SIZE={launched} processes but the Trainer sees world size "
            f"{args.world_size}: each would train alone into the same output_dir; {fix}"
        )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _fit(run: _Run) -> tuple[object, float, dict]:
    """trainer.train (resuming if a checkpoint was found); (TrainOutput, wall seconds, state at resume)."""
    with scoped_env(wandb_env(run.args.report_to, run.recipe.wandb_project, run.output_dir, run.is_main)):
        start_peak_memory()
        state_before = {}
        if run.resume:  # read now: checkpoint rotation may delete the dir during training
            state_before = json.loads((Path(run.resume) / "trainer_state.json").read_text())
            # first of the callbacks: its line comes before the progress bar's, not after the bar's first frame
            run.trainer.callback_handler.callbacks.insert(0, resume_notice(run.resume, state_before.get("max_steps")))
        start = time.perf_counter()
        rollouts = getattr(run.trainer, "rollout_func", None)  # GRPO with rollout_server (train/grpo.py)
        try:
            with float64_compute(run.recipe.torch_dtype == "float64"):
                output = run.trainer.train(resume_from_checkpoint=run.resume)
                wall = time.perf_counter() - start
                if run.trainer.eval_dataset is not None:
                    run.trainer.state.log_history.append(run.trainer.evaluate())
        except RolloutError:
            keep_last_step(run.trainer)  # the same command resumes from the last completed step
            raise
        finally:
            if rollouts is not None:
                rollouts.close()
        if "wandb" in run.args.report_to:
            import wandb

            if wandb.run is not None:
                wandb.finish()
    return output, wall, state_before


def _finalize(run: _Run, output, wall: float, state_before: dict) -> TrainResult:
    """Save the adapter (all ranks), then on the main rank: model card, metrics.json, recipe.yaml, optional push."""
    recipe, trainer, output_dir = run.recipe, run.trainer, run.output_dir
    peak_mb, peak_kind = peak_memory()
    tokens = trainer.state.num_input_tokens_seen - state_before.get("num_input_tokens_seen", 0)  # TP: trainer.py
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


def _run_metrics(run: _Run, output, wall, state_before, tokens, peak_mb, peak_kind, adapter_dir) -> dict:
    recipe, trainer = run.recipe, run.trainer
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    return {
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
        "seed": recipe.seed,
        "device": str(run.args.device),
        "adapter_dir": str(adapter_dir),
        **(grpo_metrics(recipe, trainer) if recipe.objective == "grpo" else {}),
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
