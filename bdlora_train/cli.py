"""`bdlora <command> ...`: a thin dispatcher. Each command's arguments live with the module that does the work."""

from __future__ import annotations

import importlib
import sys

# command -> "module:function"; each function takes argv and returns an exit code.
COMMANDS = {
    "push": ("bdlora_train.hub:cli", "push an adapter dir with its model card to the Hugging Face Hub"),
    "train": ("bdlora_train.train:cli", "fine-tune a LoRA / BD-LoRA adapter from a recipe YAML (key=value overrides)"),
    "budget": ("bdlora_train.budget:cli", "LoRA vs BD-LoRA parameter budgets for a model"),
    "compare": ("bdlora_train.evaluation.compare:cli", "train+evaluate LoRA vs BD-LoRA at matched budgets over seeds; table and plot"),
    "inspect": ("bdlora_train.adapters:cli", "per-module roles, shapes and servable TP degrees of an adapter"),
    "tp-check": ("bdlora_train.tp:check_cli", "shard an adapter over N ranks: collectives of base / BD-LoRA / S-LoRA, exactness"),
    "bench-tp": ("bdlora_train.tp:bench_cli", "TP forward latency of base vs BD-LoRA vs S-LoRA sharding"),
    "export": ("bdlora_train.export:cli", "exact exports: plain (dense) LoRA, re-blocked BD-LoRA, merged model"),
    "check-serving": ("bdlora_train.export:check_serving_cli", "vLLM BD-LoRA readiness at a TP degree, with the serve command or the fix"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: bdlora <command> [args]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<14} {help_text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"bdlora: unknown command '{name}'{hint} (see `bdlora --help`)", file=sys.stderr)
        return 2
    module_name, func_name = COMMANDS[name][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(rest) or 0)
    except (ValueError, FileNotFoundError, PermissionError, OSError) as err:
        # User errors surface as one line; the library raises them with module, value and fix in the message.
        print(f"bdlora {name}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
