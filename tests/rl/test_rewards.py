"""rl/rewards.py: the built-in exact_match on real task rows, user rewards by module and by file, weights, and
the one-line RewardError of every bad entry, spec and reward output. Rewards are called as TRL 1.16's
GRPOTrainer._calculate_rewards calls them."""

import asyncio
import sys

import pytest

from bdlora_train.core.errors import RewardError
from bdlora_train.rl.rewards import TASK_REWARDS, default_rewards, load_rewards
from bdlora_train.tasks.builtin import analogies, arithmetic


class _State:
    global_step = 3


def call(reward, prompts, completions, **columns):
    """Exactly the kwargs _calculate_rewards passes: prompts, completions, completion_ids, each non-prompt
    column as a list, trainer_state, log_extra, log_metric."""
    out = reward(
        prompts=prompts,
        completions=completions,
        completion_ids=[[1, 2, 3] for _ in completions],
        **columns,
        trainer_state=_State(),
        log_extra=lambda column, values: None,
        log_metric=lambda name, value: None,
    )
    return asyncio.run(out) if asyncio.iscoroutine(out) else out


def one_line(excinfo, *parts):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, message
    return message


# ---------------------------------------------------------------------------------------------- built-in


@pytest.mark.parametrize("factory", [lambda: arithmetic(n_train=8, n_test=4, n_validation=4), analogies])
def test_exact_match_scores_task_rows_as_the_task_does(factory):
    task = factory()
    assert task.match == "first_word"  # the mode the built-in reward scores in
    rows = task._train[:4]
    prompts = [r["prompt"] for r in rows for _ in range(2)]  # num_generations=2: each row twice
    answers = [r["completion"] for r in rows for _ in range(2)]
    completions = []
    for r in rows:
        completions += [r["completion"] + "\nNext question", " 7 no"]  # a right one that runs on; a wrong one
    [reward], [weight] = load_rewards(None, "task:" + task.name)
    assert reward.__name__ == "exact_match" and weight == 1.0
    assert call(reward, prompts, completions, answer=answers) == [1.0, 0.0] * 4


def test_exact_match_first_word_details():
    [reward], _ = load_rewards(["exact_match"], "task:arithmetic")
    prompts = ["2 + 40 ="] * 4
    completions = [" 42\nNext", " 42.", "42", " 4 2"]
    assert call(reward, prompts, completions, answer=[" 42"] * 4) == [1.0, 1.0, 1.0, 0.0]
    chat = [[{"role": "assistant", "content": " Athens, of course"}]]
    assert call(reward, ["x"], chat, answer=[" athens"]) == [1.0]


def test_exact_match_without_answer_column():
    [reward], _ = load_rewards(["exact_match"], "data.jsonl")
    with pytest.raises(RewardError) as e:
        call(reward, ["q"], [" a"], label=["a"])
    one_line(e, "exact_match", "'answer' column", "label")


def test_default_rewards():
    assert default_rewards("task:arithmetic") == default_rewards("task:analogies") == ["exact_match"]
    assert set(TASK_REWARDS) == {"task:arithmetic", "task:analogies"}
    for dataset in ("task:news-ppl", "my_data.jsonl"):
        with pytest.raises(RewardError) as e:
            load_rewards([], dataset)
        one_line(e, f"objective=grpo with dataset={dataset} needs rewards", "module:function", "built-in: exact_match")


# ---------------------------------------------------------------------------------------------- user rewards


USER = """
import math

def length_penalty(prompts, completions, **kwargs):
    return [-len(c) / 10 for c in completions]

def score(prompts, completions, answer, trainer_state, log_metric, **kwargs):
    log_metric("seen_step", trainer_state.global_step)
    return [1.0 / len(c) for c in completions]   # ZeroDivisionError on an empty completion

def whole_batch(prompts, completions, **kwargs):
    if len(completions) > 1:
        raise ValueError("needs a single completion\\nsecond line")
    return [0.0]

def short(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)

def nan(prompts, completions, **kwargs):
    return [0.0 if c else math.nan for c in completions]

def text(prompts, completions, **kwargs):
    return ["1.0" for c in completions]

def maybe(prompts, completions, **kwargs):
    return [None if not c else 1 for c in completions]

async def judged(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helper.py").write_text("BONUS = 2.0\n")
    (tmp_path / "sub" / "other.py").write_text(
        "from helper import BONUS\n\ndef length_penalty(prompts, completions, **kwargs):\n"
        "    return [BONUS for _ in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("my_rewards", None)
    yield tmp_path
    sys.modules.pop("my_rewards", None)


def test_user_rewards_by_module_and_file_with_weights(user_dir):
    before = list(sys.path)
    funcs, weights = load_rewards(
        ["exact_match", {"name": "my_rewards:length_penalty", "weight": -0.5}, {"name": "sub/other.py:length_penalty"}],
        "data.jsonl",
    )
    assert sys.path == before  # the current directory and the file's folder were on it only for the import
    assert weights == [1.0, -0.5, 1.0]
    assert [f.__name__ for f in funcs] == ["exact_match", "my_rewards.length_penalty", "other.length_penalty"]
    completions = [" 5 apples", "x"]
    assert call(funcs[1], ["q", "q"], completions, answer=[" 5", " 5"]) == [-0.9, -0.1]
    assert call(funcs[2], ["q", "q"], completions, answer=[" 5", " 5"]) == [2.0, 2.0]  # imported its neighbour
    assert call(funcs[0], ["q", "q"], completions, answer=[" 5", " 5"]) == [1.0, 0.0]


def test_names_are_the_function_names_and_distinct(user_dir):
    funcs, _ = load_rewards(["my_rewards:length_penalty", "my_rewards:score", "my_rewards.py:length_penalty"], "d")
    names = [f.__name__ for f in funcs]
    assert names == ["my_rewards.length_penalty", "score", "my_rewards.length_penalty_2"]
    [single], _ = load_rewards(["my_rewards:length_penalty"], "d")
    assert single.__name__ == "length_penalty" and single.spec == "my_rewards:length_penalty"


def test_kwargs_pass_through_and_none_and_async(user_dir):
    (score, maybe, judged), _ = load_rewards(["my_rewards:score", "my_rewards:maybe", "my_rewards:judged"], "d")
    logged = []
    out = score(
        prompts=["a", "b"],
        completions=["xy", "x"],
        completion_ids=[[1], [2]],
        answer=["1", "2"],
        trainer_state=_State(),
        log_extra=None,
        log_metric=lambda name, value: logged.append((name, value)),
    )
    assert out == [0.5, 1.0] and logged == [("seen_step", 3)]
    assert call(maybe, ["a", "b"], ["", "x"]) == [None, 1.0]
    assert asyncio.iscoroutinefunction(judged)  # TRL awaits it on its event loop
    assert call(judged, ["a", "b"], ["xyz", "x"]) == [3.0, 1.0]


# ---------------------------------------------------------------------------------------------- bad output


def test_raising_reward_names_the_row(user_dir):
    [score], _ = load_rewards(["my_rewards:score"], "d")
    prompts = ["What is 2+2?", "What is 2+3? " + "x" * 100, "c", "d"]
    with pytest.raises(RewardError) as e:
        call(score, prompts, ["4", "", "1", ""], answer=["4", "5", "6", "7"])
    message = one_line(e, "reward my_rewards:score raised on completion 1 (prompt 'What is 2+3? xxx")
    assert message.endswith("): ZeroDivisionError: float division by zero")
    assert f"(prompt '{prompts[1][:60]}')" in message  # its first 60 characters
    assert isinstance(e.value.__cause__, ZeroDivisionError)  # --traceback shows the cause


def test_batch_error_names_the_batch(user_dir):
    [reward], _ = load_rewards(["my_rewards:whole_batch"], "d")
    with pytest.raises(RewardError) as e:
        call(reward, ["a", "b", "c"], ["1", "2", "3"])
    one_line(e, "reward my_rewards:whole_batch raised on the batch of 3 completions: ValueError: needs a single")
    assert isinstance(e.value.__cause__, ValueError)


@pytest.mark.parametrize(
    "name, parts",
    [
        ("short", ["reward my_rewards:short returned 2 values for a batch of 3 completions"]),
        ("nan", ["reward my_rewards:nan returned nan (float) for completion 1 (prompt 'b')", "finite"]),
        ("text", ["reward my_rewards:text returned '1.0' (str) for completion 0 (prompt 'a')"]),
    ],
)
def test_bad_outputs_refused(user_dir, name, parts):
    [reward], _ = load_rewards([f"my_rewards:{name}"], "d")
    with pytest.raises(RewardError) as e:
        call(reward, ["a", "b", "c"], ["1", "", "3"])
    one_line(e, *parts)


# ---------------------------------------------------------------------------------------------- bad entries


@pytest.mark.parametrize(
    "entries, parts",
    [
        (["nope"], ["reward nope: not a built-in reward", "built-in: exact_match", "module:function"]),
        (["no_such_module_xyz:f"], ["reward no_such_module_xyz:f: module 'no_such_module_xyz' not found"]),
        (["my_rewards:missing"], ["reward my_rewards:missing: 'my_rewards' has no attribute 'missing'", "score"]),
        (["my_rewards:NOT_A_FUNCTION"], ["reward my_rewards:NOT_A_FUNCTION: 'NOT_A_FUNCTION' is a int, not a func"]),
        (["missing/file.py:f"], ["reward missing/file.py:f: no such file", "file.py"]),
        (["broken.py:f"], ["reward broken.py:f: importing 'broken.py' raised SyntaxError"]),
        (["needs_dep:f"], ["reward needs_dep:f: importing 'needs_dep' failed: No module named 'absent_dep_xyz'"]),
        ([":f"], ["reward :f: give both the module and the function"]),
        (["exact_match", "exact_match"], ["rewards[1] = 'exact_match' is listed twice"]),
        ([{"name": "exact_match", "wieght": 2}], ["rewards[0] = {'name': 'exact_match', 'wieght': 2}", "'wieght'"]),
        ([{"name": "exact_match", "weight": "0.5"}], ["rewards[0]", "weight must be a finite number"]),
        ([{"name": "exact_match", "weight": float("nan")}], ["rewards[0]", "weight must be a finite number"]),
        ([{"name": "exact_match", "weight": float("inf")}], ["rewards[0]", "weight must be a finite number"]),
        ([{"name": "exact_match", "weight": True}], ["rewards[0]", "weight must be a finite number"]),
        ([{"weight": 2.0}], ["rewards[0] = {'weight': 2.0}: give the reward as a name"]),
        ([3], ["rewards[0] = 3: give the reward as a name"]),
        ("exact_match", ["rewards = 'exact_match' must be a list"]),
    ],
)
def test_bad_entries_one_line(user_dir, entries, parts):
    (user_dir / "broken.py").write_text("def f(:\n")
    (user_dir / "needs_dep.py").write_text("import absent_dep_xyz\n")
    before = list(sys.path)
    with pytest.raises(RewardError) as e:
        load_rewards(entries, "task:arithmetic")
    one_line(e, *parts)
    assert sys.path == before


# ---------------------------------------------------------------------------------------------- through TRL


def test_through_trls_calculate_rewards(user_dir):
    """The real GRPOTrainer._calculate_rewards (undecorated) on a stub trainer: names, columns and scores."""
    from types import SimpleNamespace as NS

    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    from trl.trainer.utils import get_callable_name

    funcs, _ = load_rewards(["exact_match", "my_rewards:length_penalty", "my_rewards:score"], "task:arithmetic")
    trainer = NS(
        accelerator=NS(device="cpu", is_main_process=True),
        args=NS(report_to=[]),
        state=NS(global_step=0),
        reward_funcs=funcs[:2],
        reward_processing_classes=[None, None],
        reward_func_names=[get_callable_name(f) for f in funcs[:2]],
        _log_completion_extra=lambda *a, **k: None,
        _log_metric=lambda *a, **k: None,
        environments=None,
    )
    calculate = grpo.GRPOTrainer._calculate_rewards.__wrapped__
    inputs = [{"prompt": "2 + 40 =", "answer": " 42", "category": "addition"}] * 2
    rewards = calculate(trainer, inputs, ["2 + 40 ="] * 2, [" 42\nNext", " 41"], [[1], [2]])
    assert trainer.reward_func_names == ["exact_match", "length_penalty"]
    assert rewards.flatten().tolist() == pytest.approx([1.0, -0.8, 0.0, -0.3])
    trainer.reward_funcs, trainer.reward_func_names = funcs[2:], ["score"]
    with pytest.raises(RewardError) as e:
        calculate(trainer, inputs, ["2 + 40 ="] * 2, ["x", ""], [[1], [2]])
    one_line(e, "reward my_rewards:score raised on completion 1 (prompt '2 + 40 =')")
