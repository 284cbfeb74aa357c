"""The recipe-key reference table of docs/training.md, generated from the recipe sections' field metadata.

    python -m tools.recipe_keys      # after adding or changing a recipe key (tests/test_cli.py checks the table)
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

from bdlora_train.core.files import atomic_write_text
from bdlora_train.recipe.schema import SECTIONS, RecipeKeys

DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"
START, END = "<!-- recipe-keys:start -->", "<!-- recipe-keys:end -->"


def recipe_groups() -> dict[str, list[dataclasses.Field]]:
    """Recipe fields by section (recipe/schema.py SECTIONS, each headed by its class's docstring), the objective
    after the adapter, the pass-through TrainingArguments keys last."""
    own = {f.name: f for f in dataclasses.fields(RecipeKeys)}
    groups: dict[str, list[dataclasses.Field]] = {}
    for name, cls in SECTIONS.items():
        summary = cls.__doc__.split(":", 1)[1].strip().rstrip(".")
        groups[f"{name}: {summary}"] = list(dataclasses.fields(cls))
        if name == "adapter":
            groups["objective: what the run optimizes (objectives/)"] = [own["objective"]]
    groups["any other transformers.TrainingArguments key"] = [own["training_args"]]
    return groups


def keys_markdown() -> str:
    """The recipe-key reference table (docs/training.md), generated from the field metadata."""
    lines = []
    for group, fields in recipe_groups().items():
        lines += [f"**{group}**", "", "| key | default | meaning |", "|---|---|---|"]
        for f in fields:
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            default = "null" if value is None else yaml.safe_dump(value, default_flow_style=True).strip()
            default = default.removesuffix("\n...").removesuffix("...").strip() or '""'
            meaning = f.metadata["help"].replace("|", "\\|")  # a literal | would split the table cell
            lines.append(f"| `{f.name}` | `{default}` | {meaning} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def doc_table(path: Path = DOC) -> str:
    text = path.read_text()
    return text[text.index(START) + len(START) : text.index(END)].strip("\n") + "\n"


if __name__ == "__main__":
    text = DOC.read_text()
    new, count = re.subn(f"{START}\n.*?{END}", lambda _: f"{START}\n{keys_markdown()}{END}", text, flags=re.S)
    if count != 1:
        raise SystemExit(f"{DOC}: expected one {START} ... {END} block, found {count}")
    atomic_write_text(DOC, new)
    print(f"updated {DOC}")
