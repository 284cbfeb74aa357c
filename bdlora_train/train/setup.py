"""A run's setup, in the order a failure costs least: the checks, the training arguments, the tokenizer and the
data, the base model, the PEFT model, then the objective's trainer (objectives/). Every input error is raised before
the weights load where the model is not needed to see it.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path

from bdlora_train import hub
from bdlora_train.core import launch_env
from bdlora_train.core.dtypes import dtype_of
from bdlora_train.core.errors import ModelSpecError, RecipeError
from bdlora_train.data.formats import detect_format, to_canonical
from bdlora_train.data.rows import DataSpec, check_rows, load_rows, split_eval
from bdlora_train.data.tokenize import prepare_tokenizer
from bdlora_train.launch.checks import check_parallelism, model_parallel_config
from bdlora_train.launch.deepspeed import check_deepspeed_dtype
from bdlora_train.models import load_model, load_tokenizer
from bdlora_train.models.embedded import drop_gguf_marker
from bdlora_train.objectives import objective_named
from bdlora_train.objectives.base import Objective, TrainerInputs
from bdlora_train.peft_integration.config import get_peft_model
from bdlora_train.quant.keys import QuantKeys
from bdlora_train.quant.quantized import prepare_for_training, quantization_config
from bdlora_train.recipe.schema import Recipe
from bdlora_train.tp_runtime.dispatch import global_adapter_shapes, shard_adapters
from bdlora_train.train import rundir
from bdlora_train.train.run_plan import RunPlan, check_model_parallel, plan_run
from bdlora_train.train.training_args import training_arguments
from bdlora_train.trainer.optim import apply_lr_ratios


@dataclass
class Run:
    """Everything setup produced and the training and the finalizing need."""

    recipe: Recipe
    recipe_yaml: str
    output_dir: Path
    resume: str | None
    args: object  # TrainingArguments (the objective's class)
    objective: Objective
    trainer: object
    plan: RunPlan
    quant: QuantKeys
    trainable: int
    spec: str
    use_cache: object
    is_main: bool


def setup(recipe: Recipe, recipe_yaml: str, output_dir: Path, model, tokenizer, train_dataset, launch) -> Run:
    """Check everything, read the data, then load the model and build the PEFT model and the objective's trainer."""
    from transformers import set_seed
    from transformers.trainer_callback import ProgressCallback
    from transformers.utils import logging as hf_logging

    objective = objective_named(recipe.objective)
    check_deepspeed_dtype(recipe.torch_dtype, bool(recipe.deepspeed or launch["deepspeed"]))
    resume = rundir.resolve_resume(recipe.resume_from_checkpoint, output_dir)
    distributed = model_parallel_config(recipe)  # tp_size / fsdp_size: transformers shards the base at load
    quant = recipe.quant_keys  # QLoRA keys, if any: the load, the kbit prep and the adapter's side file read them
    plan = None
    if distributed is not None:  # every check TP needs, on the meta-device model, before any process group or weight
        if model is not None:
            raise RecipeError("train(): with tp_size / fsdp_size the base is loaded sharded by the run; pass no model")
        plan = check_model_parallel(recipe)  # the run's plan, made once on the meta-device model and reused below
    args = training_arguments(recipe, objective, output_dir, distributed)
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
    rows, eval_rows = read_rows(recipe, train_dataset, spec)
    examples, eval_examples = objective.examples(recipe, rows, eval_rows, tokenizer, spec, is_main)

    model = base_model(recipe, model, quant, distributed)
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
    peft_model, sharded, trainable = adapt(model, plan)

    if is_main:
        rundir.remove_stale_staging(output_dir)
        if recipe.resume_from_checkpoint is False:
            rundir.start_over(output_dir)
        if resume:
            rundir.report_changed_keys(resume, output_dir, recipe_yaml)
    trainer = objective.make_trainer(
        TrainerInputs(recipe, peft_model, args, examples, eval_examples, tokenizer, output_dir, sharded)
    )
    trainer.recipe_yaml = recipe_yaml
    if not hf_logging.is_progress_bar_enabled():  # e.g. `bdlora compare --quiet`: no bar, no log dicts
        trainer.remove_callback(ProgressCallback)
    check_parallelism(trainer, launch)
    # after the Trainer exists: it builds the optimizer's param groups (bd_lr_ratio resolved, "auto" -> nblocks)
    apply_lr_ratios(trainer, *plan.lr_ratios)
    return Run(recipe, recipe_yaml, output_dir, resume, args, objective, trainer, plan, quant, trainable, spec,
               use_cache, is_main)


def read_rows(recipe: Recipe, train_dataset, spec: str):
    """(train rows, eval rows or None) in canonical form, checked: the recipe's dataset, or rows a caller passed."""
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
    return rows, eval_rows


def base_model(recipe: Recipe, model, quant: QuantKeys, distributed):
    """The base to adapt: loaded as the recipe says (sharded by `distributed`, quantized by `quant`), or a deep copy
    of the caller's (get_peft_model injects layers in place; the caller's model stays untouched); then PEFT's kbit
    preparation of a quantized base, never repacked."""
    if model is None:
        with model_key(recipe.model):
            model = load_model(recipe.model, dtype_of(recipe.torch_dtype), recipe.seed, False,
                               quantization_config(quant), distributed)[0]
    else:
        model = copy.deepcopy(model)
    drop_gguf_marker(model)  # a GGUF model the caller loaded with plain transformers still carries it
    return prepare_for_training(model, quant, recipe.gradient_checkpointing)


def adapt(model, plan: RunPlan):
    """(PeftModel, a TP run's ShardedAdapter or None, trainable parameter count) for the plan's config."""
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
    return peft_model, sharded, trainable


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
