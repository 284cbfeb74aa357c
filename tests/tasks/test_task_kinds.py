"""tasks.kinds: Task, GenerationTask, PerplexityTask and the deterministic split helpers."""

import pytest
import torch

from bdlora_train.core.errors import BlockDiagLoraError, TaskError
from bdlora_train.models import build_tiny_model, tiny_tokenizer
from bdlora_train.tasks.kinds import GenerationTask, PerplexityTask, Task, carve_validation, hash_order

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(6)]


def _refused(call, *parts):
    with pytest.raises(TaskError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, (part, message)
    assert isinstance(info.value, BlockDiagLoraError)


# --------------------------------------------------------------------------------------------- split helpers


def test_hash_order_is_a_permutation_fixed_by_the_salt_alone():
    items = [f"row{i}" for i in range(20)]
    ordered = hash_order(items, str, "salt")
    assert sorted(ordered) == sorted(items) and ordered != items
    assert hash_order(list(reversed(items)), str, "salt") == ordered  # input order does not matter
    torch.manual_seed(123)
    assert hash_order(items, str, "salt") == ordered  # nor does any RNG state
    assert hash_order(items, str, "pepper") != ordered


def test_carve_validation_takes_n_rows_and_keeps_train_in_order():
    rows = list(range(10))
    train, validation = carve_validation(rows, str, "s", 3)
    assert len(validation) == 3 and len(train) == 7
    assert sorted(train + validation) == rows and not set(train) & set(validation)
    assert train == sorted(train) and validation == sorted(validation)  # original order, not hash order
    assert carve_validation(rows, str, "s", 3) == (train, validation)


def test_carve_validation_per_group():
    rows = list(range(10))
    train, validation = carve_validation(rows, str, "s", 2, by=lambda r: r % 2)
    assert len(validation) == 4 and sum(v % 2 for v in validation) == 2  # two odd, two even
    assert len(train) == 6


def test_carve_validation_of_more_rows_than_a_group_has_takes_the_group():
    train, validation = carve_validation([1, 2], str, "s", 5)
    assert (train, validation) == ([], [1, 2])


# -------------------------------------------------------------------------------------------- GenerationTask


def test_generation_task_splits():
    task = GenerationTask("sums", ROWS[:4], ROWS[4:], validation_rows=ROWS[:1])
    assert task.splits == ("validation", "test")
    assert task.split_sizes() == {"train": 4, "validation": 1, "test": 2}
    assert repr(task) == "GenerationTask('sums')"
    plain = GenerationTask("sums", ROWS[:4], ROWS[4:])
    assert plain.splits == ("test",) and plain.split_sizes()["validation"] == 0


def test_generation_task_refuses_an_unknown_match_mode():
    _refused(lambda: GenerationTask("sums", ROWS, ROWS, match="fuzzy"), "task sums: match 'fuzzy'", "first_word")


@pytest.mark.parametrize(
    "train, test, validation, counts",
    [([], ROWS, None, "(0 train, 0 validation, 6 test rows)"), (ROWS, [], None, "(6 train, 0 validation, 0 test rows)"),
     (ROWS, ROWS, [], "(6 train, 0 validation, 6 test rows)")],
)  # fmt: skip
def test_generation_task_refuses_an_empty_split(train, test, validation, counts):
    _refused(lambda: GenerationTask("sums", train, test, validation_rows=validation), "task sums: empty split", counts)


def test_generation_task_train_dataset_is_shuffled_by_the_seed():
    task = GenerationTask("sums", ROWS, ROWS[:1])
    first = task.train_dataset(seed=0).to_list()
    assert sorted(r["prompt"] for r in first) == sorted(r["prompt"] for r in ROWS)
    assert task.train_dataset(seed=0).to_list() == first
    assert [task.train_dataset(seed=s).to_list() for s in range(1, 5)] != [first] * 4
    assert task.test_dataset().to_list() == [{"category": "all", **ROWS[0]}]


class _Scripted(GenerationTask):
    """The model's answers scripted: evaluate's split choice, per-category limit and scoring are what is tested."""

    answers = {}
    asked = []

    def generate(self, model, tokenizer, prompts, batch_size=32, progress=False):
        self.asked = list(prompts)
        return [self.answers[p] for p in prompts]


def test_generation_task_evaluate_scores_the_chosen_split_with_a_per_category_limit():
    test = [
        {"prompt": "a1", "completion": "x", "category": "a"},
        {"prompt": "a2", "completion": "y", "category": "a"},
        {"prompt": "b1", "completion": "z", "category": "b"},
        {"prompt": "b2", "completion": "w", "category": "b"},
    ]
    task = _Scripted("t", ROWS, test, validation_rows=[{"prompt": "v", "completion": "ok"}])
    task.answers = {"a1": "x", "a2": "no", "b1": "no", "b2": "w", "v": "ok"}
    full = task.evaluate(None, None)
    assert task.asked == ["a1", "a2", "b1", "b2"] and full["accuracy"] == pytest.approx(50.0)
    limited = task.evaluate(None, None, limit=1)
    assert task.asked == ["a1", "b1"] and limited["accuracy"] == pytest.approx(50.0)  # a1 right, b1 wrong
    assert task.evaluate(None, None, split="validation")["accuracy"] == pytest.approx(100.0)


def test_evaluate_refuses_a_split_the_task_does_not_have():
    task = _Scripted("t", ROWS, ROWS)
    _refused(lambda: task.evaluate(None, None, split="validation"), "task t: no 'validation' split", "['test']")
    _refused(lambda: task.evaluate(None, None, split="train"), "no 'train' split")


def test_generation_needs_a_tokenizer():
    task = GenerationTask("sums", ROWS, ROWS)
    _refused(
        lambda: task.generate(build_tiny_model("llama"), None, ["1+1="]), "task sums: evaluation needs a tokenizer"
    )


def test_generate_restores_the_tokenizer_padding_side_and_the_training_mode():
    model, tokenizer = build_tiny_model("llama"), tiny_tokenizer()
    tokenizer.padding_side = "right"
    model.train()
    task = GenerationTask("sums", ROWS, ROWS, max_new_tokens=3)
    outputs = task.generate(model, tokenizer, ["1+1=", "10+10=", "3+4="], batch_size=2)
    assert len(outputs) == 3 and all(isinstance(o, str) for o in outputs)
    assert tokenizer.padding_side == "right" and model.training


# -------------------------------------------------------------------------------------------- PerplexityTask


def test_passages_cut_at_sentence_ends():
    task = PerplexityTask("news", ["One two three. Four five six. Seven."], ["x y"], passage_words=5)
    # "One two three." (3 words) + "Four five six." (3) would be 6 > 5: a new passage; "Seven." fits (4 <= 5)
    assert task.passages() == ["One two three.", "Four five six. Seven."]
    rows = task.train_dataset().to_list()
    assert sorted(r["completion"] for r in rows) == sorted(task.passages()) and {r["prompt"] for r in rows} == {""}
    assert task.test_dataset().to_list() == [{"text": "x y"}]


def test_a_sentence_longer_than_a_passage_stays_whole():
    task = PerplexityTask("news", ["a b c d e f g. h."], ["x"], passage_words=3)
    assert task.passages() == ["a b c d e f g.", "h."]


def test_perplexity_of_a_model_with_uniform_logits_is_the_vocabulary_size():
    model = build_tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: each of the 256 tokens has probability 1/256
    # 10 characters -> 10 tokens (no special tokens), windows of 4: [4, 4, 2] -> 3 + 3 + 1 = 7 scored tokens
    task = PerplexityTask("news", ["train text."], ["abcdefghij"], eval_seq_len=4)
    result = task.evaluate(model, tiny_tokenizer(), batch_size=2)
    assert result["n_tokens"] == 7
    assert result["perplexity"] == pytest.approx(256.0, rel=1e-4)
    assert result["loss"] == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=1e-5)


def test_perplexity_task_refuses_empty_documents():
    _refused(lambda: PerplexityTask("news", [], ["x"]), "task news: empty split", "documents")
    task = PerplexityTask("news", ["a."], ["b."])
    assert (task.primary_metric, task.higher_is_better) == ("perplexity", False)
    _refused(lambda: task.evaluate(build_tiny_model("llama"), None), "evaluation needs a tokenizer")


def test_base_task_is_an_interface():
    task = Task()
    with pytest.raises(NotImplementedError):
        task.train_dataset()
    with pytest.raises(NotImplementedError):
        task.split_sizes()
