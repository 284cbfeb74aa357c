"""DeepSpeed as a run uses it: its JSON read with the one key TrainingArguments would fill wrong, accelerate's process
state set up by hand for DeepSpeed on CPU (which accelerate would run as one process), and the dtype DeepSpeed's engine
would silently change."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bdlora_train.core import launch_env
from bdlora_train.core.errors import RecipeError
from bdlora_train.launch.env import env_flag


def deepspeed_config(path: str | None) -> dict | None:
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


def cpu_deepspeed_state() -> dict | None:
    """On CPU, set up accelerate's process state for DeepSpeed ourselves; returns TrainingArguments' accelerator_config.

    TrainingArguments passes no backend for DeepSpeed, and accelerate then treats a CUDA-less DeepSpeed run as a
    single process (backend None) while DeepSpeed itself runs on all ranks. With the state configured here (gloo),
    the world size, data sharding and gathers are right. GPU runs are left to transformers.
    """
    import torch

    if torch.cuda.is_available() or launch_env.local_rank() is None:
        return None
    if env_flag("ACCELERATE_USE_CPU"):
        raise RecipeError(
            "recipe: DeepSpeed on CPU runs with DS_ACCELERATOR=cpu, not ACCELERATE_USE_CPU=true "
            "(which makes transformers drop DeepSpeed and run plain DDP); unset ACCELERATE_USE_CPU"
        )
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # read by PartialState to init DeepSpeed's comm layer
    PartialState(backend="gloo")
    return {"use_configured_state": True}


def check_deepspeed_dtype(torch_dtype: str, deepspeed: bool) -> None:
    """DeepSpeed's engine casts the model to float32 (or to its bf16 / fp16 setting) whatever dtype it was loaded in:
    a float64 recipe would train and save float32, and say float64."""
    if torch_dtype == "float64" and deepspeed:
        raise RecipeError(
            "recipe: torch_dtype=float64 with DeepSpeed: its engine trains in float32 whatever the model's dtype; use "
            "torch_dtype=float32, or launch without DeepSpeed (DDP, or tp_size) to train in float64"
        )
