"""What the launcher (torchrun, accelerate launch, DeepSpeed, FSDP) set up, checked: a rank that dies with its
launcher, a launcher that started one process where N were asked for, the process count a TP recipe needs (with the
command that starts it right, launch/command.py), transformers' DistributedConfig for a base sharded at load,
and the sharding that really took effect. The environment a run may touch is restored by launch/env.py; the
recipe becomes TrainingArguments in train/training_args.py.
"""

from __future__ import annotations

import os
import sys

from bdlora_train.core import launch_env
from bdlora_train.core.errors import RecipeError
from bdlora_train.launch.command import launch_command, parent_num_processes, train_args


def die_with_launcher() -> None:
    """A rank started by a launcher (torchrun, accelerate launch: LOCAL_RANK set) is killed when that launcher dies,
    even by `kill -9`, which gives the launcher no chance to stop its ranks: without this they are re-parented to
    PID 1 and train on, holding output_dir's lock. Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)`: the kernel ends the rank,
    which releases the lock (flock) with it; the re-run resumes from the last complete checkpoint and removes the
    staging leftovers (rundir.py). A launcher that died before the rank got here: the rank stops at once. Elsewhere
    (macOS, no launcher) nothing changes."""
    if launch_env.local_rank() is None or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent == 1 or os.getppid() != parent:  # the launcher died before (or while) the rank asked
        os._exit(LAUNCHER_GONE)


PR_SET_PDEATHSIG = 1  # linux/prctl.h
LAUNCHER_GONE = 1


def check_single_process_launch() -> None:
    """`accelerate launch --num_processes N` without a distributed config (e.g. with --cpu) starts ONE process and
    tells it nothing; its simple launcher then sets MASTER_ADDR (only when N > 1) but no WORLD_SIZE. Refused, so a
    run never trains alone while the user believes N ranks share it."""
    if launch_env.launched_world_size() is not None:
        return
    if "MASTER_ADDR" not in os.environ or "ACCELERATE_DYNAMO_BACKEND" not in os.environ:
        return
    asked = parent_num_processes()
    count = f"--num_processes {asked}" if asked else "several processes"
    n = asked or 2
    args = train_args()
    start = (
        f"`ACCELERATE_USE_CPU=true torchrun --nproc_per_node {n} -m bdlora_train.train {args}`"
        if args is not None
        else f"`ACCELERATE_USE_CPU=true torchrun --nproc_per_node {n}` running the script that calls train()"
    )
    raise RecipeError(
        f"recipe: accelerate launch was asked for {count} but started one (it starts several only with a "
        f"distributed config: --multi_gpu on GPUs); on CPU start {n} ranks with {start}"
    )


def check_processes(recipe) -> None:
    """A recipe with tp_size (x fsdp_size x dp_replicate_size) needs exactly that many processes; otherwise one line
    with the command that starts them (this run's own launcher, recipe and arguments)."""
    sizes = recipe.tp_size * recipe.fsdp_size * recipe.dp_replicate_size
    launched = launch_env.world_size()
    if launched == sizes:
        return
    command = launch_command(sizes)
    how = f"`{command}`" if command else f"`torchrun --nproc_per_node {sizes}` running the script that calls train()"
    raise RecipeError(
        f"recipe: tp_size={recipe.tp_size} x fsdp_size={recipe.fsdp_size} x dp_replicate_size="
        f"{recipe.dp_replicate_size} needs {sizes} processes but the launcher started {launched}; launch with "
        f"{how} (or one process per GPU over nodes)"
    )


def parallelism(trainer) -> str:
    """What actually ran (not what was asked for): deepspeed_zero<stage> | fsdp<version> | ddp | single, or for a base
    sharded by transformers tp<N> / ep<E> (with x fsdp<M> / x dp_replicate<R>)."""
    from bdlora_train.tp_runtime.mesh import ep_size, mesh_sizes
    from bdlora_train.trainer.mixins import TensorParallelAdapter

    state = trainer.accelerator.state
    if isinstance(trainer, TensorParallelAdapter):
        replicas, fsdp, tp = mesh_sizes(trainer.model)
        sizes = (("tp", tp), ("ep", ep_size(trainer.model)), ("fsdp", fsdp), ("dp_replicate", replicas))
        return " x ".join(f"{k}{v}" for k, v in sizes if v > 1)
    if trainer.is_deepspeed_enabled:
        return f"deepspeed_zero{state.deepspeed_plugin.zero_stage}"
    if trainer.is_fsdp_enabled:
        return f"fsdp{getattr(state.fsdp_plugin, 'fsdp_version', 1)}"
    return "ddp" if trainer.args.world_size > 1 else "single"


def per_rank_parameter_bytes(trainer) -> list[dict] | None:
    """Each rank's parameter bytes as it holds them, the frozen base's and the adapter's (its trainable
    parameters): a TP / EP / FSDP shard, a ZeRO-3 partition, a DDP replica whole. How a parallel run split the model,
    in metrics.json; None for one process (collective: every rank calls it)."""
    import torch

    from bdlora_train.tp_runtime.mesh import local_part

    if trainer.args.world_size <= 1:
        return None
    held = {True: 0, False: 0}
    for param in trainer.accelerator.unwrap_model(trainer.model).parameters():
        local = getattr(param, "ds_tensor", None)  # DeepSpeed ZeRO-3: this rank's partition
        local = local_part(param) if local is None else local
        held[param.requires_grad] += local.numel() * local.element_size()
    mine = torch.tensor([[held[False], held[True]]], dtype=torch.int64, device=trainer.accelerator.device)
    return [{"base": int(base), "adapter": int(adapter)} for base, adapter in trainer.accelerator.gather(mine).tolist()]


def check_parallelism(trainer, launch: dict) -> None:
    """Refuse to train when the requested sharding (the recipe's, in the Trainer's arguments, or the launcher's) did
    not take effect (accelerate falls back to DDP silently)."""
    if (trainer.args.fsdp or launch["fsdp"]) and not trainer.is_fsdp_enabled:
        raise RecipeError(
            "recipe: FSDP was requested but accelerate did not enable it; accelerate turns FSDP on only for GPU-type "
            "process groups (CUDA/NPU/XPU/...), never on CPU (gloo). On CPU use DDP or DeepSpeed "
            "(deepspeed=recipes/accelerate/zero3.json with DS_ACCELERATOR=cpu)"
        )
    if (trainer.args.deepspeed or launch["deepspeed"]) and not trainer.is_deepspeed_enabled:
        raise RecipeError(
            "recipe: DeepSpeed was requested but is not active; launch with torchrun or accelerate launch "
            "(and on CPU with DS_ACCELERATOR=cpu, without ACCELERATE_USE_CPU)"
        )


def model_parallel_config(recipe):
    """transformers' `DistributedConfig` for a recipe with tp_size / fsdp_size / dp_replicate_size / ep_size, else
    None; the launcher must have started exactly tp_size x fsdp_size x dp_replicate_size processes."""
    if not recipe.model_parallel:
        return None
    check_processes(recipe)
    import inspect

    import transformers

    sizes = {"tp_size": recipe.tp_size, "fsdp_size": recipe.fsdp_size, "dp_replicate_size": recipe.dp_replicate_size,
             "ep_size": recipe.ep_size}  # fmt: skip
    wanted = {key: size for key, size in sizes.items() if key == "tp_size" or size > 1}
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        DistributedConfig = None
    known = inspect.signature(DistributedConfig).parameters if DistributedConfig is not None else {}
    missing = [key for key in wanted if key not in known]
    if missing:
        raise RecipeError(
            f"recipe: {missing[0]}={wanted[missing[0]]}: transformers {transformers.__version__}'s DistributedConfig "
            f"has no {missing[0]}; TP training is tested with transformers 5.19 and 5.25 (pip install "
            "'transformers>=5.19,<5.26'), or train with tp_size=1"
        )
    if recipe.tp_size > 1 and recipe.ep_size == 1:  # the experts split by TP where transformers' plan leaves them whole
        from bdlora_train.arch.scope import split_experts
        from bdlora_train.models import load_config, meta_model

        entries = split_experts(meta_model(load_config(recipe.model)))
        if entries:
            wanted["tp_plan"] = entries
    return DistributedConfig(**wanted)
