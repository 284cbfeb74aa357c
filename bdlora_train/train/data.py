"""Training data: any source -> prompt/completion (or chat) rows -> token ids with completion-only labels.

Sources (the recipe's `dataset` key):
  task:<name>          a built-in task of the evaluation harness (analogies, news-ppl, arithmetic, ...)
  glue:<task>          a GLUE task from the Hub (nyu-mll/glue), verbalized as prompt -> label word
  packaged:<file>      a file shipped in bdlora_train/data/ (the tiny recipe's data)
  a local .jsonl/.json/.csv/.parquet file, or a Hub dataset name (online, or cached)
Rows need `prompt` + `completion` columns or a `messages` column (chat). Other column layouts are mapped with
`prompt_template` / `completion_template` (str.format over the row; ClassLabel columns also give `<col>_text`).

Loss is on completion tokens only: prompt and padding positions get label -100. Chat rows are rendered with
the tokenizer's chat template and only assistant turns are learned.
"""

from __future__ import annotations

from pathlib import Path

from bdlora_train.errors import DataError, first_line

PACKAGED_DIR = Path(__file__).parent.parent / "data"
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
IGNORE_INDEX = -100

# GLUE's 8 tasks of the paper's average (WNLI excluded, as usual): prompt template, completion template.
GLUE_TASKS = {
    "cola": ("Sentence: {sentence}\nIs this sentence grammatically acceptable?\nAnswer:", " {label_text}"),
    "sst2": ("Review: {sentence}\nSentiment:", " {label_text}"),
    "mrpc": (
        "Sentence 1: {sentence1}\nSentence 2: {sentence2}\nAre the sentences equivalent?\nAnswer:",
        " {label_text}",
    ),
    "qqp": (
        "Question 1: {question1}\nQuestion 2: {question2}\nAre the questions duplicates?\nAnswer:",
        " {label_text}",
    ),
    "stsb": ("Sentence 1: {sentence1}\nSentence 2: {sentence2}\nSimilarity from 0 to 5:", " {label:.1f}"),
    "mnli": (
        "Premise: {premise}\nHypothesis: {hypothesis}\nEntailment, neutral or contradiction?\nAnswer:",
        " {label_text}",
    ),
    "qnli": (
        "Question: {question}\nSentence: {sentence}\nDoes the sentence answer the question?\nAnswer:",
        " {label_text}",
    ),
    "rte": (
        "Sentence 1: {sentence1}\nSentence 2: {sentence2}\nDoes sentence 1 entail sentence 2?\nAnswer:",
        " {label_text}",
    ),
}


def load_rows(
    spec: str,
    seed: int = 0,
    config: str | None = None,
    split: str = "train",
    prompt_template: str | None = None,
    completion_template: str | None = None,
    max_samples: int | None = None,
):
    """A `datasets.Dataset` with prompt/completion or messages columns, checked and non-empty."""
    dataset = _load_source(spec, seed, config, split)
    if spec.startswith("glue:") and prompt_template is None and completion_template is None:
        prompt_template, completion_template = GLUE_TASKS[spec.split(":", 1)[1]]
    if prompt_template is not None or completion_template is not None:
        dataset = apply_templates(dataset, prompt_template, completion_template, spec)
    if max_samples is not None:
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    check_columns(dataset, spec)
    return dataset


def _load_source(spec: str, seed: int, config: str | None, split: str):
    import datasets

    if spec.startswith("task:"):
        from bdlora_train.evaluation.tasks import get_task  # lazy: the eval harness is optional for file datasets

        return get_task(spec.split(":", 1)[1]).train_dataset(seed)
    if spec.startswith("glue:"):
        task = spec.split(":", 1)[1]
        if task not in GLUE_TASKS:
            raise DataError(f"dataset {spec}: unknown GLUE task; use one of {sorted(GLUE_TASKS)}")
        return _load_hub("nyu-mll/glue", task, split, spec)
    if spec.startswith("packaged:"):
        path = PACKAGED_DIR / spec.split(":", 1)[1]
        if not path.is_file():
            known = sorted(p.name for p in PACKAGED_DIR.iterdir() if p.suffix in LOCAL_FORMATS)
            raise DataError(f"dataset {spec}: no such packaged file; packaged files are {known}")
        spec = str(path)
    path = Path(spec)
    if path.suffix in LOCAL_FORMATS:
        if not path.is_file():
            raise DataError(f"dataset {spec}: file not found; give an existing .jsonl/.json/.csv/.parquet path")
        try:
            return datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
        except Exception as err:  # datasets raises many types for malformed files
            raise DataError(
                f"dataset {spec}: cannot be read as {LOCAL_FORMATS[path.suffix]} ({first_line(err)})"
            ) from None
    if path.exists():
        raise DataError(f"dataset {spec}: unsupported file type; use .jsonl, .json, .csv or .parquet")
    return _load_hub(spec, config, split, spec)


def _load_hub(name: str, config: str | None, split: str, spec: str):
    import datasets

    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as err:  # offline, unknown name, unknown split: all surface here
        raise DataError(
            f"dataset {spec}: cannot load '{name}' (config {config}, split {split}) from the Hub or cache "
            f"({first_line(err)}); use task:<name>, packaged:<file> or a local .jsonl/.csv/.parquet file"
        ) from None


def apply_templates(dataset, prompt_template: str | None, completion_template: str | None, spec: str):
    """prompt/completion columns built from each row with str.format; ClassLabel columns add `<col>_text`."""
    from datasets import ClassLabel

    if prompt_template is None or completion_template is None:
        raise DataError(f"dataset {spec}: set both prompt_template and completion_template (one was given)")
    names = {col: feat.names for col, feat in dataset.features.items() if isinstance(feat, ClassLabel)}
    columns = list(dataset.column_names)

    def fields(row: dict) -> dict:
        out = dict(row)
        for col, labels in names.items():
            value = row[col]
            out[f"{col}_text"] = labels[value].replace("_", " ") if 0 <= value < len(labels) else str(value)
        return out

    if len(dataset):
        sample = fields(dataset[0])
        for label, template in (("prompt_template", prompt_template), ("completion_template", completion_template)):
            try:
                template.format(**sample)
            except (KeyError, IndexError) as err:
                raise DataError(
                    f"dataset {spec}: {label} uses field {err} that rows do not have; available: {sorted(sample)}"
                ) from None

    def render(row):
        values = fields(row)
        return {"prompt": prompt_template.format(**values), "completion": completion_template.format(**values)}

    return dataset.map(render, remove_columns=columns, desc="format")


def check_columns(dataset, spec: str) -> str:
    """'completion' or 'chat', or a DataError naming the columns found and the fix."""
    columns = set(dataset.column_names)
    if {"prompt", "completion"} <= columns:
        kind = "completion"
    elif "messages" in columns:
        kind = "chat"
    else:
        raise DataError(
            f"dataset {spec}: columns {sorted(columns)} have neither prompt+completion nor messages; rename "
            "them or set "
            "prompt_template and completion_template (e.g. prompt_template='{question}' completion_template=' "
            "{answer}')"
        )
    if len(dataset) == 0:
        raise DataError(f"dataset {spec}: is empty (0 rows); point `dataset` at data with at least one row")
    return kind


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


def encode_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a conversation: assistant turns learned, everything else masked.

    Rendered text is cut at the boundaries the template itself produces (conversation up to turn i with a
    generation prompt, then up to and including turn i), so any prefix-consistent chat template works.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {type(tokenizer).__name__}: has no chat_template; use prompt/completion rows instead"
        )
    if not messages or not any(m.get("role") == "assistant" for m in messages):
        raise DataError("messages: a conversation has no assistant turn to learn from")
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    full = render(messages, False)
    segments, pos = [], 0  # (text, learned?)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
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


def tokenize(dataset, tokenizer, max_seq_length: int, spec: str = "dataset"):
    """input_ids / attention_mask / labels, truncated to max_seq_length; rows with nothing to learn are dropped."""
    kind = check_columns(dataset, spec)

    def encode(batch):
        out = {"input_ids": [], "attention_mask": [], "labels": []}
        rows = batch["messages"] if kind == "chat" else zip(batch["prompt"], batch["completion"])
        for row in rows:
            ids, labels = encode_chat(tokenizer, row) if kind == "chat" else encode_completion(tokenizer, *row)
            ids, labels = ids[:max_seq_length], labels[:max_seq_length]
            out["input_ids"].append(ids)
            out["attention_mask"].append([1] * len(ids))
            out["labels"].append(labels)
        return out

    encoded = dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="tokenize")
    kept = encoded.filter(
        lambda labels: any(t != IGNORE_INDEX for t in labels), input_columns="labels", desc="drop empty"
    )
    if len(kept) == 0:
        raise DataError(
            f"dataset {spec}: no row has a completion token left within max_seq_length={max_seq_length}; raise "
            "max_seq_length"
        )
    return kept


def collator(tokenizer, packing: bool):
    """Dynamic padding per batch, or padding-free packing of the batch into one row (position_ids restart per row)."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

    if packing:
        # transformers derives a block-diagonal causal mask from the restarting position_ids (sdpa/eager/flash).
        return DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE_INDEX)
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
