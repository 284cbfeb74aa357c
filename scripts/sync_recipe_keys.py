"""Regenerate the recipe-key table in docs/training.md from the Recipe field metadata.

    python scripts/sync_recipe_keys.py      # after adding or changing a Recipe field (tests/test_cli.py checks it)
"""

import re
from pathlib import Path

from bdlora_train.files import atomic_write_text
from bdlora_train.train.recipe import keys_markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"
START, END = "<!-- recipe-keys:start -->", "<!-- recipe-keys:end -->"

if __name__ == "__main__":
    text = DOC.read_text()
    new, count = re.subn(f"{START}\n.*?{END}", lambda _: f"{START}\n{keys_markdown()}{END}", text, flags=re.S)
    if count != 1:
        raise SystemExit(f"{DOC}: expected one {START} ... {END} block, found {count}")
    atomic_write_text(DOC, new)
    print(f"updated {DOC}")
