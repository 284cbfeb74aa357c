"""The environment one run may touch, restored after it: accelerate and transformers write launch flags into
os.environ (ACCELERATE_USE_FSDP, ...), a run sets its wandb settings; each is put back when the run ends, so repeated
`train()` calls in one process (the compare sweep) start clean."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

LAUNCH_ENV = (
    "ACCELERATE_USE_FSDP",
    "ACCELERATE_USE_DEEPSPEED",
    "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "ACCELERATE_DYNAMO_BACKEND",
    "ACCELERATE_DYNAMO_MODE",
)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


@contextlib.contextmanager
def restored_env(names):
    """Put the environment variables `names` back as they were when the block began (one unset then, unset again)."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


@contextlib.contextmanager
def scoped_env(values: dict[str, str]):
    """Set env vars for one run and restore them, so repeated train() calls do not leak into each other."""
    with restored_env(values):
        os.environ.update(values)
        yield


@contextlib.contextmanager
def without_env(name: str):
    """Unset one environment variable for the block (restored after)."""
    with restored_env([name]):
        os.environ.pop(name, None)
        yield


@contextlib.contextmanager
def scoped_launch_env(cpu_threads: int | None):
    """Yield the launcher's {"fsdp", "deepspeed"} flags; restore launch env vars and torch threads afterwards."""
    import torch

    launch = {"fsdp": env_flag("ACCELERATE_USE_FSDP"), "deepspeed": env_flag("ACCELERATE_USE_DEEPSPEED")}
    with restored_env(LAUNCH_ENV):
        threads = torch.get_num_threads()
        if cpu_threads:
            torch.set_num_threads(cpu_threads)
        try:
            yield launch
        finally:
            torch.set_num_threads(threads)


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
