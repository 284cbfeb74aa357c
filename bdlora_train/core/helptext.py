"""`--help` of every command: each option's help ends with its default, spelled as the user types it.

A recipe key takes YAML values (`null`, `true`, `false`), so a default is written that way here too, never as
Python's `None` / `True` / `False`; a list default is written as its items, space-separated, as on the command line.
"""

from __future__ import annotations

import argparse


def spell(value) -> str:
    """A default as the user types it: null, true / false, a list's items space-separated ("none" when empty)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return " ".join(spell(v) for v in value) if value else "none"
    return str(value)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Like argparse.ArgumentDefaultsHelpFormatter, with `spell`'s spelling. A help that already says its default
    ("default: ...", "omitted: ...", "... is required") is left as written; -h, required options and plain
    positionals get none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.default is argparse.SUPPRESS  # -h / --version among them
            or action.required
            or (not action.option_strings and action.nargs not in ("?", "*"))
            or "default" in text
            or "omitted:" in text
            or "is required" in text
        ):
            return text
        return f"{text} (default: {spell(action.default)})".lstrip()
