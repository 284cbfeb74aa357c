"""The recipe in sections: each key in one section owned by one package, the flat YAML keys still the way in, and
every section's check its own."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import bdlora_train
from bdlora_train.core.errors import RecipeError
from bdlora_train.core.keys import check_fields
from bdlora_train.data.keys import DataKeys
from bdlora_train.objectives.grpo_keys import RolloutKeys
from bdlora_train.recipe.load import load_recipe
from bdlora_train.recipe.schema import SECTIONS, Recipe, recipe_keys
from bdlora_train.trainer.keys import TrainingKeys

PACKAGE = Path(bdlora_train.__file__).parent


def test_every_key_is_in_exactly_one_section_or_on_the_recipe():
    keys = recipe_keys()
    assert len(keys) == len(set(keys)) == 74
    in_sections = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert sorted(in_sections + ["objective", "training_args"]) == sorted(keys)


def test_no_class_in_the_package_has_more_than_30_fields():
    """Counted in the source: annotated class attributes (a dataclass's fields)."""
    counts = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                counts[f"{path.relative_to(PACKAGE)}:{node.name}"] = sum(
                    isinstance(item, ast.AnnAssign) for item in node.body)
    assert counts["recipe/schema.py:Recipe"] == 0 and counts["trainer/keys.py:TrainingKeys"] == 23  # the scan counts
    assert not {name: n for name, n in counts.items() if n > 30}


def test_flat_keys_load_into_their_sections_and_read_back_flat(tmp_path):
    recipe = load_recipe(None, ["lora_r=6", "nblocks=3", "dataset=task:arithmetic", "rollout_server=http://h:1",
                                "objective=grpo", "tp_size=1", "max_steps=3", "hub_model_id=me/x"])
    assert (recipe.adapter.lora_r, recipe.data.dataset, recipe.rollouts.rollout_server) == (6, "task:arithmetic",
                                                                                             "http://h:1")
    assert (recipe.training.max_steps, recipe.hub.hub_model_id, recipe.parallelism.tp_size) == (3, "me/x", 1)
    assert (recipe.lora_r, recipe.max_steps, recipe.objective) == (6, 3, "grpo")
    recipe.max_steps = 5  # a flat write lands in the section
    assert recipe.training.max_steps == 5
    with pytest.raises(AttributeError, match="no attribute 'lora_rank'"):
        recipe.lora_rank  # noqa: B018
    with pytest.raises(TypeError, match="unknown key 'lora_rank'"):
        Recipe(lora_rank=4)


def test_the_yaml_a_recipe_writes_loads_back_equal(tmp_path):
    recipe = load_recipe("recipes/smollm2-135m/analogies/grpo.yaml", ["seed=7"])
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe.to_yaml())
    again = load_recipe(str(path))
    assert again == recipe and again.training_args == {"num_generations": 8, "max_completion_length": 4,
                                                        "temperature": 0.7, "beta": 0.0}
    assert again.replace(seed=8) != recipe and again.replace(seed=7) == recipe


def test_replace_derives_the_derived_keys_again():
    recipe = Recipe(lora_r=8, lora_alpha_ratio=2.0, lora_alpha=None)
    assert recipe.lora_alpha == 16.0
    assert recipe.replace(lora_r=12).lora_alpha == 24.0
    assert recipe.replace(match_budget_of_lora_rank=8).lora_r is None  # the budget sets the rank


@pytest.mark.parametrize(("section", "values", "message"), [
    (DataKeys, dict(eval_dataset="task:arithmetic", eval_fraction=0.1), "eval_dataset and eval_fraction are both set"),
    (TrainingKeys, dict(max_steps=0), "max_steps=0 trains nothing"),
    (TrainingKeys, dict(bf16=True, fp16=True), "bf16 and fp16 are both true"),
    (TrainingKeys, dict(report_to="wandb,carrier_pigeon"), "unknown logger 'carrier_pigeon'"),
    (RolloutKeys, dict(rollout_max_logprob_diff=0.0), r"rollout_max_logprob_diff=0.0 must be > 0"),
])
def test_each_section_checks_its_own_keys(section, values, message):
    with pytest.raises(RecipeError, match=message):
        section(**values).check()
    section().check()  # its defaults pass


def test_a_bound_names_the_key_the_value_and_the_range():
    with pytest.raises(RecipeError, match=r"^recipe: warmup_ratio=1.0 must be in \[0, 1\) \(fraction of steps spent "
                                          r"warming up, in \[0, 1\)\)$"):
        check_fields(TrainingKeys(warmup_ratio=1.0))
    with pytest.raises(RecipeError, match=r"^recipe: dataset_format='csv'; use one of \['auto', "):
        check_fields(DataKeys(dataset_format="csv"))
