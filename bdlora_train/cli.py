"""`bdlora <command> ...`: dispatch to bdlora_train/commands/, and turn user errors into one line.

A `BdloraError` (bad input, a setting that cannot work) and the failures a user can cause in other libraries
(a corrupt safetensors file, a Hub or network error, a full disk) print one line and exit 1; Ctrl-C exits 130.
A bad option (argparse) is such a user error too. Anything else is a bug and keeps its traceback. `--traceback`
shows the traceback of every error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

from bdlora_train.core.errors import BdloraError

# command -> ("module:function", help); each function takes argv and returns an exit code.
COMMANDS = {
    "budget": ("bdlora_train.commands.budget:main", "LoRA vs BD-LoRA parameter budgets for a model"),
    "train": (
        "bdlora_train.commands.train:main",
        "fine-tune a LoRA / BD-LoRA adapter from a recipe YAML (key=value overrides)",
    ),
    "compare": (
        "bdlora_train.commands.compare:main",
        "train+evaluate LoRA vs BD-LoRA at matched budgets over seeds; table and plot",
    ),
    "inspect": ("bdlora_train.commands.inspect:main", "per-module roles, shapes and servable TP degrees of an adapter"),
    "export": (
        "bdlora_train.commands.export:main",
        "exact exports: plain (dense) LoRA, re-blocked BD-LoRA, merged model",
    ),
    "check-serving": (
        "bdlora_train.commands.serving:main",
        "can an engine serve the adapter at a TP degree, and with which command",
    ),
    "push": ("bdlora_train.commands.push:main", "push an adapter dir with its model card to the Hugging Face Hub"),
    "tp-check": (
        "bdlora_train.commands.tp:check_main",
        "shard an adapter over N ranks: collectives of base / BD-LoRA / S-LoRA, exactness",
    ),
    "bench-tp": ("bdlora_train.commands.tp:bench_main", "TP forward latency of base vs BD-LoRA vs S-LoRA sharding"),
}
INTERRUPTED = 130


def user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions a user can cause (bad files, network, disk), besides our own BdloraError."""
    types: list[type[BaseException]] = [BdloraError, OSError]
    for module, name in (
        ("safetensors", "SafetensorError"),
        ("huggingface_hub.errors", "HfHubHTTPError"),
        ("huggingface_hub.errors", "OfflineModeIsEnabled"),
        ("httpx", "HTTPError"),
        ("requests", "RequestException"),
    ):
        try:
            types.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(types)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bdlora-train")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _usage() -> str:
    lines = ["usage: bdlora [--version] [--traceback] <command> [args]", "", "commands:"]
    lines += [f"  {name:<14} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "Run `bdlora <command> --help` for a command's options."]
    return "\n".join(lines)


def error_line(command: str, err: BaseException) -> str:
    """`bdlora <command>: error: <first line>`, without repeating a `<command>: ` prefix the message already has."""
    from bdlora_train.core.errors import first_line

    text = first_line(err, limit=500)
    for prefix in (f"{command}: ", f"bdlora {command}: "):
        text = text.removeprefix(prefix)
    return f"bdlora {command}: error: {text}"


def quiet_library_chatter() -> None:
    """core/chatter.py's silencing. Cheap: imports nothing heavy, so `bdlora <command> --help` stays fast."""
    from bdlora_train.core.chatter import quiet_library_chatter as quiet_libraries

    quiet_libraries()


def default_deepspeed_accelerator() -> None:
    """DS_ACCELERATOR=cpu on machines without a GPU: what DeepSpeed picks there anyway, without its "Setting
    accelerator to CPU" warning, which every model save_pretrained would print (accelerate's unwrap imports
    DeepSpeed). Costs a torch import: skipped for `--help`, which never gets that far."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


class UsageError(BdloraError):
    """A command line argparse refuses (a bad value, a missing option)."""


@contextlib.contextmanager
def argparse_errors_raise():
    """argparse answers a bad option with the usage and exit 2; under `bdlora` every parser a command builds raises
    `UsageError` instead, so a bad option gets the one line and exit 1 of every other user error. One mechanism for
    all commands (those of commands/ and any parser they call), scoped to the command's run."""
    original = argparse.ArgumentParser.error

    def error(parser: argparse.ArgumentParser, message: str):
        raise UsageError(f"{message} (see `{parser.prog} --help`)")

    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    show_traceback = "--traceback" in argv
    argv = [a for a in argv if a != "--traceback"]
    if argv and argv[0] == "--version":
        print(f"bdlora {_version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"bdlora: unknown command '{name}'{hint} (see `bdlora --help`)", file=sys.stderr)
        return 2
    module_name, func_name = COMMANDS[name][0].split(":")
    quiet_library_chatter()
    if not {"-h", "--help"} & set(rest):
        default_deepspeed_accelerator()
    try:
        func = getattr(importlib.import_module(module_name), func_name)
        with argparse_errors_raise():
            return int(func(rest) or 0)
    except BrokenPipeError:  # `bdlora inspect ... | head`: the reader left; nothing to report
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        if show_traceback:
            raise
        print(f"bdlora {name}: interrupted; re-run the same command to resume", file=sys.stderr)
        return INTERRUPTED
    except user_error_types() as err:
        if show_traceback:
            raise
        print(error_line(name, err), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
