"""`objective: sft` (the default): supervised fine-tuning, the loss on completion tokens only, on transformers'
Trainer with the toolkit's atomic checkpoints (trainer/mixins.py) and, under TP, the sharded adapter's state."""

from __future__ import annotations

import sys

from bdlora_train.data.tokenize import collator, tokenize
from bdlora_train.objectives.base import Objective, TrainerInputs
from bdlora_train.trainer.mixins import make_trainer_class


class Supervised(Objective):
    name = "sft"
    title = "supervised fine-tuning"

    def examples(self, recipe, rows, eval_rows, tokenizer, spec: str, is_main: bool):
        """Token ids with completion-only labels; what truncation did, said out loud."""
        examples, stats = tokenize(rows, tokenizer, recipe.max_seq_length, spec, recipe.max_dropped_fraction)
        if is_main and (stats.truncated or stats.dropped):
            print(f"bdlora train: {stats.summary(spec, recipe.max_seq_length)}", file=sys.stderr)
        eval_examples = None
        if eval_rows is not None:
            eval_examples = tokenize(eval_rows, tokenizer, recipe.max_seq_length, "eval data", 1.0)[0]
        return examples, eval_examples

    def make_trainer(self, inputs: TrainerInputs):
        sharded = inputs.sharded
        return make_trainer_class(tensor_parallel=sharded is not None)(
            **({} if sharded is None else {"sharded_adapter": sharded}),
            model=inputs.model,
            args=inputs.args,
            train_dataset=inputs.examples,
            eval_dataset=inputs.eval_examples,
            data_collator=collator(inputs.tokenizer, inputs.recipe.packing),
            processing_class=inputs.tokenizer,
        )


OBJECTIVE = Supervised()
