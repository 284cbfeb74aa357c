"""The pieces of a launch, each alone: the command rebuilt from this process's own (launch/command.py), the
environment a run touches and restores (launch/env.py), the DeepSpeed JSON a run reads (launch/deepspeed.py)
and the recipe as TrainingArguments (train/training_args.py)."""

import json
import os
import sys
from pathlib import Path

import pytest

from bdlora_train.core.errors import RecipeError
from bdlora_train.launch import command as launch_command
from bdlora_train.launch import deepspeed as deepspeed_setup
from bdlora_train.launch import env as run_env
from bdlora_train.objectives import objective_named
from bdlora_train.recipe.load import load_recipe
from bdlora_train.train import training_args

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny" / "bdlora.yaml")


def test_the_command_repeats_this_runs_arguments_with_the_process_count(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bdlora", "train", TINY, "note=a b", "--traceback"])
    monkeypatch.delenv("LOCAL_RANK", raising=False)  # started alone: torchrun is the launcher to name
    assert launch_command.train_args() == f"{TINY} 'note=a b'"
    assert launch_command.launch_command(4) == f"torchrun --nproc_per_node 4 -m bdlora_train.train {TINY} 'note=a b'"
    monkeypatch.setattr(sys, "argv", ["script.py"])
    assert launch_command.train_args() is None and launch_command.launch_command(2) is None


def test_a_runs_environment_is_put_back(monkeypatch):
    monkeypatch.setenv("BDLORA_T_KEEP", "old")
    monkeypatch.delenv("BDLORA_T_NEW", raising=False)
    with run_env.scoped_env({"BDLORA_T_KEEP": "new", "BDLORA_T_NEW": "x"}):
        assert os.environ["BDLORA_T_KEEP"] == "new" and os.environ["BDLORA_T_NEW"] == "x"
    assert os.environ["BDLORA_T_KEEP"] == "old" and "BDLORA_T_NEW" not in os.environ
    with run_env.without_env("BDLORA_T_KEEP"):
        assert "BDLORA_T_KEEP" not in os.environ
    assert os.environ["BDLORA_T_KEEP"] == "old"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with run_env.scoped_launch_env(None) as launch:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    assert launch == {"fsdp": True, "deepspeed": False} and "ACCELERATE_USE_DEEPSPEED" not in os.environ


def test_a_deepspeed_json_loses_its_auto_batch_size(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": "auto", "zero_optimization": {"stage": 3}}))
    assert deepspeed_setup.deepspeed_config(str(path)) == {"zero_optimization": {"stage": 3}}
    with pytest.raises(RecipeError, match="file not found"):
        deepspeed_setup.deepspeed_config(str(tmp_path / "none.json"))
    with pytest.raises(RecipeError, match="float64 with DeepSpeed"):
        deepspeed_setup.check_deepspeed_dtype("float64", True)


def test_the_recipe_becomes_training_arguments(tmp_path):
    recipe = load_recipe(TINY, ["learning_rate=0.002", "neftune_noise_alpha=5", "save_steps=0"])
    args = training_args.training_arguments(recipe, objective_named(recipe.objective), tmp_path / "run", None)
    assert args.learning_rate == 0.002 and args.neftune_noise_alpha == 5.0 and args.save_strategy == "no"
    assert args.run_name == "run" and not args.push_to_hub
