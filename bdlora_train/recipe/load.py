"""Loading a recipe: a YAML file and `key=value` overrides -> a validated `Recipe` (recipe/schema.py).

Keys that are not Recipe fields but fields of the objective's TrainingArguments class (transformers', TRL's
GRPOConfig for GRPO) pass through to `training_args`, type-checked against that class; anything else is refused with
the closest valid key.
"""

from __future__ import annotations

import difflib
import functools
import typing
from collections.abc import Sequence

from bdlora_train.core.errors import RecipeError
from bdlora_train.objectives import NAMES as OBJECTIVES
from bdlora_train.objectives import objective_named
from bdlora_train.recipe.schema import SECTIONS, Recipe, RecipeKeys, recipe_fields, recipe_keys
from bdlora_train.recipe.text import Text, parse_overrides, read_recipe_file, typed_value

# TrainingArguments keys a recipe may not set: the run sets them itself, or they would break it or leak a secret.
RESERVED_TRAINING_ARGS = {
    "remove_unused_columns": "the collator needs the tokenized columns",
    "include_num_input_tokens_seen": "tokens/s in metrics.json needs it",
    "data_seed": "set seed instead",
    "save_strategy": "set save_steps (0: no checkpoints)",
    "hub_token": "tokens come from HF_TOKEN or `hf auth login`, never from a file",
    "overwrite_output_dir": "a run resumes from its output_dir; use resume_from_checkpoint=false to start over",
}


@functools.cache
def key_hints() -> dict:
    """{key: its type hint} for every key of every section and of the recipe itself."""
    hints = {}
    for cls in (*SECTIONS.values(), RecipeKeys):
        hints.update(typing.get_type_hints(cls))
    return hints


def _unknown_key(key: str, objective: str) -> RecipeError:
    for name in OBJECTIVES:  # another objective's pass-through key: say which objective reads it
        other = objective_named(name)
        if name != objective and _installed(other) and key in _training_args_hints(name):
            return RecipeError(
                f"recipe: {key} is a {other.title} key ({other.config_class()[1]}); add objective={name} to train "
                f"with {other.title}"
            )
    # The closest key of either kind; a small bonus for our own keys (lora_rank -> lora_r, not local_rank).
    scored = [(difflib.SequenceMatcher(None, key, k).ratio() + 0.05, k) for k in recipe_keys()]
    scored += [(difflib.SequenceMatcher(None, key, k).ratio(), k) for k in _training_args_hints(objective)]
    best = max(scored)
    close = [best[1]] if best[0] >= 0.6 else []
    hint = f"did you mean '{close[0]}'?" if close else "see `bdlora train --help` for all keys"
    return RecipeError(f"recipe: unknown key '{key}'; {hint}")


def _installed(objective) -> bool:
    """Whether the objective's trainer library is importable (TRL for GRPO)."""
    try:
        objective.config_class()
    except RecipeError:
        return False
    return True


@functools.cache
def _training_args_hints(objective: str) -> dict:
    """{name: type hint} of the fields a recipe may pass through: the objective's TrainingArguments class's
    (transformers', or TRL's GRPOConfig: TrainingArguments' plus GRPO's own: num_generations, beta, ...)."""
    config = objective_named(objective).config_class()[0]
    hints = typing.get_type_hints(config)
    return {k: v for k, v in hints.items() if k in config.__dataclass_fields__ and not k.startswith("_")}


def _reserved(key: str, objective: str) -> str | None:
    """Why a pass-through key is refused, or None."""
    if key in RESERVED_TRAINING_ARGS:
        return RESERVED_TRAINING_ARGS[key]
    return objective_named(objective).reserved_arg(key)


def load_recipe(path: str | None, overrides: Sequence[str] = ()) -> Recipe:
    """A Recipe from a YAML file (or none) plus `key=value` overrides, type-checked and validated.

    Keys that are not Recipe fields but are transformers.TrainingArguments fields go to `training_args`,
    type-checked against TrainingArguments; anything else is refused with the closest valid key.
    """
    data = read_recipe_file(path) if path is not None else {}
    data.update({k: v for k, v in (data.pop("training_args", None) or {}).items()})
    hints = key_hints()
    items = [*data.items(), *[(k, Text(v)) for k, v in parse_overrides(overrides).items()]]
    # the objective decides which pass-through keys exist (GRPOConfig's for grpo), so it is read first
    objective = typed_value("objective", dict(items).get("objective", _default("objective")), hints["objective"])
    objective_named(objective)  # one of the objectives, or refused in one line
    passthrough = _training_args_hints(objective)
    values: dict = {"training_args": {}}
    for key, raw in items:
        if key in hints and key != "training_args":
            values[key] = typed_value(key, raw, hints[key])
        elif key in passthrough:
            reason = _reserved(key, objective)
            if reason is not None:
                raise RecipeError(f"recipe: {key} is set by bdlora-train ({reason})")
            values["training_args"][key] = typed_value(key, raw, passthrough[key])
        else:
            raise _unknown_key(key, objective)
    _check_derived_keys(values)
    return Recipe(**values).validate()


def _check_derived_keys(values: dict) -> None:
    """A key that another key decides, given as well: refused when they disagree, instead of one silently ignored."""
    matched, ratio = values.get("match_budget_of_lora_rank"), values.get("lora_alpha_ratio")
    r = values.get("lora_r", _default("lora_r"))
    if matched is not None and values.get("lora_r") is not None:
        raise RecipeError(
            f"recipe: lora_r={r} and match_budget_of_lora_rank={matched} are both set; the rank comes from the budget "
            f"(the largest BD-LoRA rank with at most LoRA r={matched}'s parameters), so drop one"
        )
    alpha = values.get("lora_alpha")
    if ratio is None or alpha is None or (r is None and matched is None):  # a null lora_r: validate() says so
        return
    derived = ratio * r if matched is None else None
    if derived is None or abs(alpha - derived) > 1e-9 * max(1.0, abs(derived)):
        given = f"ratio x r = {derived:g}" if derived is not None else "ratio x the budget-matched rank"
        raise RecipeError(
            f"recipe: lora_alpha={alpha:g} and lora_alpha_ratio={ratio:g} are both set; with lora_alpha_ratio alpha is "
            f"{given}, so drop one"
        )


def _default(name: str):
    return next(f.default for f in recipe_fields() if f.name == name)
