"""Rows -> token ids with completion-only labels, and the collator that batches them.

Loss is on completion tokens only: prompt and padding positions get label -100. Chat rows are rendered with the
tokenizer's chat template and only the assistant turns to be learned are. Text rows learn every token.
"""

from __future__ import annotations

from dataclasses import dataclass

from bdlora_train.core.errors import DataError
from bdlora_train.data.rows import row_kind

IGNORE_INDEX = -100


def prepare_tokenizer(tokenizer, model=None):
    """Give the tokenizer a pad token (its EOS) when it has none; refuse ones that cannot end a completion."""
    if tokenizer is None:
        raise DataError("tokenizer: the model spec gave no tokenizer; use a model directory or Hub id that has one")
    if tokenizer.eos_token_id is None:
        raise DataError(
            f"tokenizer {type(tokenizer).__name__}: has no eos_token, so completions cannot end; set "
            "tokenizer.eos_token"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe: padding is masked by attention_mask and labels -100
    if model is not None:
        rows = model.get_input_embeddings().num_embeddings  # not weight.shape: ZeRO-3 partitions it to 0
        if len(tokenizer) > rows:
            raise DataError(
                f"tokenizer: has {len(tokenizer)} tokens but the model embeds only {rows}; use the model's own "
                "tokenizer"
            )
    return tokenizer


def encode_completion(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels): prompt tokens masked, completion + EOS learned."""
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]  # BOS etc. as the model expects
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if not completion_ids or completion_ids[-1] != tokenizer.eos_token_id:
        completion_ids = completion_ids + [tokenizer.eos_token_id]
    return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids


def encode_chat(tokenizer, messages: list[dict], learn_from: int = 0) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a conversation: assistant turns at index >= learn_from learned, the rest masked.

    Rendered text is cut at the boundaries the template itself produces (conversation up to turn i with a
    generation prompt, then up to and including turn i), so any prefix-consistent chat template works.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {type(tokenizer).__name__}: has no chat_template; use prompt/completion rows instead"
        )
    if not any(m.get("role") == "assistant" for m in messages[learn_from:]):
        raise DataError("messages: a conversation has no assistant turn to learn from")
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    full = render(messages, False)
    segments, pos = [], 0  # (text, learned?)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant" or i < learn_from:
            continue
        start, end = render(messages[:i], True), render(messages[: i + 1], False)
        if not (full.startswith(start) and full.startswith(end) and len(start) >= pos):
            raise DataError(
                "tokenizer chat_template: rendering is not prefix-consistent across turns; "
                "use prompt/completion rows for this tokenizer"
            )
        segments += [(full[pos : len(start)], False), (full[len(start) : len(end)], True)]
        pos = len(end)
    segments.append((full[pos:], False))
    input_ids, labels = [], []
    for text, learned in segments:
        if not text:
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        input_ids += ids
        labels += ids if learned else [IGNORE_INDEX] * len(ids)
    return input_ids, labels


@dataclass
class TokenStats:
    """What tokenization did to the rows: said out loud, never silently."""

    rows: int
    truncated: int  # rows cut at max_seq_length (their tail is not learned)
    dropped: int  # rows with no learned token left after the cut

    def summary(self, spec: str, max_seq_length: int) -> str:
        return (
            f"data {spec}: {self.rows:,} rows; {self.truncated:,} truncated to max_seq_length={max_seq_length}; "
            f"{self.dropped:,} dropped (no completion token left)"
        )


def tokenize(dataset, tokenizer, max_seq_length: int, spec: str = "dataset", max_dropped_fraction: float = 1.0):
    """(examples, stats): input_ids / attention_mask / labels cut at max_seq_length; rows with nothing left to learn
    are dropped, and more than `max_dropped_fraction` of them dropped is an error."""
    kind = row_kind(dataset)

    def encode(batch):
        out = {"input_ids": [], "attention_mask": [], "labels": [], "truncated": [], "first_learned": []}
        for row in _rows(batch, kind):
            ids, labels = encode_row(tokenizer, kind, row)
            out["truncated"].append(len(ids) > max_seq_length)
            out["first_learned"].append(next((i for i, t in enumerate(labels) if t != IGNORE_INDEX), len(labels)))
            ids, labels = ids[:max_seq_length], labels[:max_seq_length]
            out["input_ids"].append(ids)
            out["attention_mask"].append([1] * len(ids))
            out["labels"].append(labels)
        return out

    encoded = dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="tokenize")
    truncated = sum(encoded["truncated"])
    kept = encoded.filter(
        lambda labels: any(t != IGNORE_INDEX for t in labels), input_columns="labels", desc="drop empty"
    ).remove_columns(["truncated", "first_learned"])
    stats = TokenStats(rows=len(encoded), truncated=truncated, dropped=len(encoded) - len(kept))
    if len(kept) == 0 or stats.dropped > max_dropped_fraction * stats.rows:
        starts = sorted(start for start in encoded["first_learned"] if start >= max_seq_length)
        span = f"; their prompts take {starts[0]:,} to {starts[-1]:,} tokens" if starts else ""
        raise DataError(
            f"dataset {spec}: {stats.dropped} of {stats.rows} rows have no completion token left within "
            f"max_seq_length={max_seq_length} (limit max_dropped_fraction={max_dropped_fraction:g}{span}); raise "
            "max_seq_length or shorten the prompts"
        )
    return kept, stats


def _rows(batch: dict, kind: str):
    if kind == "completion":
        return zip(batch["prompt"], batch["completion"])
    if kind == "chat":
        return zip(batch["messages"], batch["learn_from"])
    return batch["text"]


def encode_row(tokenizer, kind: str, row) -> tuple[list[int], list[int]]:
    if kind == "completion":
        return encode_completion(tokenizer, *row)
    if kind == "chat":
        return encode_chat(tokenizer, *row)
    return encode_text(tokenizer, row)


def encode_text(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of plain text: every token learned, EOS appended (language modeling)."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if not ids or ids[-1] != tokenizer.eos_token_id:
        ids = ids + [tokenizer.eos_token_id]
    return ids, list(ids)


def collator(tokenizer, packing: bool):
    """Dynamic padding per batch, or padding-free packing of the batch into one row (position_ids restart per row)."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

    if packing:
        # transformers derives a block-diagonal causal mask from the restarting position_ids (sdpa/eager/flash).
        return DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX)
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
