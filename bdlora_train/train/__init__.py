"""Training: a recipe in, a PEFT adapter out, on transformers' Trainer.

recipe.py   the `Recipe` dataclass (YAML keys), parsing, type checks, validation
data.py     any dataset -> prompt/completion or chat rows -> tokens with completion-only labels
trainer.py  atomic checkpoints and a complete adapter save under DDP / ZeRO-3 / FSDP
launch.py   launcher glue: env scoping, DeepSpeed / FSDP / world-size checks, wandb
run.py      `train(recipe)`: setup -> fit -> finalize
"""

from bdlora_train.errors import RecipeError
from bdlora_train.train.recipe import Recipe, load_recipe
from bdlora_train.train.run import TrainResult, train

__all__ = ["Recipe", "RecipeError", "TrainResult", "load_recipe", "train"]
