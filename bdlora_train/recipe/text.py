"""Recipe values from text: YAML files (duplicate keys refused, 1e-5 read as a float) and `key=value` overrides
parsed by the field's type, then coerced to it with one-line errors naming key, value and expected type."""

from __future__ import annotations

import datetime
import enum
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path

import yaml

from bdlora_train.core.errors import RecipeError, first_line


def _coerce(key: str, value, hint):
    """A YAML value (or one parsed from text by `_from_text`) as the field's type, or a RecipeError naming key,
    value and expected type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        # bool | str: a YAML bool stays a bool, anything else is tried arm by arm
        for arm in sorted(arms, key=lambda a: 0 if isinstance(value, bool) and a is bool else 1):
            try:
                return _coerce(key, value, arm)
            except RecipeError:
                continue
        raise RecipeError(f"recipe: {key}={value!r} is not {' or '.join(_type_name(a) for a in arms)} (or null)")
    if value is None:
        raise RecipeError(f"recipe: {key} cannot be null; give {_type_name(hint)}")
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        allowed = [m.value for m in hint]
        if value in allowed or value in list(hint):
            return value.value if isinstance(value, enum.Enum) else value
        raise RecipeError(f"recipe: {key}={value!r}; use one of {allowed}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise RecipeError(f"recipe: {key}={value!r} is not a bool; use true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise RecipeError(f"recipe: {key}={value!r} is not an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "1e-3" as a string
            except ValueError:
                pass
        raise RecipeError(f"recipe: {key}={value!r} is not a number")
    if hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, (datetime.date, datetime.datetime)):  # YAML 1.1 reads 2024-01-01 as a date
            return value.isoformat()
        raise RecipeError(f"recipe: {key}={value!r} is not a string; quote it")
    if origin is list or hint is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        # a bare `list` (rewards) also takes mappings, which its own loader checks entry by entry
        scalar = lambda v: isinstance(v, (str, int, float)) or (hint is list and isinstance(v, dict))  # noqa: E731
        if isinstance(value, (list, tuple)) and all(scalar(v) for v in value):
            return list(value)
        raise RecipeError(f"recipe: {key}={value!r} is not a list")
    if hint is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise RecipeError(f"recipe: {key}={value!r} is not a mapping")
    if hint is typing.Any or hint is object:
        return value
    raise RecipeError(f"recipe: {key} has an unsupported type {hint}")


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a bool", str: "a string", list: "a list", dict: "a mapping"}


def _type_name(hint) -> str:
    """The type as a message says it: "an integer", "a number", ..."""
    return _TYPE_NAMES.get(hint) or _TYPE_NAMES.get(typing.get_origin(hint)) or f"a {getattr(hint, '__name__', hint)}"


_NULLS = ("null", "none", "~", "")
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}  # what a backslash escape in a `key=value` string means


def _from_text(key: str, raw: str, hint):
    """A `key=value` override parsed by the field's type, not by YAML: `prompt_template=Question: {q}` stays a
    string (YAML would make it a mapping), `run_name=yes` stays "yes", and \\n / \\t in a string become a
    newline / tab.

    (transformers' HfArgumentParser parses `--key value` flags, not `key=value` overrides on top of a YAML file, so
    this small parser is ours.)
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and raw.strip().lower() in _NULLS:
            return None
        arms = [a for a in args if a is not type(None)]
        if bool in arms and raw.strip().lower() in _BOOLS:
            return _BOOLS[raw.strip().lower()]
        for arm in (a for a in arms if a is not str):
            try:
                return _coerce(key, _from_text(key, raw, arm), arm)
            except RecipeError:
                continue
        if str in arms:
            return _unescape(raw)
        raise RecipeError(f"recipe: {key}={raw!r} is not {' or '.join(_type_name(a) for a in arms)} (or null)")
    if hint is str or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return _unescape(raw)
    if hint is bool:
        if raw.strip().lower() in _BOOLS:
            return _BOOLS[raw.strip().lower()]
        raise RecipeError(f"recipe: {key}={raw!r} is not a bool; use true or false")
    if hint in (int, float):
        try:
            return hint(raw.strip())
        except ValueError:
            raise RecipeError(f"recipe: {key}={raw!r} is not {'an integer' if hint is int else 'a number'}") from None
    if origin is list or hint is list:
        if raw.strip().startswith("["):
            return _yaml_value(key, raw)
        return [v.strip() for v in raw.split(",") if v.strip()]
    return _yaml_value(key, raw)  # dicts and anything structured: YAML / JSON flow syntax


_BOOLS = {"true": True, "false": False, "yes": True, "no": False, "1": True, "0": False, "on": True, "off": False}


def _unescape(raw: str) -> str:
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], raw)


def _yaml_value(key: str, raw: str):
    try:
        return yaml.load(raw, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise RecipeError(f"recipe: {key}={raw!r} is not valid YAML/JSON ({first_line(err)})") from None


def parse_overrides(overrides: Sequence[str]) -> dict[str, str]:
    """`key=value` strings -> {key: raw text}; a key given twice is an error, not "the last one wins"."""
    out: dict[str, str] = {}
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"recipe override '{item}' is not key=value (e.g. max_steps=40)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if key in out:
            raise RecipeError(f"recipe override '{key}' is given twice ({out[key]!r} and {raw!r}); keep one")
        out[key] = raw
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with a repeated key (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            name = self.construct_object(key_node, deep=deep)
            if name in seen:
                raise RecipeError(
                    f"key '{name}' appears twice (lines {seen[name]} and {key_node.start_mark.line + 1}); keep one"
                )
            seen[name] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


# YAML 1.1 (PyYAML) reads 1e-5 as a string; learning rates are written that way, so read it as a float.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_recipe_file(path) -> dict:
    """The mapping of a recipe YAML file, or a RecipeError naming the file and the problem."""
    file = Path(path)
    if not file.is_file():
        raise RecipeError(f"recipe {path}: file not found; pass a recipe YAML such as recipes/tiny/bdlora.yaml")
    try:
        data = yaml.load(file.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except RecipeError as err:
        raise RecipeError(f"recipe {path}: {err}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise RecipeError(f"recipe {path}: invalid YAML ({first_line(err)})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path}: top level must be a mapping of key: value")
    return data


class Text(str):
    """An override's raw text, parsed by the field's type instead of by YAML."""


def typed_value(key: str, raw, hint):
    return _coerce(key, _from_text(key, raw, hint) if isinstance(raw, Text) else raw, hint)
