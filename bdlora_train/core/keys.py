"""Recipe keys as dataclass fields: `key()` gives a field its default, its help text and its valid range in one
place, and `check_fields` checks a section's values against them. Each recipe section (recipe/schema.py lists them)
is a dataclass of such fields, defined and validated by the package that owns it."""

from __future__ import annotations

import dataclasses

from bdlora_train.core.errors import RecipeError


def key(default, help: str, *, low=None, high=None, high_open: bool = False, choices=None):
    """A recipe field: its default, the help text `bdlora train --help` and the docs show, and its valid range.

    `low`/`high` bound numbers (inclusive; `high_open` excludes `high`), `choices` lists the allowed values;
    `check_fields` checks them all, so a fraction like warmup_ratio=1.0 fails instead of meaning "1 step".
    """
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help})
    bounds = dict(low=low, high=high, high_open=high_open, choices=choices)
    return dataclasses.field(default=default, metadata={"help": help, **bounds})


def check_fields(section) -> None:
    """Every field of a section within its choices and range, or one line naming the key, the value and the range."""
    for f in dataclasses.fields(section):
        check_bounds(f, getattr(section, f.name))


def check_bounds(f: dataclasses.Field, value) -> None:
    meta = f.metadata
    if value is None or isinstance(value, bool):
        return
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise RecipeError(f"recipe: {f.name}={value!r}; use one of {list(meta['choices'])}")
    if not isinstance(value, (int, float)):
        return
    low, high = meta.get("low"), meta.get("high")
    too_low = low is not None and value < low
    too_high = high is not None and (value >= high if meta.get("high_open") else value > high)
    if too_low or too_high:
        if low is not None and high is not None:
            span = f"in [{low:g}, {high:g}{')' if meta.get('high_open') else ']'}"
        elif low is not None:
            span = "> 0" if 0 < low < 1e-6 else f">= {low:g}"
        else:
            span = f"<= {high:g}"
        raise RecipeError(f"recipe: {f.name}={value!r} must be {span} ({meta['help'].split(';')[0]})")
