"""`bdlora <command> ...`: dispatch to bdlora_train/commands/ inside the error boundary (core/boundary.py: user
errors as one line, exit 1; Ctrl-C 130; `--traceback` shows the traceback of every error).

The table maps each command to its module by name, so `--help` of one command imports no other; tests/test_cli.py
checks that every entry names a module of commands/ that has the function.
"""

from __future__ import annotations

import sys

from bdlora_train.core.boundary import run_command

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
def _package_version() -> str:
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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    show_traceback = "--traceback" in argv
    argv = [a for a in argv if a != "--traceback"]
    if argv and argv[0] == "--version":
        print(f"bdlora {_package_version()}")
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
    return run_command(name, COMMANDS[name][0], rest, show_traceback)


if __name__ == "__main__":
    sys.exit(main())
