"""The recipe's training section: optimization, checkpoints and logging, under transformers.TrainingArguments' names
(train/training_args.py maps them on)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from bdlora_train.core.errors import RecipeError
from bdlora_train.core.keys import check_fields, key

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


@dataclass
class TrainingKeys:
    """The recipe's training section: optimization, checkpoints and logging (transformers.TrainingArguments' names)."""

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
    logging_steps: int = key(10, "log the loss every N steps", low=1)
    save_steps: int = key(100, "checkpoint every N steps; 0: no intermediate checkpoints", low=0)
    save_total_limit: int | None = key(2, "keep at most N complete checkpoints", low=1)
    resume_from_checkpoint: bool | str | None = key(
        None, "None: resume if a complete checkpoint exists; false: start over"
    )
    report_to: str = key("none", "none | wandb | tensorboard | comma-separated list")
    run_name: str | None = key(None, "run name for loggers (default: the output_dir name)")
    wandb_project: str = key("bdlora-train", "wandb project when report_to includes wandb")

    @property
    def loggers(self) -> list[str]:
        return [r.strip() for r in self.report_to.split(",") if r.strip()] or ["none"]

    def check(self) -> None:
        check_fields(self)
        if self.max_steps == 0:
            raise RecipeError(
                "recipe: max_steps=0 trains nothing; use a positive step count, or -1 with num_train_epochs"
            )
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            raise RecipeError(
                f"recipe: num_train_epochs={self.num_train_epochs} with max_steps=-1 trains nothing; use > 0"
            )
        if self.bf16 and self.fp16:
            raise RecipeError("recipe: bf16 and fp16 are both true; pick one")
        for logger in self.loggers:
            if logger not in LOGGERS:
                raise RecipeError(f"recipe: report_to={self.report_to!r}: unknown logger '{logger}'; use {LOGGERS}")
            if logger != "none" and not any(importlib.util.find_spec(m) for m in LOGGERS[logger]):
                raise RecipeError(
                    f"recipe: report_to={logger} but {LOGGERS[logger][0]} is not installed; "
                    f"pip install {LOGGERS[logger][0]}, or report_to=none"
                )
