"""Training: a recipe in, a PEFT adapter out, on transformers' Trainer (or TRL's, per objective).

entry.py          the `bdlora train` command line, also `python -m bdlora_train.train` (torchrun, accelerate launch);
                  the launch checks before anything loads
run.py            `train(recipe)`: setup -> objective.train -> finalize (adapter, model card, metrics.json, recipe.yaml)
setup.py          the checks, the training arguments, the tokenizer and data, the base, the PEFT model, the trainer
push.py           an adapter and its Hub card pushed, recorded in metrics.json
rundir.py         the output directory: lock, resume, staging names
run_plan.py       `plan_run(recipe, model)`: the run's RunPlan (nblocks, r, targets, TP styles, budget, lr ratios)
training_args.py  the recipe as the objective's TrainingArguments

The recipe is recipe/, the data data/, the objectives (supervised, GRPO) objectives/, the Trainer mixins trainer/,
the launch checks and environment launch/.

Names are imported on first use (PEP 562), so `python -m bdlora_train.train` reaches the error boundary
(core/boundary.py), which quiets optional libraries' import chatter, before PEFT and transformers load.
"""

import importlib

from bdlora_train.core.errors import RecipeError

_EXPORTS = {
    "TrainResult": "bdlora_train.train.run",
    "train": "bdlora_train.train.run",
}
__all__ = ["Recipe", "RecipeError", "TrainResult", "load_recipe", "train"]


def __getattr__(name: str):
    if name in ("Recipe", "load_recipe"):  # the recipe's own package (recipe/), re-exported here
        from bdlora_train.recipe import load, schema

        return schema.Recipe if name == "Recipe" else load.load_recipe
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bdlora_train.train' has no attribute {name!r}")


def __dir__():
    return __all__
