"""`bdlora <command> ...`: a thin dispatcher. Each command's arguments live with the module that does the work."""

from __future__ import annotations

import importlib
import sys

# command -> "module:function"; each function takes argv and returns an exit code.
COMMANDS = {
    "budget": ("bdlora_train.budget:cli", "LoRA vs BD-LoRA parameter budgets for a model"),
    "inspect": ("bdlora_train.adapters:cli", "per-module roles, shapes and servable TP degrees of an adapter"),
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
