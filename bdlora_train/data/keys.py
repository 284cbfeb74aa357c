"""The recipe's data section: which rows a run reads and how they become examples (docs/training.md, "Data")."""

from __future__ import annotations

from dataclasses import dataclass

from bdlora_train.core.errors import RecipeError
from bdlora_train.core.keys import check_fields, key


@dataclass
class DataKeys:
    """The recipe's data section: which rows a run reads and how they become examples."""

    dataset: str = key(
        "task:analogies",
        "task:<name> | glue:<task> | packaged:<file> | local .jsonl/.json/.csv/.parquet | save_to_disk dir | Hub name",
    )
    dataset_format: str = key(
        "auto",
        "auto (from the columns) | prompt-completion | messages | text | alpaca | sharegpt",
        choices=("auto", "prompt-completion", "messages", "text", "alpaca", "sharegpt"),
    )
    dataset_config: str | None = key(None, "Hub dataset config name")
    dataset_split: str = key("train", "split of a Hub dataset")
    prompt_template: str | None = key(None, "str.format over a row, for datasets without prompt/completion columns")
    completion_template: str | None = key(None, "str.format over a row: the completion (learned) text")
    max_train_samples: int | None = key(None, "use at most this many training rows", low=1)
    max_seq_length: int = key(512, "tokens per example; longer rows are truncated", low=1)
    max_dropped_fraction: float = key(
        0.05,
        "fail when more than this fraction of rows has no completion token left after truncation",
        low=0,
        high=1,
    )
    eval_dataset: str | None = key(None, "evaluation data (same forms as dataset); eval loss goes to metrics.json")
    eval_fraction: float | None = key(
        None,
        "carve this fraction of the training rows out as evaluation data (deterministic)",
        low=1e-9,
        high=1,
        high_open=True,
    )
    packing: bool = key(False, "padding-free: each batch is one row, position_ids restart per example")

    def check(self) -> None:
        check_fields(self)
        if self.eval_dataset and self.eval_fraction:
            raise RecipeError("recipe: eval_dataset and eval_fraction are both set; pick one source of evaluation data")
