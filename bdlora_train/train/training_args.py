"""transformers' TrainingArguments from a recipe: every recipe key mapped onto its TrainingArguments key, the launch
settings (DeepSpeed, FSDP, a base sharded at load) included, then the recipe's own `training_args`."""

from __future__ import annotations

from pathlib import Path

from bdlora_train.core.errors import RecipeError, first_line
from bdlora_train.launch.deepspeed import cpu_deepspeed_state, deepspeed_config
from bdlora_train.launch.env import env_flag, without_env


def _checkpointing_kwargs(recipe) -> dict | None:
    """torch.utils.checkpoint's keywords: non-reentrant; a float64 run's recomputation computes in float64 too."""
    if not recipe.gradient_checkpointing:
        return None
    if recipe.torch_dtype == "float64":
        from bdlora_train.models.float64 import recompute_contexts

        return {"use_reentrant": False, "context_fn": recompute_contexts}
    return {"use_reentrant": False}


def training_arguments(recipe, objective, output_dir: Path, distributed):
    """The objective's TrainingArguments class (transformers', or a subclass such as TRL's GRPOConfig) from the
    recipe, for a base sharded at load by `distributed` (`model_parallel_config`) or not. Built before the model
    loads, so ZeRO-3 can shard it at load."""
    import torch
    from transformers import TrainingArguments

    config, owner = objective.config_class()

    ckpt_key = (
        "activation_checkpointing"
        if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
        else "gradient_checkpointing"
    )
    ds_config = deepspeed_config(recipe.deepspeed)
    accelerator_config = cpu_deepspeed_state() if ds_config or env_flag("ACCELERATE_USE_DEEPSPEED") else None
    kwargs = dict(
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
            f"{ckpt_key}_kwargs": _checkpointing_kwargs(recipe),
        },
        logging_steps=recipe.logging_steps,
        save_strategy="steps" if recipe.save_steps > 0 else "no",
        save_steps=recipe.save_steps or 500,
        save_total_limit=recipe.save_total_limit,
        report_to=recipe.loggers,
        run_name=recipe.run_name or output_dir.name,
        # a base sharded by transformers on a CPU machine: its ranks join one gloo group (no ACCELERATE_USE_CPU needed)
        use_cpu=recipe.use_cpu or (distributed is not None and not torch.cuda.is_available()),
        deepspeed=ds_config,
        accelerator_config=accelerator_config,
        fsdp=recipe.fsdp,
        fsdp_config=recipe.fsdp_config,
        ddp_backend=recipe.ddp_backend,
        remove_unused_columns=False,
        dataloader_pin_memory=torch.cuda.is_available(),
        ddp_find_unused_parameters=False,  # every adapter parameter is used in every forward
        include_num_input_tokens_seen=objective.tokens_seen(recipe),
        push_to_hub=False,  # we push the adapter dir with our own card (hub.py), not Trainer's
        per_device_eval_batch_size=recipe.per_device_train_batch_size,
    )
    if distributed is not None:
        # transformers' Trainer does not checkpoint the optimizer of a model sharded at load (`DistributedConfig`);
        # the toolkit's trainer does, gathered (trainer/mixins.py), so Trainer is told to save the model only.
        kwargs["save_only_model"] = True
    kwargs.update(recipe.training_args)  # any other TrainingArguments key, type-checked by load_recipe
    try:
        with without_env("WANDB_MODE"):  # transformers' integrations print "Running in WANDB offline mode" to stdout
            return config(**kwargs)
    except (ValueError, TypeError) as err:  # the config's own consistency checks (eval_steps, num_generations, ...)
        raise RecipeError(f"recipe: {owner} refused the training arguments ({first_line(err)})") from None
