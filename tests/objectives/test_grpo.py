"""`objective: grpo` (objectives/grpo.py) on the tiny Llama with the trainer generating: the recipe keys (GRPOConfig's
type-checked, TRL's vLLM keys refused), the rows the rewards see, a run that checkpoints, resumes and writes its
metrics and an adapter stock PEFT loads, and a reward that raises stopping the run in one line with its last
checkpoint kept. The vLLM rollout route is tested against a real server in tests/vllm/test_rl_rollouts.py."""

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bdlora_train.cli import main
from bdlora_train.core.errors import RecipeError
from bdlora_train.recipe.load import load_recipe
from tests.launching import kill_9_when

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes" / "tiny"
TINY = str(RECIPES / "grpo.yaml")

REWARDS = textwrap.dedent('''
    import json, os

    def ones(prompts, completions, answer, **kwargs):
        """1 per character '1' in the completion; records what TRL passed."""
        with open(os.environ["SEEN_FILE"], "a") as f:
            f.write(json.dumps({"prompts": prompts, "answer": answer, "keys": sorted(kwargs)}) + "\\n")
        return [float(c.count("1")) for c in completions]

    CALLS = []

    def breaks(prompts, completions, **kwargs):
        CALLS.append(1)
        if len(CALLS) > 2:  # from the third step on, every completion
            return [1.0 / 0.0 for _ in completions]
        return [0.0] * len(completions)
''')


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    monkeypatch.setenv("SEEN_FILE", str(tmp_path / "seen.jsonl"))
    return tmp_path


def _sums() -> dict:
    path = Path(__file__).resolve().parents[2] / "bdlora_train" / "packaged_data" / "tiny_sums.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["prompt"]: r["completion"] for r in rows}


def test_grpo_keys_are_grpoconfigs_and_trls_vllm_modes_are_refused():
    recipe = load_recipe(TINY, ["num_generations=2", "beta=0.04", "loss_type=dr_grpo"])
    assert recipe.training_args["num_generations"] == 2 and recipe.training_args["loss_type"] == "dr_grpo"
    refusals = {
        "num_generations=2": "num_generations is a GRPO key (TRL's GRPOConfig); add objective=grpo",
        "rewards=[exact_match]": "rewards applies to objective=grpo only",
        "rollout_server=http://127.0.0.1:1": "rollout_server applies to objective=grpo only",
    }
    for override, text in refusals.items():
        with pytest.raises(RecipeError, match=text.replace("(", r"\(").replace(")", r"\)")):
            load_recipe(str(RECIPES / "bdlora.yaml"), [override])
    grpo_refusals = {
        "use_vllm=true": "use_vllm is set by bdlora-train (rollouts run in `vllm serve` through rollout_server",
        "vllm_mode=colocate": "vllm_mode is set by bdlora-train",
        "reward_weights=[1.0]": "reward_weights is set by bdlora-train (give each reward its weight in rewards",
        "rollout_server=localhost:8000": "rollout_server='localhost:8000' is not a URL",
        "packing=true": "packing with objective=grpo is not supported",
        "num_generation=4": "did you mean 'num_generations'?",
        "rollout_server=http://127.0.0.1:1 repetition_penalty=1.2": "repetition_penalty=1.2 with rollout_server is "
        "not supported: the rollouts are sampled with max_completion_length, temperature, top_p and top_k only",
        "rollout_server=http://127.0.0.1:1 min_p=0.05": "min_p=0.05 with rollout_server is not supported",
    }
    for override, text in grpo_refusals.items():
        with pytest.raises(RecipeError) as err:
            load_recipe(TINY, override.split())
        assert text in str(err.value) and "\n" not in str(err.value), str(err.value)
    # the trainer's own generation takes them: no server, no refusal
    assert load_recipe(TINY, ["repetition_penalty=1.2"]).training_args["repetition_penalty"] == 1.2
    assert load_recipe(TINY, ["tp_size=2"]).tp_size == 2  # GRPO trains under TP: tests/objectives/test_grpo_parallel.py


def test_grpo_run_checkpoints_resumes_and_the_rewards_see_the_rows(user_rewards, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(user_rewards)  # module:function resolves from the current directory
    from peft import PeftModel

    from bdlora_train.models import build_tiny_model

    out = tmp_path / "run"
    args = [TINY, f"output_dir={out}", "rewards=[my_rewards:ones, {name: exact_match, weight: 0.5}]", "max_steps=4",
            "save_steps=2", "logging_steps=1"]
    assert main(["train", *args]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    reward = f"reward {metrics['reward_first']:.3f} -> {metrics['reward_last']:.3f} | world 1"
    assert reward in capsys.readouterr().out  # the summary line: GRPO's reward, not its loss
    assert metrics["objective"] == "grpo" and metrics["rewards"] == {"ones": 1.0, "exact_match": 0.5}
    assert metrics["steps"] == 4 and isinstance(metrics["reward_first"], float) and metrics["num_generations"] == 4
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert not list(out.glob(".tmp-*"))
    assert not (out / "README.md").exists()  # one model card, the toolkit's: TRL writes none into output_dir
    assert "library_name: peft" in (out / "adapter" / "README.md").read_text()
    # every step's diagnostics (rl/diagnostics.py): the first step whose rewards differ within a group moves the B
    # factors (dense and block-diagonal) and no A (its gradient goes through B, zero until then)
    assert [s["step"] for s in metrics["per_step"]] == [1, 2, 3, 4]
    first = next(s for s in metrics["per_step"] if s["frac_reward_zero_std"] < 1)
    norms = first["update_norm"]
    assert norms["lora_B"] > 0 and norms["lora_B_bd"] > 0 and norms["lora_A"] == norms["lora_A_bd"] == 0, first
    assert first["kl_to_base"] == 0  # measured on the step's batch, before its update: still the base
    # TRL called the reward with each completion's prompt and that row's reference under `answer`
    sums = _sums()
    seen = [json.loads(line) for line in (user_rewards / "seen.jsonl").read_text().splitlines()]
    assert len(seen) == 4 and all(len(s["prompts"]) == 8 for s in seen)
    for call in seen:
        assert [sums[p] for p in call["prompts"]] == call["answer"]
        assert call["prompts"][0] == call["prompts"][3] != call["prompts"][4]  # 2 prompts x num_generations 4
    # the adapter loads in stock PEFT onto the same tiny base
    base = build_tiny_model("llama", seed=0)
    model = PeftModel.from_pretrained(base, str(out / "adapter"))
    assert model.peft_config["default"].r == 8
    # the same command with more steps resumes from the last checkpoint
    capsys.readouterr()
    assert main(["train", *[a for a in args if not a.startswith("max_steps")], "max_steps=6"]) == 0
    assert f"resuming from {out / 'checkpoint-4'}" in capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 6 and metrics["steps_this_run"] == 2
    assert [s["step"] for s in metrics["per_step"]] == [1, 2, 3, 4, 5, 6]  # the checkpoint's history kept
    assert metrics["per_step"][-1]["kl_to_base"] > 0  # the adapter has moved the policy


def test_a_reward_that_raises_stops_the_run_in_one_line_and_keeps_its_checkpoint(user_rewards, tmp_path,
                                                                                  monkeypatch, capsys):
    from transformers.utils import logging as hf_logging

    monkeypatch.chdir(user_rewards)
    out = tmp_path / "run"
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # the Trainer's bar, which another test (compare --quiet) may have switched off
    try:
        code = main(["train", TINY, f"output_dir={out}", "rewards=[my_rewards:breaks]", "max_steps=4",
                     "save_steps=2"])
    finally:
        if not was:
            hf_logging.disable_progress_bar()
    err = capsys.readouterr().err
    line = err[err.index("error: "):].splitlines()[0]
    assert code == 1
    # on a line of its own after the Trainer's progress bar, which the failure left open: `grep '^bdlora'` finds it
    assert "it/s]" in err.split("bdlora train: error: ")[0].splitlines()[-1]
    assert [x for x in err.splitlines() if x.startswith("bdlora train: error: ")] == [f"bdlora train: {line}"]
    # the first completion of the step, with its prompt: the user can rerun their function on it
    assert line.startswith("error: reward my_rewards:breaks raised on completion 0 (prompt '"), line
    assert line.endswith("): ZeroDivisionError: float division by zero"), line
    assert (out / "checkpoint-2" / "trainer_state.json").is_file() and not (out / "adapter").exists()


def test_a_refused_rollout_server_leaves_no_adapter_version_behind(tmp_path, capsys):
    """The run writes its starting adapter as version -1 for the server check; a refusal (here: vLLM cannot load the
    toolkit's random test models) removes it, so a directory the run created is gone and a user's keeps only what
    it held."""
    for out, existed in ((tmp_path / "new", False), (tmp_path / "mine", True)):
        if existed:
            out.mkdir()
            (out / "notes.txt").write_text("the user's")
        assert main(["train", TINY, f"output_dir={out}", "rollout_server=http://127.0.0.1:1", "max_steps=2"]) == 1
        assert "vLLM cannot load the toolkit's random test models" in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] if existed else not out.exists()


def test_grpo_needs_prompts(tmp_path):
    data = tmp_path / "text.jsonl"
    data.write_text('{"text": "plain text, nothing to prompt with"}\n' * 8)
    with pytest.raises(Exception, match="objective=grpo needs prompts"):
        from bdlora_train.train.run import train

        train(load_recipe(TINY, [f"dataset={data}", f"output_dir={tmp_path / 'run'}"]))


def test_grpo_prompts_from_chat_rows_and_rollout_names_per_run_directory(tmp_path):
    """A messages row prompts with the conversation before its first learned turn, whose text is the `answer` the
    rewards see; two runs whose directories share a name never share a rollout adapter name on one server."""
    from datasets import Dataset

    from bdlora_train.objectives.grpo import prompt_rows, run_tag

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": "5"}, {"role": "user", "content": "and 2+4?"},
            {"role": "assistant", "content": "6"}]
    # learned: the assistant turns at index >= learn_from; the first of them is the one the prompt leads to
    rows = prompt_rows(Dataset.from_list([{"messages": chat, "learn_from": 3}, {"messages": chat, "learn_from": 0}]),
                       "chat data")
    assert rows.column_names == ["prompt", "answer"]
    assert rows[0]["prompt"] == chat[:4] and rows[0]["answer"] == "6"
    assert rows[1]["prompt"] == chat[:2] and rows[1]["answer"] == "5"  # learn_from 0: a plain messages file's rows
    sums = prompt_rows(Dataset.from_list([{"prompt": "24+48=", "completion": "72"}]), "sums")
    assert sums[0] == {"prompt": "24+48=", "answer": "72"}
    one, two = run_tag(tmp_path / "a" / "run"), run_tag(tmp_path / "b" / "run")
    assert one.startswith("run-") and two.startswith("run-") and one != two
    assert run_tag(tmp_path / "a" / "run") == one  # the same directory: the same prefix (a rerun finds its versions)


def test_kill_9_mid_grpo_run_then_the_same_command_equals_an_uninterrupted_run(tmp_path):
    """A GRPO run killed between checkpoints resumes from its last complete one and, sampling included, ends with the
    adapter an uninterrupted run ends with (the checkpoint restores the sampling generator's state)."""
    args = [TINY, "max_steps=24", "save_steps=4", "save_total_limit=2", "logging_steps=4"]
    killed = tmp_path / "killed"
    kill_9_when([sys.executable, "-m", "bdlora_train.cli", "train", *args, f"output_dir={killed}"],
                killed / "checkpoint-4" / "trainer_state.json")
    assert not (killed / "adapter").exists(), "the run finished before the kill; the test needs a longer run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the killed subprocess (OMP_NUM_THREADS=1), so float sums agree bit for bit
    try:
        assert main(["train", *args, f"output_dir={killed}"]) == 0  # the very same command
        fresh = tmp_path / "fresh"
        assert main(["train", *args, f"output_dir={fresh}"]) == 0
    finally:
        torch.set_num_threads(threads)
    metrics = json.loads((killed / "metrics.json").read_text())
    assert metrics["resumed_from"] is not None and 0 < metrics["steps_this_run"] < 24 and metrics["steps"] == 24
    assert not list(killed.glob(".tmp-*"))
    a, b = (load_file(str(run / "adapter" / "adapter_model.safetensors")) for run in (killed, fresh))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
