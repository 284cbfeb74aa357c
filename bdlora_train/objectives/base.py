"""`Objective`: the one type every training objective is (objectives/__init__.py lists them).

A run calls, in order: `check_recipe` (while the recipe loads), `config_class` (the TrainingArguments class),
`examples` (before the model loads), `make_trainer`, `train`, `metrics`; a card or summary written later, from
metrics.json alone, calls `card_lines`, `card_tags` and `result_text`. The defaults are the supervised objective's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerInputs:
    """What setup hands every objective's `make_trainer`: the adapted model and everything around it."""

    recipe: object
    model: object  # the PeftModel
    args: object  # the objective's TrainingArguments
    examples: object
    eval_examples: object
    tokenizer: object
    output_dir: object  # Path
    sharded: object = None  # a TP run's ShardedAdapter (tp_runtime/dispatch.py), else None


class Objective:
    name: str = ""  # the recipe's `objective:` value
    title: str = ""  # how the docs and messages name it
    recipe_keys: tuple[str, ...] = ()  # recipe keys only this objective reads: refused under another objective

    # --- the recipe ---
    def config_class(self) -> tuple[type, str]:
        """(the TrainingArguments class a recipe's pass-through keys are checked against and the run is configured
        with, how a message names it)."""
        from transformers import TrainingArguments

        return TrainingArguments, "transformers"

    def reserved_arg(self, key: str) -> str | None:
        """Why this objective's run sets a pass-through key itself (so a recipe may not), or None."""
        return None

    def check_recipe(self, recipe) -> None:
        """This objective's checks of a whole recipe, cheap, before anything loads."""

    def tokens_seen(self, recipe) -> str:
        """TrainingArguments' include_num_input_tokens_seen for this objective's batches."""
        return "all" if recipe.packing else "non_padding"

    # --- the run ---
    def examples(self, recipe, rows, eval_rows, tokenizer, spec: str, is_main: bool):
        """(train examples, eval examples or None) from canonical rows, as this objective's trainer reads them."""
        raise NotImplementedError

    def make_trainer(self, inputs: TrainerInputs):
        raise NotImplementedError

    def train(self, trainer, resume: str | None) -> tuple[object, float]:
        """trainer.train (resuming from `resume`), then the final evaluation when there is eval data, its result
        appended to the log history; (TrainOutput, wall seconds of the training alone)."""
        start = time.perf_counter()
        output = trainer.train(resume_from_checkpoint=resume)
        wall = time.perf_counter() - start
        if trainer.eval_dataset is not None:
            trainer.state.log_history.append(trainer.evaluate())
        return output, wall

    def metrics(self, recipe, trainer) -> dict:
        """This objective's part of metrics.json."""
        return {}

    # --- what is written from metrics.json ---
    def card_lines(self, metrics: dict) -> list[str]:
        """Model-card lines on how the objective trained (before the shared learning-rate and step lines)."""
        return []

    def card_tags(self) -> list[str]:
        return []

    def card_keys(self) -> tuple[tuple[str, str], ...]:
        """(metrics key, label) of the card's closing lines."""
        return (("steps", "training steps"), ("final_loss", "final training loss"), ("dataset", "dataset"))

    def result_text(self, metrics: dict) -> str:
        """What `bdlora train`'s summary line says the run reached."""
        loss = metrics.get("final_loss")
        return f"final loss {loss:.4f}" if loss is not None else "final loss n/a"
