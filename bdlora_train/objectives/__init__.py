"""Training objectives: what a run optimizes, one type each (base.py `Objective`).

An objective owns its recipe keys and their checks, the class its training arguments are (transformers'
TrainingArguments, TRL's GRPOConfig), what its examples are, its trainer, how it trains, its metrics and its lines in
the model card and the summary. train/run.py reads setup -> objective.train -> finalize and compares no objective name.

supervised.py  `objective: sft`: the loss on completion tokens (transformers' Trainer)
grpo.py        `objective: grpo`: reinforcement learning with verifiable rewards (TRL's GRPOTrainer; its rewards,
               rollouts, rollout server and diagnostics live in rl/)

Adding one (DPO, say): a module here defining an `Objective` subclass as `OBJECTIVE`, and its name below. Modules are
imported on first use: reading a recipe does not import TRL.
"""

from __future__ import annotations

import importlib

from bdlora_train.core.errors import RecipeError

MODULES = {
    "sft": "bdlora_train.objectives.supervised",
    "grpo": "bdlora_train.objectives.grpo",
}
NAMES = tuple(MODULES)
DEFAULT = "sft"


def objective_named(name: str | None):
    """The `Objective` a recipe's (or a metrics.json's) `objective` names; None: the default, which runs written
    before the key was recorded trained with."""
    name = DEFAULT if name is None else name
    if name not in MODULES:
        raise RecipeError(f"recipe: objective={name!r}; use one of {list(NAMES)}")
    return importlib.import_module(MODULES[name]).OBJECTIVE
