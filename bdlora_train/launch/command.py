"""The command line behind this run, read back and rebuilt: the user's own recipe and key=value arguments, the
launcher that started this process (its command line in Linux /proc/<ppid>/cmdline) with its options, and the
command that would start the run with the right number of processes (printed by the launch checks, launch/checks.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bdlora_train.core import launch_env


def train_args() -> str | None:
    """This process's recipe and key=value arguments, quoted for a shell: the command to print runs as printed; None
    when train() was called from Python (no command line of ours to repeat)."""
    import shlex

    argv = [a for a in sys.argv[1:] if a != "--traceback"]
    if Path(sys.argv[0]).name == "bdlora" and argv[:1] == ["train"]:
        argv = argv[1:]
    elif not sys.argv[0].endswith(str(Path("bdlora_train", "train", "__main__.py"))):
        return None
    return shlex.join(argv)


def parent_argv() -> list[str]:
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

    args = train_args()
    if args is None:
        return None
    found = _launcher_options(parent_argv()) if launch_env.local_rank() is not None else None
    name, options, flag = found or ("torchrun", [], "--nproc_per_node")
    options = [*_without_flag(options, flag), flag, str(processes)]
    return f"{name} {shlex.join(options)} -m bdlora_train.train {args}"


def parent_num_processes() -> int | None:
    """--num_processes of the `accelerate launch` command that started this process (Linux /proc), or None."""
    argv = parent_argv()
    for i, arg in enumerate(argv):
        for flag in ("--num_processes", "--num-processes"):
            value = arg.removeprefix(f"{flag}=") if arg.startswith(f"{flag}=") else None
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            if value is not None and value.isdigit():
                return int(value)
    return None
