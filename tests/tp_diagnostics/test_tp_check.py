"""Tensor-parallel checks on real gloo ranks: BD-LoRA adds no collective, S-LoRA does, sharded == unsharded.

Each 2-rank spawn costs ~10-20 s here, so several models ride in one spawn.
"""

import json

import pytest
from peft import LoraConfig

from bdlora_train import cli, get_peft_model
from bdlora_train.models import build_tiny_model, tiny_config
from bdlora_train.tp_diagnostics import TPError, random_adapter, tp_check


def _expected_counts(model_type: str, tokens: int, batch: int = 2):
    """Independent of tp.py: per decoder layer the base issues 2 all-reduces (o, down) of batch×tokens×hidden fp32."""
    config = tiny_config(model_type)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    return 2 * layers, 2 * layers * batch * tokens * hidden * 4


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory):
    return random_adapter(tmp_path_factory.mktemp("tp") / "llama-nb2", "tiny:llama", tp=2, r=4, seed=3)


OTHER_FAMILIES = ["tiny:qwen2", "tiny:mistral", "tiny:qwen3", "tiny:gemma", "tiny:gemma2"]


def test_two_ranks_llama_adapter_and_other_families(llama_adapter):
    """A saved Llama adapter plus random adapters on the other core families, all in one 2-rank spawn."""
    results = tp_check(llama_adapter, tp=2, tokens=8, extra_bases=OTHER_FAMILIES)
    assert [r["model"] for r in results] == ["tiny:llama"] + OTHER_FAMILIES
    for result in results:
        model_type = result["model"].split(":")[1]
        base_count, base_bytes = _expected_counts(model_type, tokens=8)
        layers = tiny_config(model_type).num_hidden_layers
        assert result["world_size"] == 2
        assert result["base_collectives"] == base_count and result["base_bytes"] == base_bytes
        assert result["bdlora_collectives"] == result["base_collectives"]  # zero extra collectives
        assert result["bdlora_bytes"] == result["base_bytes"]
        assert result["bdlora_ops"] == {"all_reduce": 2 * layers}
        # S-LoRA: per layer one all-gather for q|k|v, one for gate|up, one all-reduce each for o and down
        assert result["slora_collectives"] == result["base_collectives"] + 4 * layers
        assert result["slora_ops"] == {"all_reduce": 4 * layers, "all_gather_into_tensor": 2 * layers}
        assert result["slora_bytes"] > result["base_bytes"]
        assert result["adapter_effect"] > 1e-2, "the adapter must change the logits, or exactness proves nothing"
        assert result["max_rel_err"] < 1e-5 and result["slora_rel_err"] < 1e-5 and result["base_rel_err"] < 1e-5
        assert result["ok"]
    assert results[0]["r"] == 4 and results[0]["adapter"] == str(llama_adapter)


def test_cli_tp_check_builtin_tiny_json(capsys):
    assert cli.main(["tp-check", "--tp", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)  # --json: pure JSON on stdout
    assert result["world_size"] == 2 and result["model"] == "tiny:llama"
    assert result["bdlora_collectives"] == result["base_collectives"] < result["slora_collectives"]
    assert {"base_bytes", "bdlora_bytes", "slora_bytes", "max_rel_err"} <= set(result)
    assert result["max_rel_err"] < 1e-5
    from bdlora_train.commands.tp import format_check  # what is printed without --json

    assert any(line.startswith("| BD-LoRA |") for line in format_check(result).splitlines())


def test_bench_tp_small():
    from bdlora_train.tp_diagnostics import bench_tp

    result = bench_tp(tp=2, token_counts=[4, 32], base="tiny:llama", r=4, repeats=2)
    assert result["world_size"] == 2 and [row["tokens"] for row in result["rows"]] == [4, 32]
    for row in result["rows"]:
        assert min(row["base_ms"], row["bdlora_ms"], row["slora_ms"]) > 0
        assert row["bdlora_collectives"] == row["base_collectives"] < row["slora_collectives"]
        assert row["slora_base_collectives"] == row["base_collectives"]  # the two models shard the base alike
        assert row["slora_ratio"] == pytest.approx(row["slora_ms"] / row["slora_base_ms"])
        assert row["bdlora_ratio"] == pytest.approx(row["bdlora_ms"] / row["base_ms"])


# ------------------------------------------------------------------- errors before any rank is spawned


def test_tp_must_divide_kv_heads(tmp_path):
    tiny_config("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3).save_pretrained(tmp_path)
    with pytest.raises(TPError, match=r"--tp=2 does not divide num_key_value_heads=3: .*; use --tp in \[1, 3\]"):
        tp_check(None, tp=2, base=str(tmp_path))


def test_adapter_nblocks_not_multiple_of_tp(llama_adapter):
    with pytest.raises(TPError, match=r"nblocks=2 is not a multiple of --tp 4"):
        tp_check(llama_adapter, tp=4)


def test_plain_lora_refused(tmp_path, capsys):
    model = build_tiny_model("llama")
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    peft_model.peft_config["default"].base_model_name_or_path = "tiny:llama"
    peft_model.save_pretrained(str(tmp_path / "plain"))
    assert cli.main(["tp-check", str(tmp_path / "plain"), "--tp", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("bdlora tp-check: error:") and "plain LoRA" in err and len(err.splitlines()) == 1


def test_swapped_roles_refused(tmp_path):
    """An adapter whose block-diagonal factor is on the wrong side of a layer cannot be TP-sharded exactly."""
    from bdlora_train.peft_integration.config import BlockDiagLoraConfig

    model = build_tiny_model("llama")
    config = BlockDiagLoraConfig(r=4, nblocks=2, target_modules=["q_proj"], roles={"q_proj": "bd_a"})
    peft_model = get_peft_model(model, config)
    peft_model.peft_config["default"].base_model_name_or_path = "tiny:llama"
    peft_model.save_pretrained(str(tmp_path / "swapped"))
    with pytest.raises(TPError, match="column-parallel but the adapter stores role 'bd_a'"):
        tp_check(tmp_path / "swapped", tp=2)


@pytest.mark.slow
def test_embedded_smollm2_three_ranks():
    """The real SmolLM2-135M (9 heads / 3 KV heads) at TP 3: 30 layers, 2 base all-reduces each (~2.5 min here)."""
    result = tp_check(None, tp=3, base="embedded")[0]
    assert result["world_size"] == 3 and result["base_collectives"] == 60
    assert result["bdlora_collectives"] == 60 and result["slora_collectives"] == 180
    assert result["max_rel_err"] < 1e-4 and result["adapter_effect"] > 1e-2


def test_bench_tables_carry_a_noise_caveat_when_the_ratios_may_be_noise():
    """Issue 30: `bench-tp --repeats 2` (or timings far above their minima) says its ratios can be noise."""
    from pathlib import Path

    from bdlora_train.commands.tp import format_bench

    result = json.loads((Path(__file__).resolve().parents[2] / "docs" / "tp_bench_cpu_tp2.json").read_text())
    assert format_bench({**result, "repeats": 2}).splitlines()[-1] == (
        "caveat: each time is the median of only 2 timed forwards, so a ratio can be noise; re-run with --repeats 5 "
        "or more before reading a difference into it"
    )
    assert format_bench(result).splitlines()[-1] == (  # base at 16 tokens: 42.13 ms median, 30.9 ms fastest
        "caveat: the timings spread widely (base at 16 tokens: median 1.36x its fastest run), so a ratio can be "
        "noise; re-run on an idle machine or with more --repeats"
    )
    fast = ("base", "bdlora", "slora")
    steady = [{**row, **{f"{m}_min_ms": row[f"{m}_ms"] / 1.1 for m in fast}} for row in result["rows"]]
    text = format_bench({**result, "rows": steady})
    assert "caveat" not in text and text.splitlines()[-2].startswith("| 2048 |")  # the base line follows the rows
    assert text.splitlines()[-1].startswith("base: the training runtime's model with its adapter off")
