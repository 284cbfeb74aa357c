"""Parameter counts are exact and the paper's matched budgets are reproduced."""

import json

import pytest
from peft import LoraConfig

from bdlora_train import BlockDiagLoraConfig, build_tiny_model, count_adapter_params, get_peft_model, match_budget
from bdlora_train.budget import budget_table
from bdlora_train.commands.budget import main as budget_main
from bdlora_train.core.roles import module_params
from bdlora_train.models import load_config, meta_model


@pytest.mark.parametrize(
    "cfg",
    [
        LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        BlockDiagLoraConfig(r=8, nblocks=2),
        BlockDiagLoraConfig(r=4, nblocks=2, rank_pattern={"down_proj": 8}, target_modules=["q_proj", "down_proj"]),
    ],
    ids=["lora", "bdlora", "bdlora-rank-pattern"],
)
def test_count_matches_what_peft_builds(cfg):
    model = build_tiny_model("qwen2")
    counted = count_adapter_params(meta_model(model.config), cfg)
    assert counted == get_peft_model(model, cfg).get_nb_trainable_parameters()[0]


def test_module_params_formula():
    assert module_params(None, 4096, 1024, 16) == 16 * (4096 + 1024)
    assert module_params("bd_b", 4096, 1024, 32, 8) == 32 * 4096 + 32 * 1024 // 8
    assert module_params("bd_a", 14336, 4096, 32, 8) == 32 * 14336 // 8 + 32 * 4096


@pytest.mark.parametrize(
    "name, ratios", [("meta-llama/Llama-3.1-8B", (0.86, 1.73)), ("meta-llama/Llama-3.1-70B", (0.87, 1.74))]
)
def test_paper_budgets(name, ratios):
    model = meta_model(load_config(name))
    lora = count_adapter_params(
        model,
        LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    )
    for rank, ratio in zip((32, 64), ratios):
        bd = count_adapter_params(model, BlockDiagLoraConfig(r=rank, nblocks=8))
        assert round(bd / lora, 2) == ratio
    assert match_budget(model, 16, 8, "below") == 32
    assert match_budget(model, 16, 8, "above") == 40
    assert match_budget(model, 16, 8, "nearest") == 40  # 40 -> 1.08x is closer to 1.0 than 32 -> 0.86x


def test_match_budget_modes_bracket_lora():
    model = meta_model(load_config("tiny:llama"))
    lora = count_adapter_params(
        model,
        LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    )
    below, above = match_budget(model, 8, 2, "below"), match_budget(model, 8, 2, "above")
    assert below % 2 == 0 and above % 2 == 0
    assert count_adapter_params(model, BlockDiagLoraConfig(r=below, nblocks=2)) <= lora
    assert count_adapter_params(model, BlockDiagLoraConfig(r=above, nblocks=2)) >= lora
    assert count_adapter_params(model, BlockDiagLoraConfig(r=below + 2, nblocks=2)) > lora
    with pytest.raises(ValueError, match="mode='sideways'"):
        match_budget(model, 8, 2, "sideways")


def test_budget_table_and_cli_json(capsys):
    rows = budget_table(meta_model(load_config("meta-llama/Llama-3.1-8B")), [16], 8)
    labels = {row["label"]: row for row in rows}
    assert labels["matched, paper 2x rank"]["r"] == 32 and labels["2x matched, paper 4x rank"]["r"] == 64
    assert budget_main(["--model", "meta-llama/Llama-3.1-8B", "--lora-rank", "16", "--nblocks", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [round(r["ratio"], 2) for r in out["rows"]] == [1.0, 0.86, 1.73]


def test_budget_cli_unknown_model_is_one_line_error(capsys):
    from bdlora_train.cli import main

    assert main(["budget", "--model", "no-such-org/no-such-model", "--lora-rank", "8"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("bdlora budget: error: --model no-such-org/no-such-model") and "\n" not in err
