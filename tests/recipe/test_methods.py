"""method=peft-bdlora (stock PEFT's BD-LoRA through the same recipe) and bd_lr_ratio (the block-diagonal factor's
learning-rate multiplier), on the tiny Llama."""

import json

import pytest
import torch
from peft.tuners.lora.variants import BlockDiagonalLinear

from bdlora_train.core.errors import RecipeError
from bdlora_train.models import build_tiny_model
from bdlora_train.peft_integration.layers import BlockDiagLoraLinear
from bdlora_train.peft_integration.patterns import stock_roles
from bdlora_train.recipe.load import load_recipe
from bdlora_train.train import train
from tests.exactness import assert_float32_rounding_only

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]


def _bd_factors(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_peft_bdlora_is_stock_peft_with_the_toolkit_roles_and_trains_like_the_toolkit_layer(
    tmp_path, tiny_inputs, tiny_recipe
):
    model, tok, rows = tiny_inputs
    keys = dict(max_steps=4, optim="sgd", learning_rate=0.05)
    stock = train(tiny_recipe(tmp_path / "peft", method="peft-bdlora", **keys), model, tok, rows)
    ours = train(tiny_recipe(tmp_path / "ours", method="bdlora", **keys), model, tok, rows)
    layers = [m for m in stock.model.modules() if hasattr(m, "lora_A")]
    assert layers and not any(isinstance(m, BlockDiagLoraLinear) for m in stock.model.modules())  # PEFT's own layer
    assert any(isinstance(m, BlockDiagLoraLinear) for m in ours.model.modules())
    config = json.loads((stock.adapter_dir / "adapter_config.json").read_text())
    names = [n for n, m in stock.model.get_base_model().named_modules() if hasattr(m, "lora_A")]
    ours_config = json.loads((ours.adapter_dir / "adapter_config.json").read_text())
    assert stock_roles(names, config["use_bdlora"]) == stock_roles(names, ours_config["use_bdlora"])
    assert set(stock_roles(names, config["use_bdlora"]).values()) == {"bd_a", "bd_b"}
    assert stock.metrics["trainable_params"] == ours.metrics["trainable_params"]
    assert stock.metrics["nblocks"] == 2 and stock.metrics["method"] == "peft-bdlora"
    # Same seed, same init (PEFT's, drawn in float32), same data: both layers compute one function, so both runs are
    # float32 roundings of the toolkit's layer run in float64 (PEFT's own layer would draw a float64 A from other
    # random numbers, so it cannot be that twin). SGD, not Adam: each step is proportional to its gradient, so
    # rounding stays rounding (Adam's first steps move a weight with a near-zero gradient by +-lr on rounding alone).
    exact_model = build_tiny_model("llama", seed=0, dtype=torch.float64)
    exact = _bd_factors(train(tiny_recipe(tmp_path / "exact", method="bdlora", **keys), exact_model, tok, rows).model)
    a, b = _bd_factors(stock.model), _bd_factors(ours.model)
    assert a.keys() == b.keys() == exact.keys()
    assert_float32_rounding_only(a, b, exact)
    assert any(a[n].abs().sum() > 0 for n in a if "lora_B" in n)  # it trained


def test_bd_lr_ratio_multiplies_only_the_block_diagonal_factors_step(tmp_path, tiny_inputs, tiny_recipe):
    """Adam's first step moves every weight with a nonzero gradient by ~lr. B starts at zero, so after one
    constant-rate step a block-diagonal B (q/k/v/gate/up) is ~ratio*lr in size and a dense B (o/down) ~lr."""
    model, tok, rows = tiny_inputs
    steps = dict(max_steps=1, lr_scheduler_type="constant", learning_rate=1e-3)
    for ratio in (1.0, 3.0):
        result = train(tiny_recipe(tmp_path / f"r{ratio}", bd_lr_ratio=ratio, **steps), model, tok, rows)
        bd_b, dense_b = [], []
        for module in result.model.modules():
            if hasattr(module, "lora_B") and "default" in module.lora_B:
                lora_b = module.lora_B["default"]
                (bd_b if isinstance(lora_b, BlockDiagonalLinear) else dense_b).append(lora_b.weight.detach())
        assert bd_b and dense_b
        assert max(w.abs().max().item() for w in bd_b) == pytest.approx(ratio * 1e-3, rel=1e-3)
        assert max(w.abs().max().item() for w in dense_b) == pytest.approx(1e-3, rel=1e-3)


def test_method_keys_that_would_be_ignored_are_refused():
    with pytest.raises(RecipeError, match="bd_lr_ratio=3.0 applies to block-diagonal methods"):
        load_recipe(None, ["method=lora", "bd_lr_ratio=3"])
    with pytest.raises(RecipeError, match="bd_a_init=lora needs the toolkit's layer"):
        load_recipe(None, ["method=peft-bdlora", "bd_a_init=lora"])
    with pytest.raises(RecipeError, match="bd_lr_ratio=-1.0 must be > 0"):
        load_recipe(None, ["bd_lr_ratio=-1"])
    assert load_recipe(None, ["method=peft-bdlora", "bd_lr_ratio=2"]).bd_lr_ratio == 2.0


def test_each_method_reads_its_own_keys_and_rank_rule():
    from bdlora_train.core.errors import BlockDiagLoraConfigError
    from bdlora_train.recipe.methods import check_method_rank, keys_not_read_by

    # a sweep leaves these at their defaults for the method (and trains it once, not once per value)
    assert keys_not_read_by("lora") == ("bd_a_init", "bd_lr_ratio")
    assert keys_not_read_by("bdlora") == keys_not_read_by("peft-bdlora") == ("loraplus_lr_ratio",)
    check_method_rank("lora", 6, 4)  # plain LoRA has no blocks: any rank
    check_method_rank("bdlora", 8, 4)
    with pytest.raises(
        BlockDiagLoraConfigError, match=r"BlockDiagLoraConfig: r=6 is not a multiple of nblocks=4; use r=4",
    ):
        check_method_rank("bdlora", 6, 4)
    with pytest.raises(RecipeError, match=r"method=peft-bdlora: lora_r=6 is not a multiple of nblocks=4"):
        check_method_rank("peft-bdlora", 6, 4)


# Which factor TP splits, by family (column-parallel -> B, row-parallel -> A), as parameter-name suffixes; experts:
# gate_up_proj is column-parallel (its wrapper is the inner one, `experts.base_layer`), down_proj row-parallel.
BLOCK_DIAGONAL = {
    "phi3": (
        "qkv_proj.lora_B.default.weight",
        "gate_up_proj.lora_B.default.weight",
        "o_proj.lora_A.default.weight",
        "down_proj.lora_A.default.weight",
    ),
    "mixtral": (
        "q_proj.lora_B.default.weight",
        "k_proj.lora_B.default.weight",
        "v_proj.lora_B.default.weight",
        "o_proj.lora_A.default.weight",
        "experts.base_layer.lora_B.default.weight",
        "experts.lora_A.default.weight",
    ),
}


@pytest.mark.parametrize("family", sorted(BLOCK_DIAGONAL))
def test_bd_lr_ratio_reaches_every_block_diagonal_factor_packed_masked_or_expert(
    family, tmp_path, tiny_inputs, tiny_recipe, monkeypatch
):
    """Phi-3's fused qkv_proj / gate_up_proj and Mixtral's experts store their block-diagonal factor densely with a
    mask: the ratio must reach those factors too, and nothing else."""
    import bdlora_train.train.setup as run_module
    from bdlora_train.models import build_tiny_model

    seen = []
    real = run_module.apply_lr_ratios
    monkeypatch.setattr(
        run_module, "apply_lr_ratios", lambda trainer, *args: seen.append(trainer) or real(trainer, *args)
    )
    _, tok, rows = tiny_inputs
    recipe = tiny_recipe(
        tmp_path / family,
        model=f"tiny:{family}",
        bd_lr_ratio=3.0,
        max_steps=1,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
    )
    train(recipe, build_tiny_model(family), tok, rows)
    trainer = seen[0]
    lr_of = {id(p): group["lr"] for group in trainer.optimizer.param_groups for p in group["params"]}
    trainable = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    block_diagonal = {n for n in trainable if n.endswith(BLOCK_DIAGONAL[family])}
    assert block_diagonal and len(block_diagonal) < len(trainable)
    for name, param in trainable.items():
        expected = 3e-3 if name in block_diagonal else 1e-3
        assert lr_of[id(param)] == pytest.approx(expected), name


@pytest.mark.parametrize("family", ["phi3", "mixtral"])
def test_matched_lora_params_of_a_run_is_what_bdlora_budget_counts(family, capsys):
    """The "x LoRA" a BD run reports uses the same LoRA baseline as `bdlora budget` (LoRA on exactly the modules
    BD-LoRA adapts: on Phi-3 the fused qkv_proj / gate_up_proj, on Mixtral the experts)."""
    from bdlora_train import cli
    from bdlora_train.models import build_tiny_model
    from bdlora_train.recipe.schema import Recipe
    from bdlora_train.train.run_plan import plan_run

    # a recipe, not a run: built by hand because the rank comes from match_budget_of_lora_rank (tiny_recipe sets lora_r)
    recipe = Recipe(model=f"tiny:{family}", nblocks=2, match_budget_of_lora_rank=4).validate()
    plan = plan_run(recipe, build_tiny_model(family))
    assert cli.main(["budget", "--model", f"tiny:{family}", "--lora-ranks", "4", "--nblocks", "2", "--json"]) == 0
    budget = json.loads(capsys.readouterr().out)
    lora_row = next(row for row in budget["rows"] if row["method"] == "lora")
    assert plan.matched_lora_params == lora_row["params"] > 0
