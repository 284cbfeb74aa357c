"""`train(recipe)`: one training run, read top to bottom as setup -> fit -> finalize.

Output in `output_dir`:
  checkpoint-<step>/   complete checkpoints only (trainer.py stages and renames them); re-running resumes
  adapter/             the final adapter in stock PEFT format, with a model card (README.md)
  metrics.json         method, rank, trainable params, tokens/s, peak memory, final loss, wall time, world size
  recipe.yaml          the resolved recipe
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from bdlora_train.errors import RecipeError
from bdlora_train.files import atomic_write_text, replace_dir
from bdlora_train.train import data as data_mod
from bdlora_train.train.launch import (
    check_parallelism,
    cpu_deepspeed_state,
    deepspeed_config,
    env_flag,
    parallelism,
    report_to,
    scoped_env,
    scoped_launch_env,
    wandb_env,
)
from bdlora_train.train.methods import BD_METHODS, peft_bdlora_config
from bdlora_train.train.optim import apply_bd_lr_ratio
from bdlora_train.train.recipe import Recipe, dtype
from bdlora_train.train.trainer import (
    STAGING_PREFIX,
    complete_checkpoints,
    last_checkpoint,
    make_trainer_class,
    save_adapter,
)


@dataclass
class TrainResult:
    model: object  # the trained PeftModel
    metrics: dict
    adapter_dir: Path


def check_output_dir(output_dir: str) -> Path:
    """Create output_dir and prove it is writable, before any model is loaded."""
    root = Path(output_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f"{STAGING_PREFIX}write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink(missing_ok=True)
    except OSError as err:
        raise RecipeError(
            f"recipe: output_dir={output_dir} is not writable ({err.strerror}); choose another output_dir"
        ) from None
    return root


def build_peft_config(recipe: Recipe, model):
    """(PEFT config, info): BlockDiagLoraConfig or LoraConfig with the same targets/alpha/dropout/rslora."""
    from peft import LoraConfig

    from bdlora_train.budget import count_adapter_params, match_budget
    from bdlora_train.config import BlockDiagLoraConfig
    from bdlora_train.roles import default_nblocks

    targets = recipe.targets
    r = recipe.lora_r
    nblocks = recipe.nblocks or default_nblocks(model.config)
    info: dict = {"matched_lora_rank": None, "matched_lora_params": None}
    if recipe.method in BD_METHODS and recipe.match_budget_of_lora_rank is not None:
        r = match_budget(model, recipe.match_budget_of_lora_rank, nblocks, mode="below", target_modules=targets)
        info["matched_lora_rank"] = recipe.match_budget_of_lora_rank
        info["matched_lora_params"] = count_adapter_params(
            model, LoraConfig(r=recipe.match_budget_of_lora_rank, target_modules=targets)
        )
    alpha = recipe.lora_alpha_ratio * r if recipe.lora_alpha_ratio is not None else recipe.lora_alpha
    common = dict(
        r=r,
        lora_alpha=alpha,
        lora_dropout=recipe.lora_dropout,
        use_rslora=recipe.use_rslora,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    if recipe.method == "bdlora":
        config = BlockDiagLoraConfig(nblocks=nblocks, bd_a_init=recipe.bd_a_init, **common)
    elif recipe.method == "peft-bdlora":
        config = peft_bdlora_config(model, nblocks, common)
    else:
        config = LoraConfig(**common)
    bd = recipe.method in BD_METHODS
    info.update(r=r, lora_alpha=alpha, nblocks=nblocks if bd else 1, target_modules=targets)
    return config, info


def resolve_resume(recipe: Recipe, output_dir: Path) -> str | None:
    spec = recipe.resume_from_checkpoint
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


def report_changed_keys(previous: Path, recipe: Recipe) -> None:
    """Resuming with a different recipe is allowed (e.g. more steps) but said out loud."""
    if not previous.is_file():
        return
    before = yaml.safe_load(previous.read_text()) or {}
    now = dataclasses.asdict(recipe)
    changed = [
        f"{k} ({before[k]!r} -> {now[k]!r})"
        for k in now
        if k in before and before[k] != now[k] and k not in ("output_dir", "resume_from_checkpoint")
    ]
    if changed:
        print(f"bdlora train: resuming {previous.parent} with changed keys: {', '.join(changed)}", file=sys.stderr)


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


def training_arguments(recipe: Recipe, output_dir: Path):
    """transformers.TrainingArguments from the recipe. Built before the model loads, so ZeRO-3 can shard it at load."""
    import torch
    from transformers import TrainingArguments

    ckpt_key = (
        "activation_checkpointing"
        if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
        else "gradient_checkpointing"
    )
    ds_config = deepspeed_config(recipe.deepspeed)
    accelerator_config = cpu_deepspeed_state() if ds_config or env_flag("ACCELERATE_USE_DEEPSPEED") else None
    return TrainingArguments(
        output_dir=str(output_dir),
        seed=recipe.seed,
        data_seed=recipe.seed,
        max_steps=recipe.max_steps,
        num_train_epochs=recipe.num_train_epochs,
        per_device_train_batch_size=recipe.per_device_train_batch_size,
        gradient_accumulation_steps=recipe.gradient_accumulation_steps,
        learning_rate=recipe.learning_rate,
        lr_scheduler_type=recipe.lr_scheduler_type,
        warmup_steps=recipe.warmup_steps if recipe.warmup_steps > 0 else recipe.warmup_ratio,
        weight_decay=recipe.weight_decay,
        max_grad_norm=recipe.max_grad_norm,
        optim=recipe.optim,
        bf16=recipe.bf16,
        fp16=recipe.fp16,
        **{
            ckpt_key: recipe.gradient_checkpointing,
            f"{ckpt_key}_kwargs": {"use_reentrant": False} if recipe.gradient_checkpointing else None,
        },
        logging_steps=recipe.logging_steps,
        save_strategy="steps" if recipe.save_steps > 0 else "no",
        save_steps=recipe.save_steps or 500,
        save_total_limit=recipe.save_total_limit,
        report_to=report_to(recipe),
        run_name=recipe.run_name or output_dir.name,
        use_cpu=recipe.use_cpu,
        deepspeed=ds_config,
        accelerator_config=accelerator_config,
        fsdp=recipe.fsdp,
        fsdp_config=recipe.fsdp_config,
        ddp_backend=recipe.ddp_backend,
        remove_unused_columns=False,
        dataloader_pin_memory=torch.cuda.is_available(),
        ddp_find_unused_parameters=False,  # every adapter parameter is used in every forward
        include_num_input_tokens_seen="all" if recipe.packing else "non_padding",
        push_to_hub=False,  # we push the adapter dir with our own card (hub.py), not Trainer's
    )


def train(recipe: Recipe, model=None, tokenizer=None, train_dataset=None) -> TrainResult:
    """Train one adapter as the recipe says; returns the PeftModel, the metrics and the adapter dir.

    `model`/`tokenizer`/`train_dataset` let a caller (the compare sweep) load the base model once: the model
    is deep-copied, so the caller's stays clean across calls. `train_dataset` has prompt/completion or
    messages columns. All input errors are raised before training starts.
    """
    with scoped_launch_env(recipe.cpu_threads) as launch:
        run = _setup(recipe, model, tokenizer, train_dataset, launch)
        output, wall, state_before = _fit(run)
        return _finalize(run, output, wall, state_before)


@dataclass
class _Run:
    """Everything setup produced and fit / finalize need."""

    recipe: Recipe
    output_dir: Path
    resume: str | None
    args: object  # TrainingArguments
    trainer: object
    info: dict
    trainable: int
    spec: str
    use_cache: object
    is_main: bool


def _setup(recipe: Recipe, model, tokenizer, train_dataset, launch: dict) -> _Run:
    """Validate, load the model and data, build the PEFT model and the Trainer; nothing trains yet."""
    from transformers import set_seed

    from bdlora_train.config import get_peft_model
    from bdlora_train.models import drop_gguf_marker, load_model, tiny_tokenizer

    recipe.validate()
    output_dir = check_output_dir(recipe.output_dir)
    resume = resolve_resume(recipe, output_dir)
    args = training_arguments(recipe, output_dir)

    if model is None:
        model, loaded_tokenizer = load_model(recipe.model, dtype=dtype(recipe.torch_dtype), seed=recipe.seed)
        tokenizer = tokenizer or loaded_tokenizer
    else:
        model = copy.deepcopy(model)  # get_peft_model injects layers in place; the caller's model stays untouched
    drop_gguf_marker(model)  # a GGUF model the caller loaded with plain transformers still carries it
    if tokenizer is None and recipe.model.startswith("tiny:"):
        tokenizer = tiny_tokenizer()
    else:
        tokenizer = copy.deepcopy(tokenizer)  # pad token may be set below
    data_mod.prepare_tokenizer(tokenizer, model)

    spec = recipe.dataset if train_dataset is None else "train_dataset"
    rows = train_dataset
    if rows is None:
        rows = data_mod.load_rows(
            recipe.dataset,
            recipe.seed,
            recipe.dataset_config,
            recipe.dataset_split,
            recipe.prompt_template,
            recipe.completion_template,
            recipe.max_train_samples,
        )
    examples = data_mod.tokenize(rows, tokenizer, recipe.max_seq_length, spec)

    peft_config, info = build_peft_config(recipe, model)
    if recipe.push_to_hub:
        from bdlora_train import hub

        hub.require_token()

    set_seed(recipe.seed)  # same adapter init in a fresh and a resumed run
    # Training needs no KV cache, and with one transformers ignores packed position_ids (examples would leak).
    use_cache, model.config.use_cache = getattr(model.config, "use_cache", None), False
    peft_model = get_peft_model(model, peft_config)
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in peft_model.parameters() if p.requires_grad)

    is_main = args.process_index == 0
    if is_main:
        for stale in output_dir.glob(f"{STAGING_PREFIX}*"):  # leftovers of a killed run; never resumed from
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        if recipe.resume_from_checkpoint is False:  # starting over: an old, later checkpoint must not be resumed later
            for old in complete_checkpoints(output_dir):
                shutil.rmtree(old)
        if resume:
            report_changed_keys(output_dir / "recipe.yaml", recipe)
        atomic_write_text(output_dir / "recipe.yaml", yaml.safe_dump(dataclasses.asdict(recipe), sort_keys=False))

    trainer = make_trainer_class()(
        model=peft_model,
        args=args,
        train_dataset=examples,
        data_collator=data_mod.collator(tokenizer, recipe.packing),
        processing_class=tokenizer,
    )
    check_parallelism(recipe, trainer, launch)
    apply_bd_lr_ratio(trainer, recipe)
    return _Run(recipe, output_dir, resume, args, trainer, info, trainable, spec, use_cache, is_main)


def _fit(run: _Run) -> tuple[object, float, dict]:
    """trainer.train (resuming if a checkpoint was found); (TrainOutput, wall seconds, state at resume)."""
    with scoped_env(wandb_env(run.recipe, run.output_dir, run.is_main)):
        start_peak_memory()
        state_before = {}
        if run.resume:  # read now: checkpoint rotation may delete the dir during training
            state_before = json.loads((Path(run.resume) / "trainer_state.json").read_text())
        start = time.perf_counter()
        output = run.trainer.train(resume_from_checkpoint=run.resume)
        wall = time.perf_counter() - start
        if "wandb" in report_to(run.recipe):
            import wandb

            if wandb.run is not None:
                wandb.finish()
    return output, wall, state_before


def _finalize(run: _Run, output, wall: float, state_before: dict) -> TrainResult:
    """Save the adapter (all ranks), then on the main rank: model card, metrics.json, optional push."""
    recipe, trainer, output_dir = run.recipe, run.trainer, run.output_dir
    peak_mb, peak_kind = peak_memory()
    tokens = trainer.state.num_input_tokens_seen - state_before.get("num_input_tokens_seen", 0)
    adapter_dir = output_dir / "adapter"
    staging = output_dir / f"{STAGING_PREFIX}adapter"
    if run.is_main and staging.exists():
        shutil.rmtree(staging)
    save_adapter(trainer, staging)
    if run.is_main:
        (staging / "training_args.bin").unlink(missing_ok=True)  # a pickle; the recipe.yaml next to it says the same
    trained = trainer.accelerator.unwrap_model(trainer.model)
    trained.get_base_model().config.use_cache = run.use_cache
    info = run.info
    metrics = {
        "method": recipe.method,
        "model": recipe.model,
        "dataset": run.spec,
        "r": info["r"],
        "lora_alpha": info["lora_alpha"],
        "nblocks": info["nblocks"],
        "target_modules": info["target_modules"],
        "matched_lora_rank": info["matched_lora_rank"],
        "matched_lora_params": info["matched_lora_params"],
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
        "world_size": run.args.world_size,
        "parallelism": parallelism(trainer),
        "seed": recipe.seed,
        "device": str(run.args.device),
        "adapter_dir": str(adapter_dir),
    }
    if run.is_main:
        from bdlora_train import hub

        hub.write_model_card(staging, metrics=metrics)
        replace_dir(staging, adapter_dir)
        atomic_write_text(output_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
        print(summary_line(metrics), flush=True)
        if recipe.push_to_hub:
            _push(recipe, adapter_dir, metrics, output_dir)
    trainer.accelerator.wait_for_everyone()
    return TrainResult(model=trained, metrics=metrics, adapter_dir=adapter_dir)


def _push(recipe: Recipe, adapter_dir: Path, metrics: dict, output_dir: Path) -> None:
    from bdlora_train import hub
    from bdlora_train.errors import HubError, first_line

    try:
        metrics["hub_url"] = hub.push_adapter(adapter_dir, recipe.hub_model_id, private=recipe.hub_private_repo)
    except Exception as err:  # network / permission errors of any type: the trained adapter is safe on disk
        raise HubError(
            f"push: training finished and the adapter is in {adapter_dir}, but the upload to {recipe.hub_model_id} "
            f"failed ({first_line(err)}); retry with `bdlora push {adapter_dir} --repo-id {recipe.hub_model_id}`"
        ) from None
    atomic_write_text(output_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    print(f"bdlora train: pushed {adapter_dir} -> {metrics['hub_url']}", flush=True)


def summary_line(m: dict) -> str:
    loss = f"{m['final_loss']:.4f}" if m["final_loss"] is not None else "n/a"
    shape = f"r={m['r']} nblocks={m['nblocks']}" if m["method"] in BD_METHODS else f"r={m['r']}"
    return (
        f"bdlora train: {m['method']} {shape} | {m['trainable_params']:,} trainable | step {m['steps']} | "
        f"{m['steps_this_run']} steps in {m['train_wall_time_s']:.1f} s | {m['tokens_per_second'] or 0:,.0f} "
        f"tok/s | peak {m['peak_memory_mb']:,.0f} MB | "
        f"final loss {loss} | world {m['world_size']} | adapter -> {m['adapter_dir']}"
    )
