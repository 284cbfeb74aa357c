"""trainer/optim.py: the `bd_lr_ratio: auto` rule, LoRA+ (`loraplus_lr_ratio`), and how the two are kept apart.

The rule's claim is tested, not its formula: after one Adam step from the same state, a block-diagonal factor trained
at `auto` x the learning rate lowers the loss (to first order, sum of gradient x update) as much as the same factor of
dense LoRA at the same rank; at ratio 1 it lowers it nblocks times less. A rule of sqrt(nblocks) or 1 fails this.
"""

import json

import pytest
import torch

from bdlora_train import BlockDiagLoraConfig, build_tiny_model, get_peft_model
from bdlora_train.comparison import grid
from bdlora_train.comparison.compare import build_recipe
from bdlora_train.comparison.per_run import run_recipe_for
from bdlora_train.comparison.planning import plan_runs
from bdlora_train.core.errors import RecipeError
from bdlora_train.recipe.load import load_recipe
from bdlora_train.recipe.methods import AdapterKeys
from bdlora_train.train import train
from bdlora_train.trainer.optim import lr_multipliers, param_groups, resolve_bd_lr_ratio

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

NBLOCKS, RANK = 4, 32
BD_B, BD_A = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"], ["o_proj", "down_proj"]
BD_LR_RATIO_DEFAULT = AdapterKeys.__dataclass_fields__["bd_lr_ratio"].default
IDS = torch.randint(4, 256, (4, 32), generator=torch.Generator().manual_seed(0))


def _adapted(targets, nblocks, use_rslora):
    """The tiny Llama (4 KV heads, so 4 blocks line up) with LoRA (nblocks None) or BD-LoRA on `targets`."""
    from peft import LoraConfig

    base = build_tiny_model("llama", num_key_value_heads=4)
    common = dict(r=RANK, lora_alpha=2 * RANK, target_modules=targets, use_rslora=use_rslora)
    config = LoraConfig(**common) if nblocks is None else BlockDiagLoraConfig(nblocks=nblocks, **common)
    return get_peft_model(base, config)


def _first_order_gain(model, factor: str, ratio: float, lr: float = 1e-4) -> float:
    """Loss decrease to first order, sum(grad x update), of one AdamW step in which only the `factor` weights
    ("lora_A" or "lora_B") train, with the param groups optim.py builds; per unit learning rate."""
    for name, p in model.named_parameters():
        p.requires_grad_(factor in name)
    model.zero_grad()
    model(input_ids=IDS, labels=IDS).loss.backward()
    grads = {id(p): p.grad.clone() for p in model.parameters() if p.requires_grad}
    before = {id(p): p.detach().clone() for p in model.parameters() if p.requires_grad}
    groups = param_groups(model, lr, 0.0, [], lr_multipliers(model, ratio, 1.0))
    torch.optim.AdamW(groups, weight_decay=0.0, eps=1e-16).step()
    change = sum((grads[id(p)] * (p.detach() - before[id(p)])).sum() for p in model.parameters() if p.requires_grad)
    return -float(change) / lr


def _copy_factor(src, dst, factor: str) -> None:
    """The same values for `factor` in both models (it has the same, dense shape in both)."""
    dst_params = dict(dst.named_parameters())
    with torch.no_grad():
        for name, p in src.named_parameters():
            if factor in name:
                dst_params[name].copy_(p)


@pytest.mark.parametrize("use_rslora", [False, True])
@pytest.mark.parametrize("role", ["bd_b", "bd_a"])
def test_auto_ratio_makes_a_block_diagonal_factor_step_as_far_as_its_dense_counterpart(role, use_rslora):
    """bd_b: the block-diagonal B of q/k/v/gate/up, B from zero, A the same in both models. bd_a: the block-diagonal A
    of o/down, B the same non-zero values in both (at zero init A has no gradient yet). rsLoRA scales both models
    alike, so the same ratio holds with it."""
    targets, trained, shared = (BD_B, "lora_B", "lora_A") if role == "bd_b" else (BD_A, "lora_A", "lora_B")
    lora, bd = _adapted(targets, None, use_rslora), _adapted(targets, NBLOCKS, use_rslora)
    if role == "bd_a":
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in sorted(lora.named_parameters()):
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
    _copy_factor(lora, bd, shared)
    auto = resolve_bd_lr_ratio("auto", NBLOCKS)
    dense = _first_order_gain(lora, trained, 1.0)
    at_one = _first_order_gain(bd, trained, 1.0)
    at_auto = _first_order_gain(bd, trained, auto)
    assert dense > 0 and at_one > 0
    assert at_one / dense == pytest.approx(1 / NBLOCKS, rel=0.2)  # the fan-in deficit the rule corrects
    assert at_auto / dense == pytest.approx(1.0, rel=0.2)  # sqrt(nblocks) would give 0.5, ratio 1 would give 0.25
    assert resolve_bd_lr_ratio(2.5, NBLOCKS) == 2.5  # a number is used as given


def _trained_groups(tmp_path, tiny_inputs, tiny_recipe, monkeypatch, model=None, **overrides):
    """(lr of every trainable parameter by name, metrics) of a 1-step constant-lr run at lr 1e-3."""
    import bdlora_train.train.setup as run_module

    seen = []
    real = run_module.apply_lr_ratios
    monkeypatch.setattr(run_module, "apply_lr_ratios", lambda trainer, *a: seen.append(trainer) or real(trainer, *a))
    base, tok, rows = tiny_inputs
    recipe = tiny_recipe(tmp_path, max_steps=1, learning_rate=1e-3, lr_scheduler_type="constant", **overrides)
    result = train(recipe, model if model is not None else base, tok, rows)
    trainer = seen[0]
    lr_of = {id(p): g["lr"] for g in trainer.optimizer.param_groups for p in g["params"]}
    named = {n: lr_of[id(p)] for n, p in trainer.model.named_parameters() if p.requires_grad}
    return named, result


def test_loraplus_trains_lora_b_at_the_ratio_and_lora_a_at_the_base_rate(
    tmp_path, tiny_inputs, tiny_recipe, monkeypatch
):
    lrs, result = _trained_groups(tmp_path, tiny_inputs, tiny_recipe, monkeypatch, method="lora", loraplus_lr_ratio=4)
    assert {n for n in lrs if "lora_B" in n} and {n for n in lrs if "lora_A" in n}
    for name, lr in lrs.items():
        assert lr == pytest.approx(4e-3 if "lora_B" in name else 1e-3), name
    # Adam's first step moves B (from zero) by ~its own lr; A has no gradient yet at B = 0.
    b = [p.detach().abs().max().item() for n, p in result.model.named_parameters() if "lora_B" in n]
    assert max(b) == pytest.approx(4e-3, rel=1e-3)
    assert result.metrics["loraplus_lr_ratio"] == 4.0 and result.metrics["bd_lr_ratio"] is None
    card = (result.adapter_dir / "README.md").read_text()
    assert "learning rate of lora_B: 4x the base rate (LoRA+, loraplus_lr_ratio)" in card


def test_the_default_bd_lr_ratio_is_auto_nblocks_recorded_in_metrics_and_card(
    tmp_path, tiny_inputs, tiny_recipe, monkeypatch
):
    """A BD recipe that does not name bd_lr_ratio trains its block-diagonal factors at nblocks x learning_rate: the
    default the 3-seed sweep supports (docs/compare.md)."""
    assert BD_LR_RATIO_DEFAULT == "auto"
    lrs, result = _trained_groups(tmp_path, tiny_inputs, tiny_recipe, monkeypatch)  # nblocks 2, no bd_lr_ratio
    assert sorted(set(lrs.values())) == pytest.approx([1e-3, 2e-3])
    assert result.metrics["bd_lr_ratio"] == 2.0 and result.metrics["loraplus_lr_ratio"] is None
    assert json.loads((tmp_path / "metrics.json").read_text())["bd_lr_ratio"] == 2.0
    assert "bd_lr_ratio: auto" in (tmp_path / "recipe.yaml").read_text()  # the recipe keeps what was asked
    card = (result.adapter_dir / "README.md").read_text()
    assert "learning rate of the block-diagonal factors: 2x the base rate (bd_lr_ratio)" in card


def test_lora_at_the_defaults_trains_every_factor_at_the_base_rate(tmp_path, tiny_inputs, tiny_recipe, monkeypatch):
    """The default `auto` is a BD-LoRA rule: plain LoRA keeps one rate (the Trainer's optimizer), refuses nothing."""
    lrs, result = _trained_groups(tmp_path, tiny_inputs, tiny_recipe, monkeypatch, method="lora", nblocks=None)
    assert lrs and sorted(set(lrs.values())) == pytest.approx([1e-3])
    assert result.metrics["bd_lr_ratio"] is None and result.metrics["loraplus_lr_ratio"] == 1.0
    assert "learning rate of" not in (result.adapter_dir / "README.md").read_text()


def test_bd_lr_ratio_auto_reaches_the_factors_on_a_4bit_base(tmp_path, tiny_inputs, tiny_recipe, monkeypatch):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes not installed: pip install -e '.[quant]'")
    from bdlora_train.models import load_model
    from bdlora_train.peft_integration.layers import block_diagonal_factors
    from bdlora_train.quant.quantized import quantization_config

    quant = dict(load_in_4bit=True, bnb_4bit_compute_dtype="float32")
    keys = load_recipe(None, ["model=tiny:llama", "load_in_4bit=true", "bnb_4bit_compute_dtype=float32"]).quant_keys
    base = load_model("tiny:llama", quantization=quantization_config(keys))[0]
    lrs, result = _trained_groups(tmp_path, tiny_inputs, tiny_recipe, monkeypatch, base, bd_lr_ratio="auto", **quant)
    bd = {id(p) for p in block_diagonal_factors(result.model)}
    named = dict(result.model.named_parameters())
    assert bd and len(bd) < len(lrs)
    for name, lr in lrs.items():
        assert lr == pytest.approx(2e-3 if id(named[name]) in bd else 1e-3), name


def test_loraplus_and_bd_lr_ratio_never_both_apply():
    """LoRA+ on a BD method would multiply with bd_lr_ratio on the block-diagonal B of column-parallel layers: refused
    in one line, as bd_lr_ratio is for LoRA; the optimizer grouping refuses the pair too."""
    with pytest.raises(RecipeError, match="loraplus_lr_ratio=3 is LoRA\\+ for method=lora") as err:
        load_recipe(None, ["method=bdlora", "loraplus_lr_ratio=3"])
    assert "\n" not in str(err.value)
    with pytest.raises(RecipeError, match="loraplus_lr_ratio=2 is LoRA\\+"):
        load_recipe(None, ["method=peft-bdlora", "bd_lr_ratio=1", "loraplus_lr_ratio=2"])
    with pytest.raises(RecipeError, match="bd_lr_ratio=3.0 applies to block-diagonal methods"):
        load_recipe(None, ["method=lora", "bd_lr_ratio=3"])
    with pytest.raises(RecipeError, match="bd_lr_ratio='fast'; use auto"):
        load_recipe(None, ["bd_lr_ratio=fast"])
    with pytest.raises(RecipeError, match="loraplus_lr_ratio=0.0 must be > 0"):
        load_recipe(None, ["method=lora", "loraplus_lr_ratio=0"])
    with pytest.raises(RecipeError, match="would both scale"):
        lr_multipliers(torch.nn.Linear(2, 2), 3.0, 2.0)
    assert load_recipe(None, ["method=lora", "loraplus_lr_ratio=3"]).loraplus_lr_ratio == 3.0


def test_compare_grids_each_method_on_its_own_ratio(tmp_path):
    """--grid loraplus_lr_ratio=1,3 bd_lr_ratio=1,auto: LoRA trains the two LoRA+ points, BD-LoRA the two bd_lr_ratio
    points, none trains both; --set loraplus_lr_ratio reaches LoRA only."""
    axes = grid.parse_grid(["loraplus_lr_ratio=1,3", "bd_lr_ratio=1,auto"])
    settings = grid.typed_settings(axes, lambda point: build_recipe(None, "tiny:llama", 2, (), point))
    plan = [{"lora": {"r": 4, "nblocks": 1}, "matched": {"r": 4, "nblocks": 2}, "double": {"r": 8, "nblocks": 2}}]
    runs = plan_runs(["analogies"], plan, [0], with_base=False, settings=settings)
    by_method: dict = {}
    for run in runs:
        by_method.setdefault((run.method, run.r), []).append(dict(run.setting))
    assert by_method[("lora", 4)] == [{"loraplus_lr_ratio": 1.0}, {"loraplus_lr_ratio": 3.0}]
    assert by_method[("bdlora", 4)] == [{"bd_lr_ratio": 1.0}, {"bd_lr_ratio": "auto"}]
    shared = build_recipe(None, "tiny:llama", 2, ("loraplus_lr_ratio=3", "bd_lr_ratio=2"))
    for run in plan_runs(["analogies"], plan, [0], with_base=False):
        recipe = run_recipe_for(run, shared, tmp_path / run.run_id)
        assert recipe.loraplus_lr_ratio == (3.0 if run.method == "lora" else 1.0), run.run_id
        assert recipe.bd_lr_ratio == (BD_LR_RATIO_DEFAULT if run.method == "lora" else 2.0), run.run_id
    with pytest.raises(RecipeError, match="loraplus_lr_ratio=-1.0 must be > 0"):
        build_recipe(None, "tiny:llama", 2, ("loraplus_lr_ratio=-1",))


def test_launch_modes_that_would_drop_the_groups_are_refused():
    """A DeepSpeed config with its own optimizer and FSDP1 build the optimizer without the Trainer's param groups: the
    ratios would be silently lost, so both are refused in one line (FSDP2 and DeepSpeed without one take them)."""
    from types import SimpleNamespace

    from bdlora_train.trainer.optim import check_optimizer_route

    def trainer(ds_config=None, fsdp_version=None):
        return SimpleNamespace(
            args=SimpleNamespace(hf_deepspeed_config=SimpleNamespace(config=ds_config) if ds_config else None),
            is_deepspeed_enabled=ds_config is not None,
            is_fsdp_enabled=fsdp_version is not None,
            accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version))),
        )

    with pytest.raises(RecipeError, match="DeepSpeed config defines its own 'optimizer'.*set bd_lr_ratio=1"):
        check_optimizer_route(trainer({"optimizer": {"type": "AdamW"}, "zero_optimization": {}}), "bd_lr_ratio")
    with pytest.raises(RecipeError, match="loraplus_lr_ratio needs FSDP2"):
        check_optimizer_route(trainer(fsdp_version=1), "loraplus_lr_ratio")
    check_optimizer_route(trainer({"zero_optimization": {"stage": 3}}), "bd_lr_ratio")
    check_optimizer_route(trainer(fsdp_version=2), "bd_lr_ratio")
    check_optimizer_route(trainer(), "bd_lr_ratio")
