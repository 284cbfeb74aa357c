"""Task loaders, deterministic splits, plugins, and batched evaluation checked against unbatched references."""

import json
import math
import re

import pytest
import torch

from bdlora_train.core.errors import TaskError
from bdlora_train.models import build_tiny_model, tiny_tokenizer
from bdlora_train.tasks import GenerationTask, PerplexityTask, get_task
from bdlora_train.tasks import builtin as tasks


@pytest.fixture(scope="module")
def analogies():
    return get_task("analogies")


def test_analogies_loader_reads_the_word2vec_set():
    rows = tasks.load_analogies()
    assert len(rows) == 19544
    assert len({r["category"] for r in rows}) == 14
    assert rows[0] == {
        "prompt": "Athens is to Greece as Baghdad is to",
        "completion": " Iraq",
        "category": "capital-common-countries",
    }


def test_analogies_split_is_fixed_and_disjoint(analogies):
    test = analogies.test_dataset()
    assert len(test) == 14 * 20
    counts = {}
    for cat in test["category"]:
        counts[cat] = counts.get(cat, 0) + 1
    assert set(counts.values()) == {20}
    again = get_task("analogies")
    assert again.test_dataset()["prompt"] == test["prompt"]
    train = analogies.train_dataset(seed=0)
    distinct = {(r["prompt"], r["completion"]) for r in tasks.load_analogies()}
    assert len(distinct) == 19544 - 171  # the two capital categories share 171 questions
    assert len(train) == len(distinct) - 280 - 280  # 20 test and 20 validation questions per category
    assert len(set(zip(train["prompt"], train["completion"]))) == len(train)
    held = set(zip(test["prompt"], test["completion"]))
    assert not held & set(zip(train["prompt"], train["completion"]))


def test_validation_split_is_carved_from_training_data_disjoint_and_fixed(analogies):
    val = [(r["prompt"], r["completion"]) for r in analogies._validation]
    test = {(r["prompt"], r["completion"]) for r in analogies._test}
    train = {(r["prompt"], r["completion"]) for r in analogies._train}
    assert len(val) == len(set(val)) == 280
    assert {r["category"] for r in analogies._validation} == {r["category"] for r in analogies._test}
    assert not set(val) & test and not set(val) & train
    assert analogies.splits == ("validation", "test")
    assert [r["prompt"] for r in get_task("analogies")._validation] == [v[0] for v in val]
    # Not the test questions' hash order: a different salt picks different questions than test would.
    assert analogies.split_sizes() == {"train": len(train), "validation": 280, "test": 280}
    none = get_task("analogies", validation_per_category=0)
    assert none.splits == ("test",) and none._test == analogies._test and len(none._train) == len(train) + 280
    with pytest.raises(TaskError, match="no 'validation' split"):
        none.evaluate(None, None, split="validation")


def test_training_seed_shuffles_but_never_changes_the_split(analogies):
    a, b, a2 = analogies.train_dataset(seed=0), analogies.train_dataset(seed=1), analogies.train_dataset(seed=0)
    assert a["prompt"] == a2["prompt"]
    assert a["prompt"] != b["prompt"]
    assert sorted(a["prompt"]) == sorted(b["prompt"])
    assert set(a.column_names) == {"prompt", "completion"}
    assert all(c.startswith(" ") and not c.endswith("<|im_end|>") for c in a["completion"][:50])


def test_split_does_not_depend_on_file_order(tmp_path, analogies):
    lines = []
    for cat in ("family", "currency"):
        rows = [r for r in tasks.load_analogies() if r["category"] == cat]
        lines.append(f": {cat}")
        for r in reversed(rows):  # reversed order in the file
            a, _, _, b, _, c, _, _ = r["prompt"].split(" ")
            lines.append(f"{a} {b} {c} {r['completion'].strip()}")
    path = tmp_path / "q.txt"
    path.write_text("\n".join(lines) + "\n")
    small = tasks.analogies(path=path)
    expected = [r for r in analogies._test if r["category"] in ("family", "currency")]
    assert sorted(r["prompt"] for r in small._test) == sorted(r["prompt"] for r in expected)


def test_analogies_loader_rejects_malformed_lines(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text(": family\nboy girl brother\n")
    with pytest.raises(TaskError, match=r"bad.txt:2: expected"):
        tasks.load_analogies(path)


def test_news_ppl_split_and_passages():
    task = get_task("news-ppl")
    articles = tasks.load_lee_articles()
    assert len(articles) == 300
    assert len(task._test) == 30 and len(task._validation) == 30 and len(task._train) == 240
    assert not set(task._test) & set(task._train)
    assert not set(task._validation) & (set(task._train) | set(task._test))
    assert set(task._test) | set(task._train) | set(task._validation) == set(articles)
    again = get_task("news-ppl")
    assert again._test == task._test and again._validation == task._validation
    # The test split is the one the earlier results used: unchanged by carving validation from the rest.
    assert get_task("news-ppl", validation_fraction=0)._test == task._test
    with pytest.raises(TaskError, match="validation_fraction=1.5 must be in"):
        get_task("news-ppl", validation_fraction=1.5)
    passages = task.passages()
    # Passages re-join to exactly the training articles' words, none lost or repeated.
    assert sum(len(p.split()) for p in passages) == sum(len(a.split()) for a in task._train)
    assert max(len(p.split()) for p in passages) < 3 * task.passage_words
    ds = task.train_dataset(seed=0)
    assert set(ds["prompt"]) == {""} and len(ds) == len(passages)


def test_arithmetic_answers_are_right_and_held_out():
    task = get_task("arithmetic", n_train=500, n_test=50)
    for row in task._test + task._train:
        a, op, b, eq = row["prompt"].split()
        assert eq == "="
        assert int(row["completion"]) == (int(a) + int(b) if op == "+" else int(a) * int(b))
    assert not {r["prompt"] for r in task._test} & {r["prompt"] for r in task._train}
    assert {r["category"] for r in task._test} == {"addition", "multiplication"}
    assert get_task("arithmetic", n_train=500, n_test=50)._test == task._test
    val = {r["prompt"] for r in task._validation}
    assert len(val) == 200 and not val & {r["prompt"] for r in task._test + task._train}


class _Oracle(GenerationTask):
    """Generation replaced by canned outputs, to test scoring alone."""

    def __init__(self, outputs, **kw):
        super().__init__(**kw)
        self.outputs = outputs

    def generate(self, model, tokenizer, prompts, batch_size=32, progress=False):
        return [self.outputs[p] for p in prompts]


def test_generation_scoring_per_category_and_limit():
    test = [
        {"prompt": "p1", "completion": " Iraq", "category": "a"},
        {"prompt": "p2", "completion": " Rome", "category": "a"},
        {"prompt": "p3", "completion": " cats", "category": "b"},
    ]
    task = _Oracle({"p1": " Iraq.\n", "p2": " Paris", "p3": " cats and"}, name="t", train_rows=test, test_rows=test)
    out = task.evaluate(None, None)
    assert out["accuracy"] == pytest.approx(200 / 3)
    assert out["accuracy/a"] == 50.0 and out["accuracy/b"] == 100.0
    limited = task.evaluate(None, None, limit=1)  # first item of each category: p1 (hit), p3 (hit)
    assert limited["accuracy"] == 100.0 and limited["n"] == 2


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model("llama", seed=0), tiny_tokenizer()


def test_batched_greedy_generation_equals_one_by_one(tiny):
    model, tok = tiny
    prompts = ["12 + 3 =", "7 * 8 =", "a longer prompt here =", "x"]
    task = GenerationTask(
        "t", [{"prompt": "a", "completion": " b"}], [{"prompt": "a", "completion": " b"}], max_new_tokens=5
    )
    batched = task.generate(model, tok, prompts, batch_size=4)
    single = [task.generate(model, tok, [p], batch_size=1)[0] for p in prompts]
    assert batched == single
    assert tok.padding_side == "right"  # restored


def test_perplexity_matches_the_models_own_loss(tiny):
    model, tok = tiny
    text = "The bushfire moved towards Hill Top as winds rose."
    task = PerplexityTask("p", ["train text."], [text, text[:20]], eval_seq_len=256)
    out = task.evaluate(model, tok, batch_size=2)  # two windows of different length: padding must not count
    losses, counts = [], []
    for t in (text, text[:20]):
        ids = torch.tensor([tok(t)["input_ids"]])
        with torch.no_grad():
            losses.append(model(input_ids=ids, labels=ids).loss.item() * (ids.shape[1] - 1))
        counts.append(ids.shape[1] - 1)
    assert out["n_tokens"] == sum(counts)
    assert out["perplexity"] == pytest.approx(math.exp(sum(losses) / sum(counts)), rel=1e-4)


def test_yaml_plugin_with_local_files(tmp_path):
    rows = [{"prompt": f"Q{i}:", "completion": f" A{i}"} for i in range(20)]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "task.yaml").write_text(
        "name: qa\ndata_files: data.jsonl\nmatch: exact\nmax_new_tokens: 3\ntest_fraction: 0.25\n"
    )
    task = get_task(str(tmp_path / "task.yaml"))
    assert task.name == "qa" and task.match == "exact" and task.max_new_tokens == 3
    assert len(task._test) == 5 and len(task._validation) == 2 and len(task._train) == 13  # validation: 10% of 15
    everything = task._test + task._validation + task._train
    assert sorted(r["prompt"] for r in everything) == sorted(r["prompt"] for r in rows)
    (tmp_path / "split.yaml").write_text(
        "name: qa\ndata_files: {train: data.jsonl, test: data.jsonl, validation: data.jsonl}\nvalidation_fraction: 0\n"
    )
    given = get_task(str(tmp_path / "split.yaml"))  # the dataset's own validation split wins over carving
    assert len(given._validation) == 20 and len(given._train) == 20
    (tmp_path / "noval.yaml").write_text("name: qa\ndata_files: data.jsonl\nvalidation_fraction: 0\n")
    assert get_task(str(tmp_path / "noval.yaml")).splits == ("test",)
    (tmp_path / "bad.yaml").write_text("name: qa\ndata_files: data.jsonl\nprompt_col: q\n")
    with pytest.raises(TaskError, match=r"unknown keys \['prompt_col'\]"):
        get_task(str(tmp_path / "bad.yaml"))


def test_python_plugin(tmp_path):
    (tmp_path / "mytask.py").write_text(
        "from bdlora_train.tasks import GenerationTask\n"
        "rows = [{'prompt': 'one plus one is', 'completion': ' two'}]\n"
        "TASK = GenerationTask('mine', rows, rows)\n"
    )
    assert get_task(str(tmp_path / "mytask.py")).name == "mine"
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(TaskError, match="must set TASK"):
        get_task(str(tmp_path / "empty.py"))


def test_unknown_and_offline_tasks_fail_with_one_line():
    with pytest.raises(TaskError, match="unknown; use one of") as err:
        get_task("analogy")
    assert "\n" not in str(err.value)
    with pytest.raises(TaskError, match=r"Hub dataset could not be loaded") as err:
        get_task("nobody-xyz/no-such-dataset-bdlora")  # HF_HUB_OFFLINE=1 in tests
    assert "\n" not in str(err.value)
    with pytest.raises(TaskError, match="bad option"):
        get_task("analogies", per_category=3)


def test_embedded_model_zero_shot_analogies_is_low_but_not_zero(embedded):
    """The real SmolLM2 answers some analogies zero-shot (measured: ~11%), so there is room to fine-tune."""
    model, tok = embedded
    out = get_task("analogies").evaluate(model, tok, limit=2)
    assert out["n"] == 28
    assert 0 < out["accuracy"] < 60
    assert re.fullmatch(r"[0-9.]+", str(out["accuracy/capital-common-countries"]))


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
