"""Writes eval/tasks/continents/continents.jsonl: a one-word-answer task on real data that ships with every Python,
for checking that a GRPO setting tuned on word analogies also learns on a task it was not tuned on (docs/rl.md).

Each row names a city from the IANA time zone database (`zoneinfo.available_timezones()`: `Region/City` zones whose
region is Africa, America, Asia, Australia or Europe) and asks for the region, with two examples in the prompt:

    Paris: Europe
    Tokyo: Asia
    Nairobi:            -> " Africa"

The embedded SmolLM2-135M answers about 28 % of them greedily: most African and European cities, few Asian ones, and
American cities hardly ever as the database names their region ("America", not "North America" or a country). That
is the shape of a user's own small task: a few hundred rows, a one-word label with a convention of its own that the
model meets some of the time, so the rewards of a group differ and GRPO has something to learn from. The file is
committed: the time zone database differs a little between machines, the task must not.

    python scripts/make_continents_task.py    # rewrites the file from this machine's time zone database
"""

from __future__ import annotations

import json
import zoneinfo
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "eval" / "tasks" / "continents" / "continents.jsonl"
REGIONS = ("Africa", "America", "Asia", "Australia", "Europe")
SHOTS = (("Paris", "Europe"), ("Tokyo", "Asia"))


def rows() -> list[dict]:
    prefix = "".join(f"{city}: {region}\n" for city, region in SHOTS)
    seen, out = {city for city, _ in SHOTS}, []
    for zone in sorted(zoneinfo.available_timezones()):
        parts = zone.split("/")
        if len(parts) != 2 or parts[0] not in REGIONS:
            continue
        city = parts[1].replace("_", " ")
        if city in seen:
            continue
        seen.add(city)
        out.append({"prompt": f"{prefix}{city}:", "completion": f" {parts[0]}", "category": parts[0]})
    return out


def main() -> None:
    data = rows()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in data))
    print(f"make_continents_task: wrote {len(data)} rows to {OUT}")


if __name__ == "__main__":
    main()
