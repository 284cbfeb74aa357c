"""What the launcher (torchrun, accelerate launch, DeepSpeed, FSDP) set up, and the environment one run may touch.

accelerate and transformers write launch flags into os.environ (ACCELERATE_USE_FSDP, ...); `scoped_launch_env`
reads a launcher's flags and undoes whatever a run adds, so repeated `train()` calls in one process (the compare
sweep) start clean. The checks refuse runs whose requested sharding silently did not take effect.
`training_arguments` maps a recipe onto transformers' TrainingArguments, launch settings included.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from bdlora_train.core import launch_env
from bdlora_train.core.errors import RecipeError, first_line

_LAUNCH_ENV = (
    "ACCELERATE_USE_FSDP",
    "ACCELERATE_USE_DEEPSPEED",
    "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "ACCELERATE_DYNAMO_BACKEND",
    "ACCELERATE_DYNAMO_MODE",
)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


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
    asked = _parent_num_processes()
    count = f"--num_processes {asked}" if asked else "several processes"
    n = asked or 2
    args = _train_args()
    start = (
        f"`ACCELERATE_USE_CPU=true torchrun --nproc_per_node {n} -m bdlora_train.train {args}`"
        if args is not None
        else f"`ACCELERATE_USE_CPU=true torchrun --nproc_per_node {n}` running the script that calls train()"
    )
    raise RecipeError(
        f"recipe: accelerate launch was asked for {count} but started one (it starts several only with a "
        f"distributed config: --multi_gpu on GPUs); on CPU start {n} ranks with {start}"
    )


def _train_args() -> str | None:
    """This process's recipe and key=value arguments, quoted for a shell: the command to print runs as printed; None
    when train() was called from Python (no command line of ours to repeat)."""
    import shlex

    argv = [a for a in sys.argv[1:] if a != "--traceback"]
    if Path(sys.argv[0]).name == "bdlora" and argv[:1] == ["train"]:
        argv = argv[1:]
    elif not sys.argv[0].endswith(str(Path("bdlora_train", "train", "__main__.py"))):
        return None
    return shlex.join(argv)


def _parent_argv() -> list[str]:
    """The command line of the process that started this one (Linux /proc), or [] when it cannot be read."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return []
    return [arg for arg in raw.split("\0") if arg]


# The launchers a hint may repeat: (how the hint names it, the argv entries that name it, its process-count flag)
_LAUNCHERS = (
    ("torchrun", ("torchrun", "torch.distributed.run"), "--nproc_per_node"),
    ("accelerate launch", ("accelerate.commands.launch", "launch"), "--num_processes"),
)


def _launcher_options(argv: list[str]) -> tuple[str, list[str], str] | None:
    """(launcher, its options, its process-count flag) of a torchrun / `accelerate launch` command line that runs
    `-m bdlora_train.train`, or None."""
    if "bdlora_train.train" not in argv:
        return None
    end = argv.index("bdlora_train.train") - 1  # its "-m"
    for name, marks, flag in _LAUNCHERS:
        for i, arg in enumerate(argv[:end]):
            here = Path(arg).name if "/" in arg else arg
            if here in marks and (here != "launch" or (i > 0 and Path(argv[i - 1]).name == "accelerate")):
                return name, argv[i + 1 : end], flag
    return None


def _without_flag(options: list[str], flag: str) -> list[str]:
    """`options` without `flag` (either spelling, `--f v` or `--f=v`)."""
    spellings = {flag, flag.replace("_", "-")}
    kept, skip = [], False
    for arg in options:
        if skip:
            skip = False
        elif arg in spellings:
            skip = True
        elif not any(arg.startswith(f"{s}=") for s in spellings):
            kept.append(arg)
    return kept


def launch_command(processes: int) -> str | None:
    """The command that runs this very run with `processes` processes: the launcher that started it (torchrun or
    accelerate launch, its own options kept, the process count set) or, started alone, torchrun; with this run's
    recipe and key=value arguments. None when train() was called from Python (no command line to repeat)."""
    import shlex

    args = _train_args()
    if args is None:
        return None
    found = _launcher_options(_parent_argv()) if launch_env.local_rank() is not None else None
    name, options, flag = found or ("torchrun", [], "--nproc_per_node")
    options = [*_without_flag(options, flag), flag, str(processes)]
    return f"{name} {shlex.join(options)} -m bdlora_train.train {args}"


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


def check_launch(recipe) -> None:
    """What a command-line run refuses before it creates output_dir or loads anything heavy (train/entry.py): the
    recipe's own rules, a launcher that started one process instead of N, and under TP the process count. A wrong
    count is said after the model's TP rules (heads, nblocks, rank) pass, so the command it prints runs; only rank 0
    reads the model for that (every rank sees the same WORLD_SIZE: the others refuse at once and wait, quiet, for the
    launcher to stop them: core/boundary.py)."""
    recipe.validate()
    check_single_process_launch()
    if not recipe.model_parallel:
        return
    launched = launch_env.world_size()
    if launched != recipe.tp_size * recipe.fsdp_size * recipe.dp_replicate_size:
        if launch_env.is_main_process():
            check_model_parallel(recipe)
        check_processes(recipe)


def _parent_num_processes() -> int | None:
    """--num_processes of the `accelerate launch` command that started this process (Linux /proc), or None."""
    argv = _parent_argv()
    for i, arg in enumerate(argv):
        for flag in ("--num_processes", "--num-processes"):
            value = arg.removeprefix(f"{flag}=") if arg.startswith(f"{flag}=") else None
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            if value is not None and value.isdigit():
                return int(value)
    return None


def parallelism(trainer) -> str:
    """What actually ran (not what was asked for): deepspeed_zero<stage> | fsdp<version> | ddp | single, or for a base
    sharded by transformers tp<N> / ep<E> (with x fsdp<M> / x dp_replicate<R>)."""
    from bdlora_train.tp_runtime.mesh import ep_size, mesh_sizes
    from bdlora_train.train.trainer import TensorParallelAdapter

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


def _checkpointing_kwargs(recipe) -> dict | None:
    """torch.utils.checkpoint's keywords: non-reentrant; a float64 run's recomputation computes in float64 too."""
    if not recipe.gradient_checkpointing:
        return None
    if recipe.torch_dtype == "float64":
        from bdlora_train.models.float64 import recompute_contexts

        return {"use_reentrant": False, "context_fn": recompute_contexts}
    return {"use_reentrant": False}


def check_deepspeed_dtype(torch_dtype: str, deepspeed: bool) -> None:
    """DeepSpeed's engine casts the model to float32 (or to its bf16 / fp16 setting) whatever dtype it was loaded in:
    a float64 recipe would train and save float32, and say float64."""
    if torch_dtype == "float64" and deepspeed:
        raise RecipeError(
            "recipe: torch_dtype=float64 with DeepSpeed: its engine trains in float32 whatever the model's dtype; use "
            "torch_dtype=float32, or launch without DeepSpeed (DDP, or tp_size) to train in float64"
        )


@contextlib.contextmanager
def scoped_env(values: dict[str, str]):
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


def wandb_env(report_to: list[str], project: str, output_dir: Path, is_main: bool) -> dict[str, str]:
    """WANDB_* settings for a run that reports to `report_to` (TrainingArguments'): offline when no mode is set and no
    API key exists (never a network stall)."""
    env = {}
    if "wandb" not in report_to:
        return env
    if not os.environ.get("WANDB_MODE") and not _wandb_key_present():
        env["WANDB_MODE"] = "offline"
        if is_main:
            print(
                f"bdlora train: no wandb API key and WANDB_MODE unset: logging offline to {output_dir}/wandb "
                "(upload later with `wandb sync`)",
                file=sys.stderr,
            )
    env.setdefault("WANDB_DIR", os.environ.get("WANDB_DIR") or str(output_dir))
    env.setdefault("WANDB_PROJECT", os.environ.get("WANDB_PROJECT") or project)
    env.setdefault("WANDB_SILENT", os.environ.get("WANDB_SILENT") or "true")
    return env


@contextlib.contextmanager
def scoped_launch_env(cpu_threads: int | None):
    """Yield the launcher's {"fsdp", "deepspeed"} flags; restore launch env vars and torch threads afterwards."""
    import torch

    launch = {"fsdp": env_flag("ACCELERATE_USE_FSDP"), "deepspeed": env_flag("ACCELERATE_USE_DEEPSPEED")}
    saved = {key: os.environ.get(key) for key in _LAUNCH_ENV}
    threads = torch.get_num_threads()
    if cpu_threads:
        torch.set_num_threads(cpu_threads)
    try:
        yield launch
    finally:
        torch.set_num_threads(threads)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def without_env(name: str):
    """Unset one environment variable for the block (restored after)."""
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


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
            f"has no {missing[0]}; TP training is tested with transformers 5.19 and 5.24 (pip install "
            "'transformers>=5.19,<5.25'), or train with tp_size=1"
        )
    return DistributedConfig(**wanted)


def check_model_parallel(recipe):
    """Everything TP training needs from the model, checked on its config before any weight loads (meta device): the
    run's plan (train/run_plan.py) made on the meta-device model, with {adapted module: transformers' plan style} in
    `tp_styles`, or one line naming the family, module and alternative. The run reuses the plan on the sharded model."""
    from bdlora_train.models import load_config, meta_model
    from bdlora_train.train.run_plan import plan_run

    return plan_run(recipe, meta_model(load_config(recipe.model)))


def training_arguments(recipe, output_dir: Path, distributed):
    """transformers.TrainingArguments from the recipe, for a base sharded at load by `distributed`
    (`model_parallel_config`) or not. Built before the model loads, so ZeRO-3 can shard it at load."""
    import torch
    from transformers import TrainingArguments

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
        include_num_input_tokens_seen="all" if recipe.packing else "non_padding",
        push_to_hub=False,  # we push the adapter dir with our own card (hub.py), not Trainer's
        per_device_eval_batch_size=recipe.per_device_train_batch_size,
    )
    if distributed is not None:
        # transformers' Trainer does not checkpoint the optimizer of a model sharded at load (`DistributedConfig`);
        # the toolkit's trainer does, gathered (train/trainer.py), so Trainer is told to save the model only.
        kwargs["save_only_model"] = True
    kwargs.update(recipe.training_args)  # any other TrainingArguments key, type-checked by load_recipe
    try:
        with without_env("WANDB_MODE"):  # transformers' integrations print "Running in WANDB offline mode" to stdout
            return TrainingArguments(**kwargs)
    except (ValueError, TypeError) as err:  # transformers' own consistency checks (eval_steps, schedulers, ...)
        raise RecipeError(f"recipe: transformers refused the training arguments ({first_line(err)})") from None
