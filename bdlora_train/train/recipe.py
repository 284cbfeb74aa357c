"""The training recipe: one dataclass whose fields are the YAML keys, parsing, type checks and validation.

A recipe YAML maps 1:1 onto `Recipe`; `key=value` arguments override it. Every field carries its help text in
its metadata, and docs/training.md's key table is generated from it (a test keeps the two equal).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from bdlora_train.errors import RecipeError, first_line
from bdlora_train.train.methods import BD_METHODS, check_method_keys

METHODS = ("bdlora", "lora", "peft-bdlora")
DTYPES = ("float32", "bfloat16", "float16")


def key(default, help: str):
    """A recipe field: its default and the help text `bdlora train --help` and the docs show."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass
class Recipe:
    """Everything one training run needs. YAML keys and `key=value` overrides map 1:1 onto these fields."""

    # --- base model and adapter ---
    model: str = key("embedded", "models.load_model spec: embedded | tiny:<type> | local dir | Hub id")
    torch_dtype: str = key("float32", "dtype of the frozen base weights: float32 | bfloat16 | float16")
    method: str = key("bdlora", "bdlora | lora | peft-bdlora (stock PEFT's BD-LoRA layer and init, same roles)")
    lora_r: int = key(24, "LoRA rank r (for bdlora: a multiple of nblocks)")
    lora_alpha: float = key(16, "LoRA alpha; scaling = alpha / r (alpha / sqrt(r) with use_rslora)")
    lora_alpha_ratio: float | None = key(
        None, "if set, lora_alpha = ratio * r (after budget matching), e.g. 2 for alpha = 2r"
    )
    lora_dropout: float = key(0.0, "dropout on the adapter input, in [0, 1)")
    use_rslora: bool = key(False, "rank-stabilized scaling alpha / sqrt(r)")
    lora_target_modules: list[str] | None = key(None, "default: q,k,v,o,gate,up,down projections")
    nblocks: int | None = key(
        None,
        "BD-LoRA blocks = the TP degree the adapter is served at; null: the largest of 8, 6, 4, 3, 2, 1 that "
        "divides the heads and KV heads",
    )
    match_budget_of_lora_rank: int | None = key(None, "BD-LoRA rank = largest with <= the params of LoRA at this rank")
    bd_a_init: str = key("peft", "init of block-diagonal A factors: peft | lora")
    bd_lr_ratio: float = key(
        1.0, "learning-rate multiplier for the block-diagonal factor (LoRA+-style; BD methods only; docs/compare.md)"
    )
    # --- data ---
    dataset: str = key(
        "task:analogies", "task:<name> | glue:<task> | packaged:<file> | local .jsonl/.csv/.parquet | Hub name"
    )
    dataset_config: str | None = key(None, "Hub dataset config name")
    dataset_split: str = key("train", "split of a Hub dataset")
    prompt_template: str | None = key(None, "str.format over a row, for datasets without prompt/completion columns")
    completion_template: str | None = key(None, "str.format over a row: the completion (learned) text")
    max_train_samples: int | None = key(None, "use at most this many training rows")
    max_seq_length: int = key(512, "tokens per example; longer rows are truncated")
    packing: bool = key(False, "padding-free: each batch is one row, position_ids restart per example")
    # --- optimization (transformers.TrainingArguments names) ---
    output_dir: str = key("runs/bdlora", "run directory: checkpoints, adapter/, metrics.json, recipe.yaml")
    seed: int = key(42, "seed of adapter init and data order")
    max_steps: int = key(-1, "-1: train num_train_epochs")
    num_train_epochs: float = key(1.0, "epochs when max_steps is -1")
    per_device_train_batch_size: int = key(8, "examples per device per step")
    gradient_accumulation_steps: int = key(1, "micro-batches per optimizer step")
    learning_rate: float = key(2e-4, "peak learning rate")
    lr_scheduler_type: str = key("linear", "transformers scheduler name: linear | cosine | constant | ...")
    warmup_ratio: float = key(0.0, "fraction of steps spent warming up, in [0, 1)")
    warmup_steps: int = key(0, "wins over warmup_ratio when > 0")
    weight_decay: float = key(0.0, "AdamW weight decay")
    max_grad_norm: float = key(1.0, "gradient clipping norm")
    optim: str = key("adamw_torch", "transformers optimizer name")
    bf16: bool = key(False, "mixed precision (GPU)")
    fp16: bool = key(False, "mixed precision fp16 (GPU)")
    gradient_checkpointing: bool = key(False, "recompute activations in backward (non-reentrant)")
    # --- checkpoints and logging ---
    logging_steps: int = key(10, "log the loss every N steps")
    save_steps: int = key(100, "0: no intermediate checkpoints")
    save_total_limit: int | None = key(2, "keep at most N complete checkpoints")
    resume_from_checkpoint: bool | str | None = key(
        None, "None: resume if a complete checkpoint exists; false: start over"
    )
    report_to: str = key("none", "none | wandb | tensorboard | comma-separated list")
    run_name: str | None = key(None, "run name for loggers (default: the output_dir name)")
    wandb_project: str = key("bdlora-train", "wandb project when report_to includes wandb")
    # --- distributed ---
    use_cpu: bool = key(False, "force CPU (also ACCELERATE_USE_CPU=true); gloo backend under torchrun")
    cpu_threads: int | None = key(
        None, "torch.set_num_threads for this run (restored after); tiny models run fastest on 1"
    )
    deepspeed: str | None = key(None, "DeepSpeed JSON, for torchrun launches (accelerate launch passes it itself)")
    fsdp: str = key("", 'e.g. "full_shard auto_wrap", for torchrun launches')
    fsdp_config: dict | None = key(None, "transformers fsdp_config mapping")
    ddp_backend: str | None = key(None, "nccl | gloo | ...; default: what accelerate picks for the device")
    # --- Hub ---
    push_to_hub: bool = key(False, "upload adapter/ with its model card when training finishes")
    hub_model_id: str | None = key(None, "target repo, e.g. me/smollm2-bdlora")
    hub_private_repo: bool = key(False, "create the Hub repo as private")

    def validate(self) -> "Recipe":
        """Cheap checks that need no model: fail in a second, not after loading 8B weights."""
        if self.method not in METHODS:
            raise RecipeError(f"recipe: method={self.method!r}; use one of {METHODS}")
        if self.torch_dtype not in DTYPES:
            raise RecipeError(f"recipe: torch_dtype={self.torch_dtype!r}; use one of {DTYPES}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise RecipeError(
                f"recipe: max_steps={self.max_steps} trains nothing; use a positive step count, or -1 with "
                "num_train_epochs"
            )
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            raise RecipeError(
                f"recipe: num_train_epochs={self.num_train_epochs} with max_steps=-1 trains nothing; use > 0"
            )
        if self.nblocks is not None and self.nblocks < 1:
            raise RecipeError(f"recipe: nblocks={self.nblocks} must be >= 1 or null (auto)")
        for key in (
            "lora_r",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "max_seq_length",
            "logging_steps",
        ):
            if getattr(self, key) < 1:
                raise RecipeError(f"recipe: {key}={getattr(self, key)} must be >= 1")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise RecipeError(f"recipe: cpu_threads={self.cpu_threads} must be >= 1 or null")
        if self.match_budget_of_lora_rank is not None and self.match_budget_of_lora_rank < 1:
            raise RecipeError(
                f"recipe: match_budget_of_lora_rank={self.match_budget_of_lora_rank} must be >= 1 or null"
            )
        if self.match_budget_of_lora_rank is not None and self.method not in BD_METHODS:
            raise RecipeError(
                "recipe: match_budget_of_lora_rank applies to method=bdlora only; drop it or set method=bdlora"
            )
        if not self.bd_lr_ratio > 0:
            raise RecipeError(f"recipe: bd_lr_ratio={self.bd_lr_ratio} must be > 0 (1: no multiplier)")
        check_method_keys(self)
        if self.save_steps < 0 or not 0 <= self.lora_dropout < 1 or self.learning_rate <= 0:
            raise RecipeError("recipe: save_steps must be >= 0, lora_dropout in [0, 1), learning_rate > 0")
        if self.push_to_hub and not self.hub_model_id:
            raise RecipeError("recipe: push_to_hub=true needs hub_model_id (e.g. hub_model_id=me/smollm2-bdlora)")
        if self.bf16 and self.fp16:
            raise RecipeError("recipe: bf16 and fp16 are both true; pick one")
        return self

    @property
    def targets(self) -> list[str]:
        from bdlora_train.roles import DEFAULT_TARGET_MODULES

        return list(self.lora_target_modules or DEFAULT_TARGET_MODULES)


def recipe_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(Recipe)]


def _coerce(key: str, value, hint):
    """A YAML/CLI value as the field's type, or a RecipeError naming key, value and expected type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        # bool | str: a YAML bool stays a bool, anything else is tried arm by arm
        for arm in sorted(arms, key=lambda a: 0 if isinstance(value, bool) and a is bool else 1):
            try:
                return _coerce(key, value, arm)
            except RecipeError:
                continue
        raise RecipeError(f"recipe: {key}={value!r} is not a {' or '.join(_type_name(a) for a in arms)} (or null)")
    if value is None:
        raise RecipeError(f"recipe: {key} cannot be null; give a {_type_name(hint)}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise RecipeError(f"recipe: {key}={value!r} is not a bool; use true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise RecipeError(f"recipe: {key}={value!r} is not an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "1e-3" as a string
            except ValueError:
                pass
        raise RecipeError(f"recipe: {key}={value!r} is not a number")
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise RecipeError(f"recipe: {key}={value!r} is not a string")
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        raise RecipeError(f"recipe: {key}={value!r} is not a list of strings")
    if hint is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise RecipeError(f"recipe: {key}={value!r} is not a mapping")
    raise RecipeError(f"recipe: {key} has an unsupported type {hint}")


def _type_name(hint) -> str:
    return getattr(hint, "__name__", str(hint))


def _unknown_key(key: str) -> RecipeError:
    close = difflib.get_close_matches(key, recipe_keys(), n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'?" if close else "see `bdlora train --help` for all keys"
    return RecipeError(f"recipe: unknown key '{key}'; {hint}")


def parse_overrides(overrides: Sequence[str]) -> dict:
    out = {}
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"recipe override '{item}' is not key=value (e.g. max_steps=40)")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        out[key.strip()] = value
    return out


def load_recipe(path: str | None, overrides: Sequence[str] = ()) -> Recipe:
    """A Recipe from a YAML file (or none) plus `key=value` overrides, type-checked and validated."""
    data: dict = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise RecipeError(f"recipe {path}: file not found; pass a recipe YAML such as recipes/tiny/bdlora.yaml")
        try:
            data = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as err:
            raise RecipeError(f"recipe {path}: invalid YAML ({first_line(err)})") from None
        if not isinstance(data, dict):
            raise RecipeError(f"recipe {path}: top level must be a mapping of key: value")
    data.update(parse_overrides(overrides))
    hints = typing.get_type_hints(Recipe)
    values = {}
    for key, value in data.items():
        if key not in hints:
            raise _unknown_key(key)
        values[key] = _coerce(key, value, hints[key])
    return Recipe(**values).validate()


def recipe_groups() -> dict[str, list[dataclasses.Field]]:
    """Recipe fields by section (the `# --- section ---` comments of the class), in declaration order."""
    import inspect

    groups: dict[str, list[dataclasses.Field]] = {}
    current = "general"
    fields = {f.name: f for f in dataclasses.fields(Recipe)}
    for line in inspect.getsource(Recipe).splitlines():
        stripped = line.strip()
        if stripped.startswith("# ---"):
            current = stripped.strip("# -")
        name = stripped.split(":", 1)[0]
        if name in fields:
            groups.setdefault(current, []).append(fields.pop(name))
    return groups


def keys_markdown() -> str:
    """The recipe-key reference table (docs/training.md), generated from the field metadata."""
    lines = []
    for group, fields in recipe_groups().items():
        lines += [f"**{group}**", "", "| key | default | meaning |", "|---|---|---|"]
        for f in fields:
            default = "null" if f.default is None else yaml.safe_dump(f.default, default_flow_style=True).strip()
            default = default.removesuffix("\n...").removesuffix("...").strip() or '""'
            meaning = f.metadata["help"].replace("|", "\\|")  # a literal | would split the table cell
            lines.append(f"| `{f.name}` | `{default}` | {meaning} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def dtype(name: str):
    """torch dtype of a `torch_dtype` recipe value."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
