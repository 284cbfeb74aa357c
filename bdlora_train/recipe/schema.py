"""The training recipe: one dataclass whose fields are the YAML keys, with their ranges and validation.

A recipe YAML maps 1:1 onto `Recipe`; `key=value` arguments override it. Every field carries its help text in
its metadata, and docs/training.md's key table is generated from it (a test keeps the two equal).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

import yaml

from bdlora_train.core.degrees import check_rank
from bdlora_train.core.dtypes import DTYPES
from bdlora_train.core.errors import RecipeError
from bdlora_train.core.roles import DEFAULT_TARGET_MODULES
from bdlora_train.objectives import DEFAULT as DEFAULT_OBJECTIVE
from bdlora_train.objectives import NAMES as OBJECTIVES
from bdlora_train.objectives import objective_named
from bdlora_train.quant.keys import QUANT_TYPES, QuantKeys
from bdlora_train.recipe.methods import BD_METHODS, check_method_keys
from bdlora_train.recipe.parallel_keys import check_parallel_keys

METHODS = ("bdlora", "lora", "peft-bdlora")


def key(default, help: str, *, low=None, high=None, high_open: bool = False, choices=None):
    """A recipe field: its default, the help text `bdlora train --help` and the docs show, and its valid range.

    `low`/`high` bound numbers (inclusive; `high_open` excludes `high`), `choices` lists the allowed values;
    `Recipe.validate` checks them all, so a fraction like warmup_ratio=1.0 fails instead of meaning "1 step".
    """
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help})
    bounds = dict(low=low, high=high, high_open=high_open, choices=choices)
    return dataclasses.field(default=default, metadata={"help": help, **bounds})


@dataclass
class Recipe:
    """Everything one training run needs. YAML keys and `key=value` overrides map 1:1 onto these fields."""

    # --- base model and adapter ---
    model: str = key("embedded", "models.load_model spec: embedded | tiny:<type> | local dir | Hub id")
    torch_dtype: str = key(
        "float32", "dtype of the frozen base weights (and of the adapter on float64: exactness checks)", choices=DTYPES
    )
    method: str = key(
        "bdlora", "bdlora | lora | peft-bdlora (stock PEFT's BD-LoRA layer and init, same roles)", choices=METHODS
    )
    lora_r: int | None = key(
        24, "LoRA rank r (for bdlora: a multiple of nblocks); null with match_budget_of_lora_rank, which sets it", low=1
    )
    lora_alpha: float | None = key(
        16,
        "LoRA alpha; scaling = alpha / r (alpha / sqrt(r) with use_rslora); > 0; with lora_alpha_ratio it is "
        "ratio * r (null until budget matching gives r)",
        low=1e-12,
    )
    lora_alpha_ratio: float | None = key(
        None, "if set, lora_alpha = ratio * r (after budget matching), e.g. 2 for alpha = 2r", low=1e-12
    )
    lora_dropout: float = key(0.0, "dropout on the adapter input, in [0, 1)", low=0, high=1, high_open=True)
    use_rslora: bool = key(False, "rank-stabilized scaling alpha / sqrt(r)")
    lora_target_modules: list[str] | None = key(None, "default: q,k,v,o,gate,up,down projections")
    nblocks: int | None = key(
        None,
        "BD-LoRA blocks = the TP degree the adapter is served at; null: the largest of 8, 6, 4, 3, 2, 1 that "
        "divides the heads and KV heads",
    )
    match_budget_of_lora_rank: int | None = key(
        None, "BD-LoRA rank = largest with <= the params of LoRA at this rank", low=1
    )
    bd_a_init: str = key("peft", "init of block-diagonal A factors", choices=("peft", "lora"))
    bd_lr_ratio: float | str = key(
        "auto",
        "learning-rate multiplier for the block-diagonal factor; auto: nblocks (its fan-in is 1/nblocks of the dense "
        "factor's); 1: stock PEFT's single rate; BD methods only (LoRA ignores auto); docs/compare.md",
        low=1e-12,
    )
    loraplus_lr_ratio: float = key(
        1.0, "LoRA+: lora_B's learning rate = ratio x learning_rate (Hayou et al. 2024); method=lora only", low=1e-12
    )
    # --- quantized base (QLoRA; docs/quantization.md) ---
    load_in_4bit: bool = key(False, "load the base 4-bit with bitsandbytes (QLoRA); adapters stay float")
    bnb_4bit_quant_type: str = key("nf4", "4-bit data type", choices=QUANT_TYPES)
    bnb_4bit_compute_dtype: str | None = key(None, "dtype the 4-bit matmuls run in; null: torch_dtype")
    bnb_4bit_use_double_quant: bool = key(False, "also quantize the 4-bit block scales (QLoRA's double quantization)")
    load_in_8bit: bool = key(False, "load the base 8-bit with bitsandbytes (LLM.int8)")
    torchao_int8: bool = key(False, "load the base with torchao int8 weight-only quantization (Int8WeightOnlyConfig)")
    objective: str = key(
        DEFAULT_OBJECTIVE,
        "sft: learn the completions (loss on completion tokens) | grpo: reinforcement learning with verifiable "
        "rewards (TRL's GRPOTrainer; GRPOConfig keys pass through; docs/rl.md)",
        choices=OBJECTIVES,
    )
    # --- data ---
    dataset: str = key(
        "task:analogies",
        "task:<name> | glue:<task> | packaged:<file> | local .jsonl/.json/.csv/.parquet | save_to_disk dir | Hub name",
    )
    dataset_format: str = key(
        "auto",
        "auto (from the columns) | prompt-completion | messages | text | alpaca | sharegpt",
        choices=("auto", "prompt-completion", "messages", "text", "alpaca", "sharegpt"),
    )
    dataset_config: str | None = key(None, "Hub dataset config name")
    dataset_split: str = key("train", "split of a Hub dataset")
    prompt_template: str | None = key(None, "str.format over a row, for datasets without prompt/completion columns")
    completion_template: str | None = key(None, "str.format over a row: the completion (learned) text")
    max_train_samples: int | None = key(None, "use at most this many training rows", low=1)
    max_seq_length: int = key(512, "tokens per example; longer rows are truncated", low=1)
    max_dropped_fraction: float = key(
        0.05,
        "fail when more than this fraction of rows has no completion token left after truncation",
        low=0,
        high=1,
    )
    eval_dataset: str | None = key(None, "evaluation data (same forms as dataset); eval loss goes to metrics.json")
    eval_fraction: float | None = key(
        None,
        "carve this fraction of the training rows out as evaluation data (deterministic)",
        low=1e-9,
        high=1,
        high_open=True,
    )
    packing: bool = key(False, "padding-free: each batch is one row, position_ids restart per example")
    # --- reinforcement learning (objective: grpo; docs/rl.md) ---
    rewards: list = key(
        [],
        "objective=grpo: reward functions, each a built-in (exact_match) or module:function (TRL's signature), or "
        "{name: ..., weight: ...}; empty: the task's exact_match (task:arithmetic, task:analogies)",
    )
    rollout_server: str | None = key(
        None,
        "objective=grpo: URL of a running `vllm serve` (--enable-lora, the plugin) that generates the rollouts, the "
        "adapter synced to it after every step; null: the trainer generates",
    )
    rollout_max_logprob_diff: float = key(
        1e-3,
        "objective=grpo with rollout_server: refuse a step whose server log-probs differ from the trainer's by more "
        "(nats; a stale or failed sync); 1e-3 fits float32 on both sides",
        low=1e-12,
    )
    # --- optimization (transformers.TrainingArguments names) ---
    output_dir: str = key("runs/bdlora", "run directory: checkpoints, adapter/, metrics.json, recipe.yaml")
    seed: int = key(42, "seed of adapter init and data order")
    max_steps: int = key(-1, "optimizer steps; -1: train num_train_epochs", low=-1)
    num_train_epochs: float = key(1.0, "epochs when max_steps is -1", low=0)
    per_device_train_batch_size: int = key(8, "examples per device per step", low=1)
    gradient_accumulation_steps: int = key(1, "micro-batches per optimizer step", low=1)
    learning_rate: float = key(2e-4, "peak learning rate; > 0", low=1e-30)
    lr_scheduler_type: str = key("linear", "transformers scheduler name: linear | cosine | constant | ...")
    warmup_ratio: float = key(0.0, "fraction of steps spent warming up, in [0, 1)", low=0, high=1, high_open=True)
    warmup_steps: int = key(0, "warm-up steps; wins over warmup_ratio when > 0", low=0)
    weight_decay: float = key(0.0, "AdamW weight decay", low=0)
    max_grad_norm: float = key(1.0, "gradient clipping norm", low=0)
    optim: str = key("adamw_torch", "transformers optimizer name")
    bf16: bool = key(False, "mixed precision (GPU)")
    fp16: bool = key(False, "mixed precision fp16 (GPU)")
    gradient_checkpointing: bool = key(False, "recompute activations in backward (non-reentrant)")
    # --- checkpoints and logging ---
    logging_steps: int = key(10, "log the loss every N steps", low=1)
    save_steps: int = key(100, "checkpoint every N steps; 0: no intermediate checkpoints", low=0)
    save_total_limit: int | None = key(2, "keep at most N complete checkpoints", low=1)
    resume_from_checkpoint: bool | str | None = key(
        None, "None: resume if a complete checkpoint exists; false: start over"
    )
    report_to: str = key("none", "none | wandb | tensorboard | comma-separated list")
    run_name: str | None = key(None, "run name for loggers (default: the output_dir name)")
    wandb_project: str = key("bdlora-train", "wandb project when report_to includes wandb")
    # --- distributed ---
    use_cpu: bool = key(False, "force CPU (also ACCELERATE_USE_CPU=true); gloo backend under torchrun")
    cpu_threads: int | None = key(
        None, "torch.set_num_threads for this run (restored after); tiny models run fastest on 1", low=1
    )
    deepspeed: str | None = key(None, "DeepSpeed JSON, for torchrun launches (accelerate launch passes it itself)")
    fsdp: str = key("", 'e.g. "full_shard auto_wrap", for torchrun launches')
    fsdp_config: dict | None = key(None, "transformers fsdp_config mapping")
    ddp_backend: str | None = key(None, "nccl | gloo | ...; default: what accelerate picks for the device")
    tp_size: int = key(
        1,
        "tensor-parallel degree (transformers DistributedConfig): each rank holds only its adapter blocks; launch "
        "tp_size x fsdp_size x dp_replicate_size processes with torchrun; nblocks defaults to it",
        low=1,
    )
    fsdp_size: int = key(1, "FSDP2 degree next to tp_size (transformers DistributedConfig; data parallel)", low=1)
    dp_replicate_size: int = key(1, "HSDP replicas next to tp_size and fsdp_size (DistributedConfig)", low=1)
    ep_size: int = key(
        1,
        "expert-parallel degree of a MoE base (DistributedConfig): each rank holds whole experts and their adapter; "
        "must be tp_size x fsdp_size (every expert on one rank)",
        low=1,
    )
    # --- Hub ---
    push_to_hub: bool = key(False, "upload adapter/ with its model card when training finishes")
    hub_model_id: str | None = key(None, "target repo, e.g. me/smollm2-bdlora")
    hub_private_repo: bool = key(False, "create the Hub repo as private")
    # --- any other transformers.TrainingArguments key ---
    training_args: dict = key(
        {},
        "other transformers.TrainingArguments keys (eval_strategy, eval_steps, lr_scheduler_kwargs, "
        "neftune_noise_alpha, torch_compile, dataloader_num_workers, ...), written at the top level of a recipe "
        "and type-checked against TrainingArguments",
    )

    def __post_init__(self):
        """Keys other keys decide hold the value the run uses, so --print-recipe and recipe.yaml show it: with
        match_budget_of_lora_rank the rank comes from the budget (lora_r null), with lora_alpha_ratio alpha is
        ratio * r (null while r waits for budget matching). `load_recipe` refuses a recipe that gives both."""
        if self.match_budget_of_lora_rank is not None:
            self.lora_r = None
        if self.lora_alpha_ratio is not None:
            self.lora_alpha = self.lora_alpha_ratio * self.lora_r if self.lora_r is not None else None

    def validate(self) -> "Recipe":
        """Cheap checks that need no model: fail in a second, not after loading 8B weights."""
        if self.lora_r is None and self.match_budget_of_lora_rank is None:
            raise RecipeError("recipe: lora_r is null; give a rank (or match_budget_of_lora_rank=R to match LoRA r=R)")
        if self.lora_alpha is None and self.lora_alpha_ratio is None:
            raise RecipeError("recipe: lora_alpha is null; give a number > 0 (or lora_alpha_ratio, e.g. 2 for 2r)")
        for f in dataclasses.fields(self):
            _check_bounds(f, getattr(self, f.name))
        if self.max_steps == 0:
            raise RecipeError(
                "recipe: max_steps=0 trains nothing; use a positive step count, or -1 with num_train_epochs"
            )
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            raise RecipeError(
                f"recipe: num_train_epochs={self.num_train_epochs} with max_steps=-1 trains nothing; use > 0"
            )
        if self.nblocks is not None and self.nblocks < 1:
            raise RecipeError(f"recipe: nblocks={self.nblocks} must be >= 1 or null (auto)")
        keys = self.quant_keys
        check_parallel_keys(self, keys)
        # under TP the run's plan checks nblocks and lora_r after tp_size meets the model's heads (run_plan.py), so
        # no refusal suggests a value another rule refuses
        bd_rank = self.method in BD_METHODS and self.nblocks and not self.match_budget_of_lora_rank
        if bd_rank and not self.model_parallel:
            check_rank(self.lora_r, self.nblocks, "recipe", key="lora_r", error=RecipeError)
        if self.match_budget_of_lora_rank is not None and self.method not in BD_METHODS:
            raise RecipeError(
                "recipe: match_budget_of_lora_rank applies to method=bdlora only; drop it or set method=bdlora"
            )
        check_method_keys(self)
        self._check_objective_keys()
        if self.push_to_hub and not self.hub_model_id:
            raise RecipeError("recipe: push_to_hub=true needs hub_model_id (e.g. hub_model_id=me/smollm2-bdlora)")
        if self.bf16 and self.fp16:
            raise RecipeError("recipe: bf16 and fp16 are both true; pick one")
        if self.eval_dataset and self.eval_fraction:
            raise RecipeError("recipe: eval_dataset and eval_fraction are both set; pick one source of evaluation data")
        strategy = str(self.training_args.get("eval_strategy", "no"))
        if strategy != "no" and not (self.eval_dataset or self.eval_fraction):
            raise RecipeError(
                f"recipe: eval_strategy={strategy} needs evaluation data; set eval_dataset=<spec> or eval_fraction=0.05"
            )
        if strategy == "no" and self.training_args.get("eval_steps") is not None:
            raise RecipeError(
                f"recipe: eval_steps={self.training_args['eval_steps']:g} without eval_strategy does nothing "
                "(transformers evaluates only with eval_strategy=steps); add eval_strategy=steps"
            )
        for logger in self.loggers:
            if logger not in LOGGERS:
                raise RecipeError(f"recipe: report_to={self.report_to!r}: unknown logger '{logger}'; use {LOGGERS}")
            if logger != "none" and not any(importlib.util.find_spec(m) for m in LOGGERS[logger]):
                raise RecipeError(
                    f"recipe: report_to={logger} but {LOGGERS[logger][0]} is not installed; "
                    f"pip install {LOGGERS[logger][0]}, or report_to=none"
                )
        keys.check()
        if keys.kind and (self.deepspeed or self.fsdp):
            raise RecipeError(
                f"recipe: {keys.switches_on[0]}=true with deepspeed/fsdp is not supported (a quantized base is trained "
                "on one device per process); drop deepspeed/fsdp, or train an unquantized base with them"
            )
        return self

    def _check_objective_keys(self) -> None:
        """Another objective's keys refused, then the objective's own checks (objectives/)."""
        for name in OBJECTIVES:
            if name != self.objective:
                given = [k for k in objective_named(name).recipe_keys if getattr(self, k)]
                if given:
                    raise RecipeError(
                        f"recipe: {given[0]} applies to objective={name} only; add objective={name} or drop it"
                    )
        objective_named(self.objective).check_recipe(self)

    @property
    def model_parallel(self) -> bool:
        """Whether transformers shards the base at load (`DistributedConfig`: tp_size and / or ep_size, with
        fsdp_size and dp_replicate_size for the data-parallel dimensions next to them)."""
        return self.tp_size > 1 or self.ep_size > 1

    @property
    def quant_keys(self) -> QuantKeys:
        """How the base is quantized (load_in_4bit, ...): all off for a float base."""
        return QuantKeys(**{f.name: getattr(self, f.name) for f in dataclasses.fields(QuantKeys)})

    @property
    def loggers(self) -> list[str]:
        return [r.strip() for r in self.report_to.split(",") if r.strip()] or ["none"]

    @property
    def targets(self) -> list[str]:
        return list(self.lora_target_modules or DEFAULT_TARGET_MODULES)

    def to_yaml(self) -> str:
        """The recipe as the YAML a user would write: TrainingArguments pass-through keys at the top level."""
        data = dataclasses.asdict(self)
        data.update(data.pop("training_args"))
        return yaml.safe_dump(data, sort_keys=False)


# report_to value -> importable packages that provide it
LOGGERS = {
    "none": (),
    "wandb": ("wandb",),
    "tensorboard": ("tensorboard", "tensorboardX"),
    "mlflow": ("mlflow",),
    "trackio": ("trackio",),
    "comet_ml": ("comet_ml",),
    "clearml": ("clearml",),
}
def _check_bounds(f: dataclasses.Field, value) -> None:
    meta = f.metadata
    if value is None or isinstance(value, bool):
        return
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise RecipeError(f"recipe: {f.name}={value!r}; use one of {list(meta['choices'])}")
    if not isinstance(value, (int, float)):
        return
    low, high = meta.get("low"), meta.get("high")
    too_low = low is not None and value < low
    too_high = high is not None and (value >= high if meta.get("high_open") else value > high)
    if too_low or too_high:
        if low is not None and high is not None:
            span = f"in [{low:g}, {high:g}{')' if meta.get('high_open') else ']'}"
        elif low is not None:
            span = "> 0" if 0 < low < 1e-6 else f">= {low:g}"
        else:
            span = f"<= {high:g}"
        raise RecipeError(f"recipe: {f.name}={value!r} must be {span} ({meta['help'].split(';')[0]})")
