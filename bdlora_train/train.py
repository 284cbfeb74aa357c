"""`bdlora train RECIPE.yaml [key=value ...]`: fine-tune a LoRA or BD-LoRA adapter with transformers' Trainer.

The recipe YAML maps 1:1 onto `Recipe`; `key=value` arguments override it. The same entry point runs as
`bdlora train`, `python -m bdlora_train.train` and under `accelerate launch` / `torchrun` (DDP, DeepSpeed
ZeRO-2/3, FSDP). Output in `output_dir`:
  checkpoint-<step>/   written into a hidden temp dir and renamed, so a crash never leaves a half checkpoint
  adapter/             the final adapter in stock PEFT format, with a model card (README.md)
  metrics.json         method, rank, trainable params, tokens/s, peak memory, final loss, wall time, world size
Running the same command again resumes from the last complete checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import difflib
import json
import os
import re
import shutil
import sys
import time
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from bdlora_train.files import atomic_write_text, replace_dir

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STAGING_PREFIX = ".tmp-"
METHODS = ("bdlora", "lora")
_LAUNCH_ENV = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "FSDP_CPU_RAM_EFFICIENT_LOADING",
               "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE")
DTYPES = ("float32", "bfloat16", "float16")


class RecipeError(ValueError):
    """A recipe key or value that cannot work; the message names the key, the value and the fix."""


@dataclass
class Recipe:
    """Everything one training run needs. YAML keys and `key=value` overrides map 1:1 onto these fields."""

    # --- base model and adapter ---
    model: str = "embedded"  # models.load_model spec: embedded | tiny:<type> | local dir | Hub id
    torch_dtype: str = "float32"  # dtype of the frozen base weights: float32 | bfloat16 | float16
    method: str = "bdlora"  # bdlora | lora
    lora_r: int = 8
    lora_alpha: float = 16
    lora_alpha_ratio: float | None = None  # if set, lora_alpha = ratio * r (after budget matching), e.g. 2 for alpha = 2r
    lora_dropout: float = 0.0
    use_rslora: bool = False
    lora_target_modules: list[str] | None = None  # default: q,k,v,o,gate,up,down projections
    nblocks: int = 3  # BD-LoRA blocks = the TP degree the adapter is served at
    match_budget_of_lora_rank: int | None = None  # BD-LoRA rank = largest with <= the params of LoRA at this rank
    bd_a_init: str = "peft"  # init of block-diagonal A factors: peft | lora
    # --- data ---
    dataset: str = "task:analogies"  # task:<name> | glue:<task> | packaged:<file> | local .jsonl/.csv/.parquet | Hub name
    dataset_config: str | None = None  # Hub dataset config name
    dataset_split: str = "train"
    prompt_template: str | None = None  # str.format over a row, for datasets without prompt/completion columns
    completion_template: str | None = None
    max_train_samples: int | None = None
    max_seq_length: int = 512
    packing: bool = False  # padding-free: each batch is one row, position_ids restart per example
    # --- optimization (transformers.TrainingArguments names) ---
    output_dir: str = "runs/bdlora"
    seed: int = 42
    max_steps: int = -1  # -1: train num_train_epochs
    num_train_epochs: float = 1.0
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 2e-4
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0  # wins over warmup_ratio when > 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    optim: str = "adamw_torch"
    bf16: bool = False  # mixed precision (GPU)
    fp16: bool = False
    gradient_checkpointing: bool = False
    # --- checkpoints and logging ---
    logging_steps: int = 10
    save_steps: int = 100  # 0: no intermediate checkpoints
    save_total_limit: int | None = 2
    resume_from_checkpoint: bool | str | None = None  # None: resume if a complete checkpoint exists; false: start over
    report_to: str = "none"  # none | wandb | tensorboard | comma-separated list
    run_name: str | None = None
    wandb_project: str = "bdlora-train"
    # --- distributed ---
    use_cpu: bool = False  # force CPU (also ACCELERATE_USE_CPU=true); gloo backend under torchrun
    cpu_threads: int | None = None  # torch.set_num_threads for this run (restored after); tiny models run fastest on 1
    deepspeed: str | None = None  # DeepSpeed JSON, for torchrun launches (accelerate launch passes it itself)
    fsdp: str = ""  # e.g. "full_shard auto_wrap", for torchrun launches
    fsdp_config: dict | None = None
    ddp_backend: str | None = None  # nccl | gloo | ...; default: what accelerate picks for the device
    # --- Hub ---
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_private_repo: bool = False

    def validate(self) -> "Recipe":
        """Cheap checks that need no model: fail in a second, not after loading 8B weights."""
        if self.method not in METHODS:
            raise RecipeError(f"recipe: method={self.method!r}; use one of {METHODS}")
        if self.torch_dtype not in DTYPES:
            raise RecipeError(f"recipe: torch_dtype={self.torch_dtype!r}; use one of {DTYPES}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise RecipeError(
                f"recipe: max_steps={self.max_steps} trains nothing; use a positive step count, or -1 with num_train_epochs"
            )
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            raise RecipeError(f"recipe: num_train_epochs={self.num_train_epochs} with max_steps=-1 trains nothing; use > 0")
        for key in ("lora_r", "nblocks", "per_device_train_batch_size", "gradient_accumulation_steps", "max_seq_length", "logging_steps"):
            if getattr(self, key) < 1:
                raise RecipeError(f"recipe: {key}={getattr(self, key)} must be >= 1")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise RecipeError(f"recipe: cpu_threads={self.cpu_threads} must be >= 1 or null")
        if self.match_budget_of_lora_rank is not None and self.match_budget_of_lora_rank < 1:
            raise RecipeError(f"recipe: match_budget_of_lora_rank={self.match_budget_of_lora_rank} must be >= 1 or null")
        if self.match_budget_of_lora_rank is not None and self.method != "bdlora":
            raise RecipeError("recipe: match_budget_of_lora_rank applies to method=bdlora only; drop it or set method=bdlora")
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
            raise RecipeError(f"recipe {path}: invalid YAML ({str(err).splitlines()[0]})") from None
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


@dataclass
class TrainResult:
    model: object  # the trained PeftModel
    metrics: dict
    adapter_dir: Path


# ---------------------------------------------------------------------------------------------- checkpoints


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


def _make_trainer_class():
    from transformers import Trainer
    from transformers.trainer_utils import rotate_checkpoints

    class AtomicCheckpointTrainer(Trainer):
        """Trainer whose checkpoints appear under their final name only once fully written.

        Trainer writes checkpoint-<step>/ in place, so a kill mid-save leaves a directory that resume would
        pick; we let it write into <output_dir>/.tmp-checkpoint-<step>/ and rename once all ranks are done.
        """

        _staging: str | None = None

        def _get_output_dir(self, trial):
            return self._staging or super()._get_output_dir(trial)

        def _save_checkpoint(self, model, trial):
            run_dir = Path(self.args.output_dir)
            name = f"checkpoint-{self.state.global_step}"
            staging = run_dir / f"{STAGING_PREFIX}{name}"
            if self.args.should_save and staging.exists():
                shutil.rmtree(staging)
            self.accelerator.wait_for_everyone()
            self._staging = str(staging)
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._staging = None
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                replace_dir(staging / name, run_dir / name)
                shutil.rmtree(staging, ignore_errors=True)
                rotate_checkpoints(output_dir=str(run_dir), save_total_limit=self.args.save_total_limit,
                                   best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)
            self.accelerator.wait_for_everyone()

    return AtomicCheckpointTrainer


def save_adapter(trainer, path: Path) -> None:
    """The adapter in stock PEFT format, complete under every launch mode (collective: call on all ranks).

    ZeRO-3 partitions every parameter, so a plain save_pretrained writes empty tensors; we gather only the
    adapter's parameters (not the frozen base) and save from rank 0.
    """
    ds_plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if trainer.is_deepspeed_enabled and ds_plugin is not None and ds_plugin.zero_stage == 3:
        import deepspeed

        model = trainer.accelerator.unwrap_model(trainer.model)
        params = [p for p in model.parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if trainer.args.should_save:
                from peft import get_peft_model_state_dict

                state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
                model.save_pretrained(str(path), state_dict=state, safe_serialization=True)
                if trainer.processing_class is not None:
                    trainer.processing_class.save_pretrained(str(path))
        trainer.accelerator.wait_for_everyone()
        return
    trainer.save_model(str(path))
    trainer.accelerator.wait_for_everyone()


# ---------------------------------------------------------------------------------------------- setup


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def _deepspeed_config(path: str | None) -> dict | None:
    """The DeepSpeed JSON as a dict, without an "auto" train_batch_size.

    TrainingArguments fills "auto" train_batch_size before the process group exists (world size 1), so under
    torchrun it would disagree with micro batch x accumulation x world; DeepSpeed derives it itself when absent.
    """
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise RecipeError(f"recipe: deepspeed={path}: file not found; use e.g. recipes/accelerate/zero3.json")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise RecipeError(f"recipe: deepspeed={path}: invalid JSON ({err})") from None
    if config.get("train_batch_size") == "auto":
        del config["train_batch_size"]
    return config


def _cpu_deepspeed_state() -> dict | None:
    """On CPU, set up accelerate's process state for DeepSpeed ourselves; returns TrainingArguments' accelerator_config.

    TrainingArguments passes no backend for DeepSpeed, and accelerate then treats a CUDA-less DeepSpeed run as a
    single process (backend None) while DeepSpeed itself runs on all ranks. With the state configured here (gloo),
    the world size, data sharding and gathers are right. GPU runs are left to transformers.
    """
    import torch

    if torch.cuda.is_available() or int(os.environ.get("LOCAL_RANK", -1)) == -1:
        return None
    if _env_flag("ACCELERATE_USE_CPU"):
        raise RecipeError("recipe: DeepSpeed on CPU runs with DS_ACCELERATOR=cpu, not ACCELERATE_USE_CPU=true "
                          "(which makes transformers drop DeepSpeed and run plain DDP); unset ACCELERATE_USE_CPU")
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # read by PartialState to init DeepSpeed's comm layer
    PartialState(backend="gloo")
    return {"use_configured_state": True}


def check_output_dir(output_dir: str) -> Path:
    """Create output_dir and prove it is writable, before any model is loaded."""
    root = Path(output_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f"{STAGING_PREFIX}write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink(missing_ok=True)
    except OSError as err:
        raise RecipeError(f"recipe: output_dir={output_dir} is not writable ({err.strerror}); choose another output_dir") from None
    return root


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_peft_config(recipe: Recipe, model):
    """(PEFT config, info): BlockDiagLoraConfig or LoraConfig with the same targets/alpha/dropout/rslora."""
    from peft import LoraConfig

    from bdlora_train.budget import count_adapter_params, match_budget
    from bdlora_train.config import BlockDiagLoraConfig

    targets = recipe.targets
    r = recipe.lora_r
    info: dict = {"matched_lora_rank": None, "matched_lora_params": None}
    if recipe.method == "bdlora" and recipe.match_budget_of_lora_rank is not None:
        r = match_budget(model, recipe.match_budget_of_lora_rank, recipe.nblocks, mode="below", target_modules=targets)
        info["matched_lora_rank"] = recipe.match_budget_of_lora_rank
        info["matched_lora_params"] = count_adapter_params(model, LoraConfig(r=recipe.match_budget_of_lora_rank, target_modules=targets))
    alpha = recipe.lora_alpha_ratio * r if recipe.lora_alpha_ratio is not None else recipe.lora_alpha
    common = dict(r=r, lora_alpha=alpha, lora_dropout=recipe.lora_dropout, use_rslora=recipe.use_rslora,
                  target_modules=targets, task_type="CAUSAL_LM")
    if recipe.method == "bdlora":
        config = BlockDiagLoraConfig(nblocks=recipe.nblocks, bd_a_init=recipe.bd_a_init, **common)
    else:
        config = LoraConfig(**common)
    info.update(r=r, lora_alpha=alpha, nblocks=recipe.nblocks if recipe.method == "bdlora" else 1, target_modules=targets)
    return config, info


def resolve_resume(recipe: Recipe, output_dir: Path) -> str | None:
    spec = recipe.resume_from_checkpoint
    if spec is False:
        return None
    if spec is None or spec is True:
        found = last_checkpoint(output_dir)
        if spec is True and found is None:
            raise RecipeError(f"recipe: resume_from_checkpoint=true but {output_dir} has no complete checkpoint-<step>/")
        return str(found) if found else None
    path = Path(spec)
    if not (path / "trainer_state.json").is_file():
        raise RecipeError(f"recipe: resume_from_checkpoint={spec} is not a complete checkpoint dir (no trainer_state.json)")
    return str(path)


def _report_changed_keys(previous: Path, recipe: Recipe) -> None:
    """Resuming with a different recipe is allowed (e.g. more steps) but said out loud."""
    if not previous.is_file():
        return
    before = yaml.safe_load(previous.read_text()) or {}
    now = dataclasses.asdict(recipe)
    changed = [f"{k} ({before[k]!r} -> {now[k]!r})" for k in now if k in before and before[k] != now[k]
               and k not in ("output_dir", "resume_from_checkpoint")]
    if changed:
        print(f"bdlora train: resuming {previous.parent} with changed keys: {', '.join(changed)}", file=sys.stderr)


@contextlib.contextmanager
def _scoped_env(values: dict[str, str]):
    """Set env vars for one run and restore them, so repeated train() calls do not leak into each other."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _wandb_key_present() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_env(recipe: Recipe, output_dir: Path, is_main: bool) -> dict[str, str]:
    """WANDB_* settings for a run: offline when no mode is set and no API key exists (never a network stall)."""
    env = {}
    if "wandb" not in _report_to(recipe):
        return env
    if not os.environ.get("WANDB_MODE") and not _wandb_key_present():
        env["WANDB_MODE"] = "offline"
        if is_main:
            print(f"bdlora train: no wandb API key and WANDB_MODE unset: logging offline to {output_dir}/wandb "
                  "(upload later with `wandb sync`)", file=sys.stderr)
    env.setdefault("WANDB_DIR", os.environ.get("WANDB_DIR") or str(output_dir))
    env.setdefault("WANDB_PROJECT", os.environ.get("WANDB_PROJECT") or recipe.wandb_project)
    env.setdefault("WANDB_SILENT", os.environ.get("WANDB_SILENT") or "true")
    return env


def _report_to(recipe: Recipe) -> list[str]:
    return [r.strip() for r in recipe.report_to.split(",") if r.strip()] or ["none"]


def _start_peak_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM so the peak is this run's


def _peak_memory() -> tuple[float, str]:
    import torch

    if torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0:
        return torch.cuda.max_memory_allocated() / 2**20, "cuda_max_allocated"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024, "cpu_peak_rss"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu_max_rss"


def parallelism(trainer) -> str:
    """What actually ran (not what was asked for): deepspeed_zero<stage> | fsdp<version> | ddp | single."""
    state = trainer.accelerator.state
    if trainer.is_deepspeed_enabled:
        return f"deepspeed_zero{state.deepspeed_plugin.zero_stage}"
    if trainer.is_fsdp_enabled:
        return f"fsdp{getattr(state.fsdp_plugin, 'fsdp_version', 1)}"
    return "ddp" if trainer.args.world_size > 1 else "single"


def check_parallelism(recipe: Recipe, trainer, launch: dict) -> None:
    """Refuse to train when the requested sharding did not take effect (accelerate falls back to DDP silently)."""
    if (recipe.fsdp or launch["fsdp"]) and not trainer.is_fsdp_enabled:
        raise RecipeError(
            "recipe: FSDP was requested but accelerate did not enable it; accelerate turns FSDP on only for GPU-type "
            "process groups (CUDA/NPU/XPU/...), never on CPU (gloo). On CPU use DDP or DeepSpeed "
            "(deepspeed=recipes/accelerate/zero3.json with DS_ACCELERATOR=cpu)"
        )
    if (recipe.deepspeed or launch["deepspeed"]) and not trainer.is_deepspeed_enabled:
        raise RecipeError(
            "recipe: DeepSpeed was requested but is not active; launch with torchrun or accelerate launch "
            "(and on CPU with DS_ACCELERATOR=cpu, without ACCELERATE_USE_CPU)"
        )


def _final_loss(log_history: list[dict]) -> float | None:
    for entry in reversed(log_history):
        if "loss" in entry:
            return float(entry["loss"])
    return None


# ---------------------------------------------------------------------------------------------- train


def training_arguments(recipe: Recipe, output_dir: Path):
    """transformers.TrainingArguments from the recipe. Built before the model loads, so ZeRO-3 can shard it at load."""
    import torch
    from transformers import TrainingArguments

    ckpt_key = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else "gradient_checkpointing"
    deepspeed_config = _deepspeed_config(recipe.deepspeed)
    accelerator_config = _cpu_deepspeed_state() if deepspeed_config or _env_flag("ACCELERATE_USE_DEEPSPEED") else None
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
        **{ckpt_key: recipe.gradient_checkpointing,
           f"{ckpt_key}_kwargs": {"use_reentrant": False} if recipe.gradient_checkpointing else None},
        logging_steps=recipe.logging_steps,
        save_strategy="steps" if recipe.save_steps > 0 else "no",
        save_steps=recipe.save_steps or 500,
        save_total_limit=recipe.save_total_limit,
        report_to=_report_to(recipe),
        run_name=recipe.run_name or output_dir.name,
        use_cpu=recipe.use_cpu,
        deepspeed=deepspeed_config,
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
    # accelerate and transformers write launch flags into os.environ (ACCELERATE_USE_FSDP, ...); a launcher's flags
    # are read here, and whatever this run adds is undone, so the next train() call in this process starts clean.
    launch = {"fsdp": _env_flag("ACCELERATE_USE_FSDP"), "deepspeed": _env_flag("ACCELERATE_USE_DEEPSPEED")}
    saved = {key: os.environ.get(key) for key in _LAUNCH_ENV}
    import torch

    threads = torch.get_num_threads()
    if recipe.cpu_threads:
        torch.set_num_threads(recipe.cpu_threads)
    try:
        return _train(recipe, model, tokenizer, train_dataset, launch)
    finally:
        torch.set_num_threads(threads)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _train(recipe: Recipe, model, tokenizer, train_dataset, launch: dict) -> TrainResult:
    from peft import get_peft_model
    from transformers import set_seed

    from bdlora_train import data as data_mod
    from bdlora_train.models import drop_gguf_marker, load_model

    recipe.validate()
    output_dir = check_output_dir(recipe.output_dir)
    resume = resolve_resume(recipe, output_dir)
    args = training_arguments(recipe, output_dir)
    report_to = _report_to(recipe)

    if model is None:
        model, loaded_tokenizer = load_model(recipe.model, dtype=_dtype(recipe.torch_dtype), seed=recipe.seed)
        tokenizer = tokenizer or loaded_tokenizer
    else:
        model = copy.deepcopy(model)  # get_peft_model injects layers in place; the caller's model stays untouched
    drop_gguf_marker(model)  # a GGUF model the caller loaded with plain transformers still carries it
    if tokenizer is None and recipe.model.startswith("tiny:"):
        tokenizer = data_mod.tiny_tokenizer()
    else:
        tokenizer = copy.deepcopy(tokenizer)  # pad token may be set below
    data_mod.prepare_tokenizer(tokenizer, model)

    spec = recipe.dataset if train_dataset is None else "train_dataset"
    rows = train_dataset
    if rows is None:
        rows = data_mod.load_rows(recipe.dataset, recipe.seed, recipe.dataset_config, recipe.dataset_split,
                                  recipe.prompt_template, recipe.completion_template, recipe.max_train_samples)
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
            _report_changed_keys(output_dir / "recipe.yaml", recipe)
        atomic_write_text(output_dir / "recipe.yaml", yaml.safe_dump(dataclasses.asdict(recipe), sort_keys=False))

    trainer_cls = _make_trainer_class()
    trainer = trainer_cls(model=peft_model, args=args, train_dataset=examples,
                          data_collator=data_mod.collator(tokenizer, recipe.packing), processing_class=tokenizer)
    check_parallelism(recipe, trainer, launch)
    with _scoped_env(wandb_env(recipe, output_dir, is_main)):
        _start_peak_memory()
        state_before = {}
        if resume:  # read now: checkpoint rotation may delete the dir during training
            state_before = json.loads((Path(resume) / "trainer_state.json").read_text())
        start = time.perf_counter()
        output = trainer.train(resume_from_checkpoint=resume)
        wall = time.perf_counter() - start
        peak_mb, peak_kind = _peak_memory()
        if "wandb" in report_to:
            import wandb

            if wandb.run is not None:
                wandb.finish()

    tokens = trainer.state.num_input_tokens_seen - state_before.get("num_input_tokens_seen", 0)
    adapter_dir = output_dir / "adapter"
    staging = output_dir / f"{STAGING_PREFIX}adapter"
    if is_main and staging.exists():
        shutil.rmtree(staging)
    save_adapter(trainer, staging)
    if is_main:
        (staging / "training_args.bin").unlink(missing_ok=True)  # a pickle; the recipe.yaml next to it says the same
    trained = trainer.accelerator.unwrap_model(trainer.model)
    trained.get_base_model().config.use_cache = use_cache
    metrics = {
        "method": recipe.method,
        "model": recipe.model,
        "dataset": spec,
        "r": info["r"],
        "lora_alpha": info["lora_alpha"],
        "nblocks": info["nblocks"],
        "target_modules": info["target_modules"],
        "matched_lora_rank": info["matched_lora_rank"],
        "matched_lora_params": info["matched_lora_params"],
        "trainable_params": trainable,
        "steps": trainer.state.global_step,
        "steps_this_run": trainer.state.global_step - state_before.get("global_step", 0),
        "resumed_from": resume,
        "train_wall_time_s": round(wall, 3),
        "tokens_seen": int(tokens),
        "tokens_per_second": round(tokens / wall, 2) if wall > 0 else None,
        "peak_memory_mb": round(peak_mb, 1),
        "peak_memory_kind": peak_kind,
        "final_loss": _final_loss(trainer.state.log_history) or round(float(output.training_loss), 6),
        "train_loss_mean": round(float(output.training_loss), 6),
        "world_size": args.world_size,
        "parallelism": parallelism(trainer),
        "seed": recipe.seed,
        "device": str(args.device),
        "adapter_dir": str(adapter_dir),
    }
    if is_main:
        from bdlora_train import hub

        hub.write_model_card(staging, metrics=metrics)
        replace_dir(staging, adapter_dir)
        atomic_write_text(output_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
        print(summary_line(metrics), flush=True)
        if recipe.push_to_hub:
            try:
                metrics["hub_url"] = hub.push_adapter(adapter_dir, recipe.hub_model_id, private=recipe.hub_private_repo)
            except Exception as err:  # network / permission errors of any type: the trained adapter is safe on disk
                raise hub.HubError(
                    f"push: training finished and the adapter is in {adapter_dir}, but the upload to {recipe.hub_model_id} "
                    f"failed ({str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__}); "
                    f"retry with `bdlora push {adapter_dir} --repo-id {recipe.hub_model_id}`"
                ) from None
            atomic_write_text(output_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
            print(f"bdlora train: pushed {adapter_dir} -> {metrics['hub_url']}", flush=True)
    trainer.accelerator.wait_for_everyone()
    return TrainResult(model=trained, metrics=metrics, adapter_dir=adapter_dir)


def summary_line(m: dict) -> str:
    loss = f"{m['final_loss']:.4f}" if m["final_loss"] is not None else "n/a"
    shape = f"r={m['r']} nblocks={m['nblocks']}" if m["method"] == "bdlora" else f"r={m['r']}"
    return (f"bdlora train: {m['method']} {shape} | {m['trainable_params']:,} trainable | step {m['steps']} | "
            f"{m['steps_this_run']} steps in {m['train_wall_time_s']:.1f} s | {m['tokens_per_second'] or 0:,.0f} tok/s | peak {m['peak_memory_mb']:,.0f} MB | "
            f"final loss {loss} | world {m['world_size']} | adapter -> {m['adapter_dir']}")


# ---------------------------------------------------------------------------------------------- CLI


def _keys_help() -> str:
    lines = ["recipe keys (YAML or key=value) with defaults:"]
    for f in dataclasses.fields(Recipe):
        default = f.default if f.default is not dataclasses.MISSING else None
        lines.append(f"  {f.name} = {default!r}")
    return "\n".join(lines)


def cli(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="bdlora train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Fine-tune a LoRA / BD-LoRA adapter from a recipe YAML; key=value arguments override it.",
        epilog=_keys_help(),
    )
    parser.add_argument("args", nargs="*", metavar="RECIPE.yaml [key=value ...]")
    parser.add_argument("--print-recipe", action="store_true", help="print the resolved recipe as YAML and exit")
    ns = parser.parse_args(argv)
    path = None
    overrides = list(ns.args)
    if overrides and "=" not in overrides[0]:
        path = overrides.pop(0)
    recipe = load_recipe(path, overrides)
    if ns.print_recipe:
        print(yaml.safe_dump(dataclasses.asdict(recipe), sort_keys=False), end="")
        return 0
    train(recipe)
    return 0


def main(argv=None) -> int:
    """`python -m bdlora_train.train` (also under accelerate launch / torchrun): user errors as one line."""
    try:
        return cli(argv)
    except (ValueError, OSError) as err:
        print(f"bdlora train: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
