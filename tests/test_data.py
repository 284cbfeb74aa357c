"""Data pipeline: sources, column checks, completion-only labels, chat masking, padding and packing."""

import json

import pytest
import torch

from bdlora_train.errors import DataError
from bdlora_train.models import build_tiny_model, tiny_tokenizer
from bdlora_train.train import data as D


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_tiny_tokenizer_round_trips_and_fits_tiny_vocab(tok):
    text = "12+7=19\nHello, world!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert len(tok) <= build_tiny_model("llama").get_input_embeddings().num_embeddings
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id


def test_completion_labels_mask_prompt_and_end_with_eos(tok):
    ids, labels = D.encode_completion(tok, "3+4=", "7")
    assert tok.decode(ids) == "3+4=7<|im_end|>"
    assert labels[:4] == [D.IGNORE_INDEX] * 4
    assert labels[4:] == ids[4:] and labels[-1] == tok.eos_token_id


def test_completion_that_already_ends_with_eos_gets_no_second_one(tok):
    ids, _ = D.encode_completion(tok, "a", "b<|im_end|>")
    assert ids.count(tok.eos_token_id) == 1


def test_chat_learns_only_assistant_turns(tok):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "double?"},
        {"role": "assistant", "content": "8"},
    ]
    ids, labels = D.encode_chat(tok, messages)
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
    learned = tok.decode([t for t, label in zip(ids, labels) if label != D.IGNORE_INDEX])
    # each assistant turn: its content and the end-of-turn marker (so the model learns to stop)
    assert learned == "4<|im_end|>\n8<|im_end|>\n"


def test_chat_without_assistant_turn_is_an_error(tok):
    with pytest.raises(DataError, match="no assistant turn"):
        D.encode_chat(tok, [{"role": "user", "content": "hi"}])


def test_tokenize_truncates_and_drops_rows_without_completion_tokens(tok):
    from datasets import Dataset

    rows = Dataset.from_list([{"prompt": "x" * 50, "completion": "y"}, {"prompt": "1+1=", "completion": "2"}])
    out = D.tokenize(rows, tok, max_seq_length=20)
    assert len(out) == 1 and len(out[0]["input_ids"]) == 6
    with pytest.raises(DataError, match="raise max_seq_length"):
        D.tokenize(rows.select([0]), tok, max_seq_length=20)


def test_missing_columns_and_empty_dataset_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(DataError, match=r"columns \['answer', 'question'\].*prompt_template"):
        D.load_rows(str(bad))
    empty = tmp_path / "empty.csv"
    empty.write_text("prompt,completion\n")
    with pytest.raises(DataError, match="empty"):
        D.load_rows(str(empty))
    with pytest.raises(DataError, match="file not found"):
        D.load_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="packaged files are"):
        D.load_rows("packaged:nope.jsonl")
    with pytest.raises(DataError, match="cannot load 'someone/not-cached'"):
        D.load_rows("someone/not-cached")  # HF_HUB_OFFLINE=1 in tests: a Hub name that is not cached
    with pytest.raises(DataError, match="unknown GLUE task"):
        D.load_rows("glue:wnli")


def test_local_formats_and_templates(tmp_path):
    import pandas as pd

    frame = pd.DataFrame({"question": ["2+2", "3+3"], "answer": [4, 6]})
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.to_parquet(tmp_path / "d.parquet")
    for name in ("d.csv", "d.parquet"):
        rows = D.load_rows(str(tmp_path / name), prompt_template="Q: {question}\nA:", completion_template=" {answer}")
        assert rows[1] == {"prompt": "Q: 3+3\nA:", "completion": " 6"}
    with pytest.raises(DataError, match="uses field 'nope'"):
        D.load_rows(str(tmp_path / "d.csv"), prompt_template="{nope}", completion_template="{answer}")


def test_glue_templates_verbalize_class_labels():
    from datasets import ClassLabel, Dataset, Features, Value

    features = Features(
        {"sentence": Value("string"), "label": ClassLabel(names=["negative", "positive"]), "idx": Value("int32")}
    )
    rows = Dataset.from_dict({"sentence": ["great film", "dull"], "label": [1, 0], "idx": [0, 1]}, features=features)
    out = D.apply_templates(rows, *D.GLUE_TASKS["sst2"], spec="glue:sst2")
    assert out[0] == {"prompt": "Review: great film\nSentiment:", "completion": " positive"}
    assert out[1]["completion"] == " negative"
    assert len(D.GLUE_TASKS) == 8 and "wnli" not in D.GLUE_TASKS


def test_packaged_datasets_load():
    sums = D.load_rows("packaged:tiny_sums.jsonl")
    assert D.check_columns(sums, "sums") == "completion" and len(sums) == 200
    chat = D.load_rows("packaged:tiny_chat.jsonl", max_samples=5)
    assert D.check_columns(chat, "chat") == "chat" and len(chat) == 5


def test_missing_pad_token_falls_back_to_eos_and_oversized_vocab_is_refused(tok):
    import copy

    no_pad = copy.deepcopy(tok)
    no_pad.pad_token = None
    assert no_pad.pad_token_id is None
    D.prepare_tokenizer(no_pad)
    assert no_pad.pad_token_id == no_pad.eos_token_id
    small = build_tiny_model("llama", vocab_size=64)
    with pytest.raises(DataError, match="embeds only 64"):
        D.prepare_tokenizer(tok, small)


def test_packed_batch_has_the_same_loss_as_the_padded_batch(tok):
    """Packing must not let examples attend to each other: same loss, fewer tokens."""
    from datasets import Dataset

    rows = Dataset.from_list([{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in (3, 17, 250, 4096)])
    examples = D.tokenize(rows, tok, max_seq_length=64)
    features = [examples[i] for i in range(len(examples))]
    model = build_tiny_model("llama")
    padded = D.collator(tok, packing=False)(features)
    packed = D.collator(tok, packing=True)(features)
    assert padded["input_ids"].shape[0] == 4 and packed["input_ids"].shape[0] == 1
    assert packed["input_ids"].numel() < padded["input_ids"].numel()
    assert (padded["labels"] != D.IGNORE_INDEX).sum() == (packed["labels"] != D.IGNORE_INDEX).sum()
    with torch.no_grad():
        loss_padded = model(**padded).loss
        # packed masks come from restarting position_ids, which transformers reads only without a KV cache
        loss_packed = model(**packed, use_cache=False).loss
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-5)
