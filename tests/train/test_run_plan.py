"""One plan per run (train/run_plan.py) and one nblocks precedence (core/heads.py `choose_nblocks`) everywhere."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.train import Recipe, train

# tiny:llama has 4 heads / 2 KV heads (default nblocks 2), tiny:phi 4 / 4 (default 4): the defaults differ.
DEFAULTS = {"tiny:llama": 2, "tiny:phi": 4}


def _meta(spec: str):
    from bdlora_train.models import load_config, meta_model

    return meta_model(load_config(spec))


def _planned_nblocks(spec: str, *overrides: str) -> int:
    """nblocks as `bdlora train` plans it (the recipe resolved as --print-recipe shows it, planned on the model)."""
    from bdlora_train.recipe.load import load_recipe
    from bdlora_train.train.run_plan import plan_run

    return plan_run(load_recipe(None, [f"model={spec}", *overrides]), _meta(spec)).nblocks


def _compare_nblocks(spec: str, tmp_path, capsys, *overrides: str) -> int:
    from bdlora_train.cli import main

    args = ["compare", "--model", spec, "--lora-ranks", "8", "--out", str(tmp_path / "cmp"), "--dry-run"]
    assert main(args + (["--set", *overrides] if overrides else [])) == 0
    planned = re.search(rf"bdlora compare: {re.escape(spec)}, nblocks (\d+),", capsys.readouterr().err)
    assert planned, "the dry run names the sweep's nblocks"
    return int(planned.group(1))


def _budget_nblocks(spec: str, capsys) -> int:
    from bdlora_train.cli import main

    assert main(["budget", "--model", spec, "--lora-ranks", "8", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["nblocks"]


@pytest.mark.parametrize("spec", sorted(DEFAULTS))
def test_train_compare_and_budget_choose_the_same_default_nblocks(spec, tmp_path, capsys):
    planned = _planned_nblocks(spec)
    assert planned == DEFAULTS[spec]
    assert _compare_nblocks(spec, tmp_path, capsys) == planned
    assert _budget_nblocks(spec, capsys) == planned


def test_an_explicit_nblocks_wins_everywhere_and_the_tp_degree_beats_the_heads_default(tmp_path, capsys):
    from bdlora_train.cli import main
    from bdlora_train.core.heads import choose_nblocks

    assert _planned_nblocks("tiny:phi", "nblocks=2") == 2
    assert _compare_nblocks("tiny:phi", tmp_path, capsys, "nblocks=2") == 2
    assert main(["budget", "--model", "tiny:phi", "--lora-ranks", "8", "--nblocks", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["nblocks"] == 2
    # under TP the adapter gets whole blocks per rank: nblocks follows tp_size (4 would be the heads' default)
    assert _planned_nblocks("tiny:phi", "tp_size=2") == 2
    assert _compare_nblocks("tiny:phi", tmp_path, capsys, "tp_size=2") == 2
    assert choose_nblocks(_meta("tiny:phi").config, None, 2) == 2
    assert choose_nblocks(_meta("tiny:phi").config, 4, 2) == 4
    with pytest.raises(BlockDiagLoraConfigError, match=r"nblocks=0 must be a positive int"):
        choose_nblocks(_meta("tiny:phi").config, 0)


def _count_resolutions(monkeypatch) -> list:
    """Every call of peft_integration/resolve.py `resolve`, wherever it was imported from."""
    import bdlora_train.budget as budget
    import bdlora_train.peft_integration.config as config
    import bdlora_train.peft_integration.resolve as resolve_module

    calls = []
    real = resolve_module.resolve

    def counted(*args, **kwargs):
        calls.append(args[2] if len(args) > 2 else kwargs.get("nblocks"))
        return real(*args, **kwargs)

    for module in (resolve_module, config, budget):
        monkeypatch.setattr(module, "resolve", counted)
    return calls


def test_a_budget_matched_run_resolves_its_targets_once_and_records_the_plan(
    tmp_path, tiny_inputs, tiny_recipe, monkeypatch
):
    from bdlora_train.budget import count_adapter_params, lora_baseline, match_budget
    from bdlora_train.models import build_tiny_model

    base, tok, rows = tiny_inputs
    reference = build_tiny_model("llama")
    expected_r = match_budget(reference, 8, 2)
    expected_lora = count_adapter_params(reference, lora_baseline(reference, 8, 2))
    calls = _count_resolutions(monkeypatch)
    recipe = tiny_recipe(tmp_path / "run", lora_r=None, match_budget_of_lora_rank=8, lora_alpha_ratio=2, max_steps=1)
    result = train(recipe, base, tok, rows)
    assert calls == [2]  # the plan's one resolution: not the budget's, the config's and the adapter's again
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["r"] == expected_r and metrics["lora_alpha"] == 2 * expected_r
    assert metrics["matched_lora_rank"] == 8 and metrics["matched_lora_params"] == expected_lora
    assert metrics["nblocks"] == 2 and metrics["bd_lr_ratio"] == 2.0 and metrics["loraplus_lr_ratio"] is None
    assert result.metrics == metrics


def test_the_tp_plan_is_made_once_on_the_meta_model_with_one_head_check(monkeypatch):
    import bdlora_train.arch.checks as checks
    from bdlora_train.peft_integration.config import BlockDiagLoraConfig
    from bdlora_train.train.run_plan import check_model_parallel

    labels = []
    real = checks.check_heads
    monkeypatch.setattr(checks, "check_heads", lambda config, degree, label="nblocks", **kw: labels.append(label)
                        or real(config, degree, label=label, **kw))
    calls = _count_resolutions(monkeypatch)
    plan = check_model_parallel(Recipe(model="tiny:llama", tp_size=2, lora_r=4).validate())
    assert labels.count("tp_size") == 1 and calls == [2]
    assert plan.nblocks == 2 and set(plan.tp_styles) == set(plan.targets) and len(plan.targets) == 14
    assert isinstance(plan.peft_config, BlockDiagLoraConfig) and plan.peft_config.is_prepared
    assert set(plan.roles.values()) == {"bd_a", "bd_b"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.nblocks = 4


def test_plain_lora_outside_tp_resolves_nothing(monkeypatch):
    from bdlora_train.models import build_tiny_model
    from bdlora_train.train.run_plan import plan_run

    calls = _count_resolutions(monkeypatch)
    plan = plan_run(Recipe(model="tiny:llama", method="lora", lora_r=4, loraplus_lr_ratio=4).validate(),
                    build_tiny_model("llama"))
    assert calls == [] and plan.targets is None and plan.nblocks == 1
    assert plan.lr_ratios == (1.0, 4.0) and plan.metrics()["bd_lr_ratio"] is None
