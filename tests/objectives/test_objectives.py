"""The objective types (objectives/): one per objective, found by name, and no objective name compared anywhere else."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import bdlora_train
from bdlora_train.cards import card_data, training_lines
from bdlora_train.core.errors import RecipeError
from bdlora_train.objectives import NAMES, objective_named
from bdlora_train.objectives.base import Objective
from bdlora_train.train.entry import summary_line

PACKAGE = Path(bdlora_train.__file__).parent


def test_every_name_is_an_objective_of_that_name_and_none_is_the_supervised_one():
    assert set(NAMES) == {"sft", "grpo"}
    for name in NAMES:
        objective = objective_named(name)
        assert isinstance(objective, Objective) and objective.name == name
    assert objective_named(None).name == "sft"  # a metrics.json written before the key was recorded


def test_an_unknown_objective_is_refused_in_one_line_naming_the_choices():
    with pytest.raises(RecipeError, match=r"^recipe: objective='dpo'; use one of \['sft', 'grpo'\]$"):
        objective_named("dpo")


def _compared_names(path: Path) -> list[tuple[int, str]]:
    """(line, literal) of every comparison (==, !=, in, not in) of a string literal naming an objective."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for operand in [node.left, *node.comparators]:
            literals = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            found += [(node.lineno, lit.value) for lit in literals
                      if isinstance(lit, ast.Constant) and lit.value in NAMES]
    return found


def test_no_objective_name_is_compared_outside_the_objectives_package():
    compared = {
        str(path.relative_to(PACKAGE)): hits
        for path in PACKAGE.rglob("*.py")
        if "objectives" not in path.relative_to(PACKAGE).parts and (hits := _compared_names(path))
    }
    assert not compared, f"objective names compared outside objectives/: {compared}"


def test_the_scan_sees_a_comparison(tmp_path):
    """The scan above would catch the string switch it replaced."""
    code = tmp_path / "switch.py"
    code.write_text('if recipe.objective == "grpo":\n    pass\nif m.get("objective") in ("sft",):\n    pass\n')
    assert _compared_names(code) == [(1, "grpo"), (3, "sft")]


GRPO_METRICS = {
    "objective": "grpo", "rewards": {"exact_match": 1.0}, "num_generations": 8, "reward_first": 0.125,
    "reward_last": 0.5, "final_loss": 0.0123, "steps": 30, "dataset": "task:analogies", "bd_lr_ratio": 3.0,
}


def test_a_grpo_run_card_says_its_rewards_and_reward_not_its_loss():
    lines = training_lines(GRPO_METRICS)
    assert lines[0] == "- objective: GRPO (TRL's GRPOTrainer), 8 sampled completions per prompt, rewards: " \
                       "`exact_match` (weight 1)"
    assert "- mean reward of the sampled completions: 0.1250 at the first step, 0.5000 at the last" in lines
    assert not any("loss" in line for line in lines)
    assert {"trl", "grpo"} <= set(card_data("org/base", 3, None, None, None, objective="grpo").tags)


def test_a_supervised_run_card_has_its_loss_and_no_grpo_lines():
    metrics = {k: v for k, v in GRPO_METRICS.items() if k not in ("objective", "rewards", "reward_first")}
    for m in (metrics, {**metrics, "objective": "sft"}):  # before and after metrics.json recorded the objective
        lines = training_lines(m)
        assert "- final training loss: 0.0123" in lines
        assert not any("GRPO" in line or "reward" in line for line in lines)
    assert "grpo" not in card_data("org/base", 3, None, None, None, objective="sft").tags


def test_the_summary_line_says_what_each_objective_reached():
    common = dict(method="bdlora", r=12, nblocks=3, trainable_params=10, steps=30, steps_this_run=30,
                  train_wall_time_s=1.0, tokens_per_second=None, peak_memory_mb=1.0, world_size=1, adapter_dir="a")
    assert "| reward 0.125 -> 0.500 |" in summary_line({**common, **GRPO_METRICS})
    assert "| final loss 0.0123 |" in summary_line({**common, "final_loss": 0.0123})
