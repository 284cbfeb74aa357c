"""recipe/parallel_keys.py: a recipe's model-parallel sizes checked against each other, the EP layouts it suggests."""

from pathlib import Path

import pytest

from bdlora_train.core.errors import RecipeError
from bdlora_train.recipe import parallel_keys as P
from bdlora_train.recipe.load import load_recipe

EP = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "bdlora_moe_ep2.yaml")  # fsdp 2, ep 2, 4 experts


def test_an_expert_parallel_size_off_tp_times_fsdp_is_refused_with_the_layout_that_fits(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    recipe = load_recipe(EP, [f"output_dir={tmp_path}"])
    P.check_parallel_keys(recipe, recipe.quant_keys)  # the recipe as written passes
    wrong = recipe.replace(ep_size=3)
    assert P.ep_hint(wrong) == "; use ep_size=2 (4 experts, 2 processes launched)"
    with pytest.raises(RecipeError, match="ep_size must be tp_size x fsdp_size; use ep_size=2"):
        P.check_parallel_keys(wrong, wrong.quant_keys)


def test_data_parallel_sizes_without_tp_are_refused(tmp_path):
    recipe = load_recipe(EP, [f"output_dir={tmp_path}"]).replace(ep_size=1, tp_size=1)
    with pytest.raises(RecipeError, match="fsdp_size=2 with tp_size=1"):
        P.check_parallel_keys(recipe, recipe.quant_keys)
