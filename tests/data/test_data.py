"""Data pipeline: sources, the formats practitioners bring, row checks, completion-only labels, chat masking,
truncation accounting, padding and packing."""

import json

import pytest
import torch

from bdlora_train.core.errors import DataError
from bdlora_train.data import formats as F
from bdlora_train.data import rows as D
from bdlora_train.data import sources as S
from bdlora_train.data import tokenize as T
from bdlora_train.models import build_tiny_model, tiny_tokenizer


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
    ids, labels = T.encode_completion(tok, "3+4=", "7")
    assert tok.decode(ids) == "3+4=7<|im_end|>"
    assert labels[:4] == [T.IGNORE_INDEX] * 4
    assert labels[4:] == ids[4:] and labels[-1] == tok.eos_token_id


def test_completion_that_already_ends_with_eos_gets_no_second_one(tok):
    ids, _ = T.encode_completion(tok, "a", "b<|im_end|>")
    assert ids.count(tok.eos_token_id) == 1


def test_chat_learns_only_assistant_turns(tok):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "double?"},
        {"role": "assistant", "content": "8"},
    ]
    ids, labels = T.encode_chat(tok, messages)
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
    learned = tok.decode([t for t, label in zip(ids, labels) if label != T.IGNORE_INDEX])
    # each assistant turn: its content and the end-of-turn marker (so the model learns to stop)
    assert learned == "4<|im_end|>\n8<|im_end|>\n"


def test_chat_without_assistant_turn_is_an_error(tok):
    with pytest.raises(DataError, match="no assistant turn"):
        T.encode_chat(tok, [{"role": "user", "content": "hi"}])


def test_tokenize_counts_truncated_and_dropped_rows_and_fails_past_the_limit(tok):
    from datasets import Dataset

    rows = Dataset.from_list(
        [{"prompt": "x" * 50, "completion": "y"}, {"prompt": "1+1=", "completion": "2" * 30}]
        + [{"prompt": "1+1=", "completion": "2"}] * 8
    )
    out, stats = T.tokenize(rows, tok, max_seq_length=20, max_dropped_fraction=0.1)
    assert (stats.rows, stats.truncated, stats.dropped) == (10, 2, 1)  # the long prompt is cut to nothing learned
    assert len(out) == 9 and max(len(r) for r in out["input_ids"]) == 20
    assert "1 dropped" in stats.summary("d", 20) and "2 truncated" in stats.summary("d", 20)
    with pytest.raises(DataError, match=r"1 of 10 rows have no completion token.*max_dropped_fraction=0.05"):
        T.tokenize(rows, tok, max_seq_length=20, max_dropped_fraction=0.05)
    with pytest.raises(DataError, match="raise max_seq_length"):
        T.tokenize(rows.select([0]), tok, max_seq_length=20)


def test_missing_columns_and_empty_dataset_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(DataError, match=r"columns \['answer', 'question'\] match no known format.*prompt_template"):
        D.load_rows(D.DataSpec(str(bad)))
    empty = tmp_path / "empty.csv"
    empty.write_text("prompt,completion\n")
    with pytest.raises(DataError, match="empty"):
        D.load_rows(D.DataSpec(str(empty)))
    with pytest.raises(DataError, match="file not found"):
        D.load_rows(D.DataSpec(str(tmp_path / "nope.jsonl")))
    with pytest.raises(DataError, match="packaged files are"):
        D.load_rows(D.DataSpec("packaged:nope.jsonl"))
    with pytest.raises(DataError, match="cannot load 'someone/not-cached'"):
        D.load_rows(D.DataSpec("someone/not-cached"))  # HF_HUB_OFFLINE=1 in tests: a Hub name that is not cached
    with pytest.raises(DataError, match="unknown GLUE task"):
        D.load_rows(D.DataSpec("glue:wnli"))


def test_local_formats_and_templates(tmp_path):
    import pandas as pd

    frame = pd.DataFrame({"question": ["2+2", "3+3"], "answer": [4, 6]})
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.to_parquet(tmp_path / "d.parquet")
    for name in ("d.csv", "d.parquet"):
        rows = D.load_rows(
            D.DataSpec(str(tmp_path / name), prompt_template="Q: {question}\nA:", completion_template=" {answer}")
        )
        assert rows[1] == {"prompt": "Q: 3+3\nA:", "completion": " 6"}
    with pytest.raises(DataError, match="uses field 'nope'"):
        D.load_rows(D.DataSpec(str(tmp_path / "d.csv"), prompt_template="{nope}", completion_template="{answer}"))


def test_glue_templates_verbalize_class_labels():
    from datasets import ClassLabel, Dataset, Features, Value

    features = Features(
        {"sentence": Value("string"), "label": ClassLabel(names=["negative", "positive"]), "idx": Value("int32")}
    )
    rows = Dataset.from_dict({"sentence": ["great film", "dull"], "label": [1, 0], "idx": [0, 1]}, features=features)
    out = F.apply_templates(rows, *S.GLUE_TASKS["sst2"], spec="glue:sst2")
    assert out[0] == {"prompt": "Review: great film\nSentiment:", "completion": " positive"}
    assert out[1]["completion"] == " negative"
    assert len(S.GLUE_TASKS) == 8 and "wnli" not in S.GLUE_TASKS


def test_packaged_datasets_load():
    sums = D.load_rows(D.DataSpec("packaged:tiny_sums.jsonl"))
    assert D.check_rows(sums, "sums") == "completion" and len(sums) == 200
    chat = D.load_rows(D.DataSpec("packaged:tiny_chat.jsonl", max_samples=5))
    assert D.check_rows(chat, "chat") == "chat" and len(chat) == 5


def test_missing_pad_token_falls_back_to_eos_and_oversized_vocab_is_refused(tok):
    import copy

    no_pad = copy.deepcopy(tok)
    no_pad.pad_token = None
    assert no_pad.pad_token_id is None
    T.prepare_tokenizer(no_pad)
    assert no_pad.pad_token_id == no_pad.eos_token_id
    small = build_tiny_model("llama", vocab_size=64)
    with pytest.raises(DataError, match="embeds only 64"):
        T.prepare_tokenizer(tok, small)


def test_packed_batch_has_the_same_loss_as_the_padded_batch(tok):
    """Packing must not let examples attend to each other: same loss, fewer tokens."""
    from datasets import Dataset

    rows = Dataset.from_list([{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in (3, 17, 250, 4096)])
    rows = F.to_canonical(rows, "prompt-completion", "rows")
    examples, _ = T.tokenize(rows, tok, max_seq_length=64)
    features = [examples[i] for i in range(len(examples))]
    model = build_tiny_model("llama")
    padded = T.collator(tok, packing=False)(features)
    packed = T.collator(tok, packing=True)(features)
    assert padded["input_ids"].shape[0] == 4 and packed["input_ids"].shape[0] == 1
    assert packed["input_ids"].numel() < padded["input_ids"].numel()
    assert (padded["labels"] != T.IGNORE_INDEX).sum() == (packed["labels"] != T.IGNORE_INDEX).sum()
    with torch.no_grad():
        loss_padded = model(**padded).loss
        # packed masks come from restarting position_ids, which transformers reads only without a KV cache
        loss_packed = model(**packed, use_cache=False).loss
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-5)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _learned(tok, example) -> str:
    return tok.decode([t for t, label in zip(example["input_ids"], example["labels"]) if label != T.IGNORE_INDEX])


def test_trl_and_axolotl_formats_become_the_right_learned_tokens(tmp_path, tok):
    text = D.load_rows(D.DataSpec(_jsonl(tmp_path / "t.jsonl", [{"text": "abc"}])))
    assert D.row_kind(text) == "text"
    (ex,), _ = T.tokenize(text, tok, 64)
    assert _learned(tok, ex) == "abc<|im_end|>"  # language modeling: every token learned

    convo = [{"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]}]
    rows = D.load_rows(D.DataSpec(_jsonl(tmp_path / "c.jsonl", convo)))
    assert rows[0]["learn_from"] == 1 and D.row_kind(rows) == "chat"
    (ex,), _ = T.tokenize(rows, tok, 64)
    assert _learned(tok, ex) == "4<|im_end|>\n"

    earlier = [
        {
            "prompt": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"},
            ],
            "completion": [{"role": "assistant", "content": "d"}],
        }
    ]
    (ex,), _ = T.tokenize(D.load_rows(D.DataSpec(_jsonl(tmp_path / "c2.jsonl", earlier))), tok, 64)
    assert _learned(tok, ex) == "d<|im_end|>\n"  # assistant turns inside the prompt are context, not targets

    alpaca = [
        {"instruction": "Add", "input": "2 2", "output": "4"},
        {"instruction": "Say hi", "input": "", "output": "hi"},
    ]
    rows = D.load_rows(D.DataSpec(_jsonl(tmp_path / "a.jsonl", alpaca)))
    assert rows[0]["prompt"] == F.ALPACA_PROMPT.format(instruction="Add", input="2 2") and rows[0]["completion"] == "4"
    assert rows[1]["prompt"] == F.ALPACA_PROMPT_NO_INPUT.format(instruction="Say hi")  # empty input: no Input block

    share = [
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello"},
            ]
        }
    ]
    rows = D.load_rows(D.DataSpec(_jsonl(tmp_path / "s.jsonl", share)))
    assert [m["role"] for m in rows[0]["messages"]] == ["system", "user", "assistant"]
    (ex,), _ = T.tokenize(rows, tok, 64)
    assert _learned(tok, ex) == "hello<|im_end|>\n"


def test_save_to_disk_directories_load(tmp_path):
    from datasets import Dataset, DatasetDict

    Dataset.from_list([{"prompt": "a", "completion": "b"}]).save_to_disk(str(tmp_path / "one"))
    assert D.load_rows(D.DataSpec(str(tmp_path / "one")))[0] == {"prompt": "a", "completion": "b"}
    DatasetDict({"train": Dataset.from_list([{"text": "x"}]), "test": Dataset.from_list([{"text": "y"}])}).save_to_disk(
        str(tmp_path / "dict")
    )
    assert D.load_rows(D.DataSpec(str(tmp_path / "dict"), split="test"))[0] == {"text": "y"}
    with pytest.raises(DataError, match=r"has splits \['test', 'train'\], not 'validation'"):
        D.load_rows(D.DataSpec(str(tmp_path / "dict"), split="validation"))


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": \n', r"line 2 is not valid JSON"),
        (b'{"prompt": "a", "completion": "b"}\n["not", "an", "object"]\n', r"line 2 is a JSON array"),
        (b'{"prompt": "a", "completion": "b"}\n{"prompt": "\xff\xfe", "completion": "b"}\n', r"line 2 is not UTF-8"),
        (b"", r"is empty \(0 rows\)"),
        (b'{"prompt": "a", "completion": null}\n', r"line 1: column 'completion' is null, not a string"),
        # rows are named by the line the file has them on: blank lines count as lines, hold no row
        (b'{"prompt": "a", "completion": "b"}\n\n{"prompt": "a", "completion": null}\n', r"line 3: column 'comp"),
        (b'{"prompt": "a", "completion": true}\n', r"line 1: column 'completion' is a JSON boolean true, not a string"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}\n', r"line 1: the conversation has no assistant turn"),
        (
            b'{"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}\n'
            b'{"conversations": [{"from": "robot", "value": "x"}]}\n',
            r"line 2: .*speaker 'robot'",
        ),
    ],
)
def test_bad_rows_are_named_by_file_line_row_and_column(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as err:
        D.load_rows(D.DataSpec(str(path)))
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_explicit_format_must_match_the_columns(tmp_path):
    path = _jsonl(tmp_path / "x.jsonl", [{"text": "abc"}])
    with pytest.raises(DataError, match=r"dataset_format=alpaca needs columns \['instruction', 'output'\]"):
        D.load_rows(D.DataSpec(path, dataset_format="alpaca"))


def test_csv_cells_are_text_as_written_and_bad_rows_are_named_by_data_row(tmp_path):
    path = tmp_path / "qa.csv"
    path.write_text('prompt,completion\n"Q: 70+4=",74\n"Q: 0+7=",007\n"Q: 1.5+1=",2.50\n')
    rows = D.load_rows(D.DataSpec(str(path)))  # pandas alone reads 74 as int, 007 as 7 and 2.50 as 2.5
    assert rows["completion"] == ["74", "007", "2.50"]
    path.write_text('prompt,completion\n"Q: 70+4=",74\n"Q: 1+1=",2\n"Q: 3+3=",\n"Q: 4+4=",8\n')
    with pytest.raises(DataError, match=r"qa.csv: data row 3: column 'completion' is an empty cell, not a string$"):
        D.load_rows(D.DataSpec(str(path)))  # pandas turns the column into floats (74.0) once one cell is empty
    path.write_text("question,score\nx,3\n")
    with pytest.raises(DataError, match=r"data row 1: the templates cannot format this row"):
        D.load_rows(D.DataSpec(str(path), prompt_template="{question}", completion_template=" {score:.1f}"))


def test_json_numbers_in_text_columns_are_learned_as_their_text(tmp_path):
    ints = _jsonl(tmp_path / "i.jsonl", [{"prompt": "70+4=", "completion": 74}, {"prompt": "1+1=", "completion": 2}])
    assert D.load_rows(D.DataSpec(ints))["completion"] == ["74", "2"]
    floats = _jsonl(tmp_path / "f.jsonl", [{"prompt": "a", "completion": 74}, {"prompt": "b", "completion": 2.5}])
    assert D.load_rows(D.DataSpec(floats))["completion"] == [
        "74",
        "2.5",
    ]  # one float makes the column float: 74 stays "74"
    mixed = _jsonl(tmp_path / "m.jsonl", [{"prompt": "a", "completion": "yes"}, {"prompt": 3, "completion": 42}])
    assert D.load_rows(D.DataSpec(mixed))[:] == {"prompt": ["a", "3"], "completion": ["yes", "42"]}
    alpaca = _jsonl(tmp_path / "a.jsonl", [{"instruction": "Add 2 and 2", "input": "", "output": 4}])
    assert D.load_rows(D.DataSpec(alpaca))[0]["completion"] == "4"


# ------------------------------------------------------------------ mixed columns: each row read as the file writes it

ODD = {
    "list": ["four"],
    "object": {"n": 4},
    "boolean": True,
}


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("kind", sorted(ODD))
def test_an_odd_value_among_texts_is_named_at_its_own_line_with_the_json_it_holds(tmp_path, where, kind):
    """`datasets` infers one type per column and casts every row to it, and the check then blamed line 1 for a type
    no line had (a list at line 6 among "2"s was reported as `line 1: ... is int '2'`)."""
    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(5)]
    at = {"first": 0, "middle": 2, "last": 4}[where]
    rows[at]["completion"] = ODD[kind]
    path = _jsonl(tmp_path / "mixed.jsonl", rows)
    shown = {
        "list": r'a JSON array \["four"\]',
        "object": r'a JSON object \{"n": 4\}',
        "boolean": "a JSON boolean true",
    }
    with pytest.raises(
        DataError, match=rf"mixed.jsonl: line {at + 1}: column 'completion' is {shown[kind]}, not a string$"
    ):
        D.load_rows(D.DataSpec(path))


def test_the_line_named_is_the_files_line_and_a_missing_column_is_named_as_missing(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text('{"prompt": "a", "completion": "1"}\n\n\n{"prompt": "b", "completion": "2"}\n{"prompt": "c"}\n')
    with pytest.raises(DataError, match=r"gaps.jsonl: line 5: has no column 'completion'$"):
        D.load_rows(D.DataSpec(str(path)))
    records = tmp_path / "r.json"
    records.write_text(json.dumps([{"prompt": "a", "completion": "true"}, {"prompt": "b", "completion": [7]}]))
    with pytest.raises(DataError, match=r"r.json: record 2: column 'completion' is a JSON array \[7\], not a string$"):
        D.load_rows(D.DataSpec(str(records)))


@pytest.mark.parametrize("text", ["true", "[1, 2]", "null", "{}", "74", "2.50", "NaN"])
def test_text_that_looks_like_another_type_trains_as_written_beside_a_number(tmp_path, text):
    """Four rows of text and one JSON number: the README's valid column (text, JSON numbers learned as their text),
    whatever the text looks like. `datasets` read "true" as a bool, "[1, 2]" as a list and "null" as missing."""
    rows = [{"prompt": f"q{i}", "completion": text} for i in range(4)] + [{"prompt": "q4", "completion": 74}]
    for name, write in (
        ("rows.jsonl", lambda p: _jsonl(p, rows)),
        ("rows.json", lambda p: p.write_text(json.dumps(rows))),
    ):
        write(tmp_path / name)
        loaded = D.load_rows(D.DataSpec(str(tmp_path / name)))
        assert loaded["completion"] == [text] * 4 + ["74"], name
        assert loaded.features["completion"].dtype == "string"


def test_json_numbers_are_learned_as_written_and_stay_numbers_for_a_format_spec(tmp_path):
    path = tmp_path / "n.jsonl"
    path.write_text(
        '{"prompt": "a", "completion": 2.50}\n{"prompt": "b", "completion": 1e3}\n{"prompt": 3, "completion": "x"}\n'
    )
    assert D.load_rows(D.DataSpec(str(path)))[:] == {"prompt": ["a", "b", "3"], "completion": ["2.50", "1e3", "x"]}
    path.write_text('{"q": "x", "score": 2.50}\n{"q": "y", "score": 4}\n')
    rows = D.load_rows(D.DataSpec(str(path), prompt_template="{q} {score}", completion_template=" {score:.1f}"))
    assert rows[:] == {"prompt": ["x 2.50", "y 4"], "completion": [" 2.5", " 4.0"]}


def test_conversational_rows_are_the_form_most_rows_have_and_the_odd_row_is_named(tmp_path):
    convo = {"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]}
    for at in (0, 2):
        rows = [dict(convo) for _ in range(3)]
        rows[at] = {"prompt": "2+2?", "completion": convo["completion"]}
        path = _jsonl(tmp_path / "c.jsonl", rows)
        with pytest.raises(DataError, match=rf"line {at + 1}: .*column 'prompt' is a JSON string \"2\+2\?\" where TRL"):
            D.load_rows(D.DataSpec(path))


@pytest.mark.parametrize(
    "cells",
    [
        ["74", "007", "2.50", "1e3", "-0", "0x1F"],
        ["NA", "null", "None", "NaN", "#N/A", "n/a"],
        ["true", "[1, 2]", "{}"],
    ],
)
def test_csv_cells_that_look_like_numbers_or_missing_values_are_the_text_they_hold(tmp_path, cells):
    path = tmp_path / "cells.csv"
    path.write_text(
        "prompt,completion\n"
        + "".join(f"q{i},{c if ',' not in c else repr(c).replace(chr(39), chr(34))}\n" for i, c in enumerate(cells))
    )
    assert D.load_rows(D.DataSpec(str(path)))["completion"] == cells


def test_csv_rows_with_another_number_of_cells_are_named(tmp_path):
    path = tmp_path / "wide.csv"
    path.write_text("prompt,completion\na,b\n\nc,d,e\n")
    with pytest.raises(DataError, match=r"wide.csv: data row 2 has 3 cells, the header names 2 columns"):
        D.load_rows(D.DataSpec(str(path)))
    path.write_text('prompt,completion\n"a, with a comma","multi\nline"\n')
    assert D.load_rows(D.DataSpec(str(path)))[0] == {"prompt": "a, with a comma", "completion": "multi\nline"}
    path.write_text('prompt,completion\na,b\n"c,"d\n')
    with pytest.raises(DataError, match=r"wide.csv: line 3 is not valid CSV \(',' expected after '\"'\)"):
        D.load_rows(D.DataSpec(str(path)))


def test_parquet_and_saved_datasets_keep_their_declared_features(tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"prompt": "a", "completion": 4}, {"prompt": "b", "completion": 5}]).to_parquet(
        str(tmp_path / "p.parquet")
    )
    assert D.load_rows(D.DataSpec(str(tmp_path / "p.parquet")))["completion"] == [
        "4",
        "5",
    ]  # int column: numbers as text
    Dataset.from_list([{"prompt": "a", "completion": True}]).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match=r"index 0: column 'completion' is bool 'True', not a string"):
        D.load_rows(D.DataSpec(str(tmp_path / "saved")))


def test_a_recipes_eval_data_is_its_validation_split_uncapped_with_the_training_datas_reading():
    """DataSpec.eval_of: the recipe's eval_dataset, split "validation", no max_train_samples cap; the seed, Hub config,
    templates and format of the training data."""
    from types import SimpleNamespace

    from bdlora_train.data.rows import DataSpec

    recipe = SimpleNamespace(
        dataset="glue:sst2", eval_dataset="my/eval", seed=7, dataset_config="cfg", dataset_split="train[:90%]",
        prompt_template="Q: {q}", completion_template="{a}", max_train_samples=100, dataset_format="completion",
    )
    assert DataSpec.train_of(recipe) == DataSpec(
        "glue:sst2", seed=7, config="cfg", split="train[:90%]", prompt_template="Q: {q}", completion_template="{a}",
        max_samples=100, dataset_format="completion",
    )
    assert DataSpec.eval_of(recipe) == DataSpec(
        "my/eval", seed=7, config="cfg", split="validation", prompt_template="Q: {q}", completion_template="{a}",
        max_samples=None, dataset_format="completion",
    )
