"""Training: a recipe in, a PEFT adapter out, on transformers' Trainer.

recipe.py    the `Recipe` dataclass (YAML keys), ranges, validation; recipe_text.py parses YAML and key=value text;
             parallel_keys.py checks the model-parallel sizes against each other (and names the EP layouts that fit)
run_plan.py  `plan_run(recipe, model)`: the run's RunPlan (nblocks, r, targets, TP styles, budget, lr ratios, config)
methods.py   the PEFT config of each method (bdlora, lora, peft-bdlora); optim.py the bd_lr_ratio param groups
data.py      `load_rows(DataSpec)`: any dataset -> prompt/completion, chat or text rows, checked; data_sources.py
             reads a spec's source, data_formats.py converts the formats, written_rows.py reads local files as written;
             tokenize.py tokens with completion-only labels
trainer.py   atomic checkpoints and a complete adapter save under DDP / ZeRO-3 / FSDP
launch.py    the launch checks: world size, a rank dying with its launcher, the sharding that took effect;
             launch_command.py rebuilds the command that starts the run right, run_env.py scopes the environment
             (launch flags, wandb), deepspeed_setup.py DeepSpeed's JSON and CPU state, training_args.py the
             recipe as TrainingArguments
rundir.py    the output directory: lock, resume, staging names
run.py       `train(recipe)`: setup -> fit -> finalize
entry.py     the `bdlora train` command line, also `python -m bdlora_train.train` (torchrun, accelerate launch)

Names are imported on first use (PEP 562), so `python -m bdlora_train.train` reaches the error boundary
(core/boundary.py), which quiets optional libraries' import chatter, before PEFT and transformers load.
"""

import importlib

from bdlora_train.core.errors import RecipeError

_EXPORTS = {
    "Recipe": "bdlora_train.train.recipe",
    "load_recipe": "bdlora_train.train.recipe",
    "TrainResult": "bdlora_train.train.run",
    "train": "bdlora_train.train.run",
}
__all__ = ["Recipe", "RecipeError", "TrainResult", "load_recipe", "train"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bdlora_train.train' has no attribute {name!r}")


def __dir__():
    return __all__
