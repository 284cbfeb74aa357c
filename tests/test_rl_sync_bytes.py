"""scripts/rl_sync_bytes.py against counts derived by hand from Llama-3.1-8B's published shapes."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "rl_sync_bytes.py"

# Llama-3.1-8B (config.json): hidden 4096, MLP 14336, 32 layers, 32 heads / 8 KV heads of 128, vocab 128256, untied
H, MLP, LAYERS, KV, VOCAB = 4096, 14336, 32, 1024, 128256
# (d_in, d_out) of the 7 projections; column-parallel ones (B block-diagonal) and row-parallel ones (A)
COLUMN = {"q": (H, H), "k": (H, KV), "v": (H, KV), "gate": (H, MLP), "up": (H, MLP)}
ROW = {"o": (H, H), "down": (MLP, H)}


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("rl_sync_bytes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def llama8b(script):
    model = script.meta_model(script.load_config("meta-llama/Llama-3.1-8B"))
    bd, sides, tp = script.count_recipe("recipes/llama-3.1-8b/openorca/bdlora_r32.yaml", model, None, None)
    lora, _, _ = script.count_recipe("recipes/llama-3.1-8b/openorca/lora_r16.yaml", model, tp, sides)
    return bd, lora


def test_lora_r16_by_hand(llama8b):
    r = 16
    per_layer = sum(r * (d_in + d_out) for d_in, d_out in [*COLUMN.values(), *ROW.values()])
    assert per_layer == 1_310_720
    row = llama8b[1]
    assert (row["method"], row["r"]) == ("lora", 16)
    assert row["adapter_params"] == row["adapter_stored_elements"] == LAYERS * per_layer == 41_943_040
    assert row["adapter_bytes_saved"] == 4 * 41_943_040
    # vLLM's own TP-8 slicing: column-parallel layers keep all of A, row-parallel ones all of B
    kept = sum(r * d_in + r * d_out // 8 for d_in, d_out in COLUMN.values())
    kept += sum(r * d_in // 8 + r * d_out for d_in, d_out in ROW.values())
    assert row["per_rank"]["adapter_keeps_params"] == LAYERS * kept


def test_bdlora_r32_nblocks8_by_hand(llama8b):
    r, n = 32, 8
    # the block-diagonal factor has 1/n of a dense factor's parameters: B (r x d_out) on column-parallel layers,
    # A (r x d_in) on row-parallel ones
    per_layer = sum(r * d_in + r * d_out // n for d_in, d_out in COLUMN.values())
    per_layer += sum(r * d_in // n + r * d_out for d_in, d_out in ROW.values())
    assert per_layer == 1_130_496
    row = llama8b[0]
    assert (row["method"], row["r"], row["nblocks"], row["server_tp"]) == ("bdlora", 32, 8, 8)
    assert row["adapter_params"] == row["adapter_stored_elements"] == LAYERS * per_layer == 36_175_872
    assert row["adapter_bytes_saved"] == 4 * 36_175_872
    assert row["per_rank"]["adapter_keeps_params"] * 8 == 36_175_872
    assert row["per_rank"]["adapter_reads_bytes"] == row["adapter_bytes_saved"]


def test_whole_model_and_merged_sync(llama8b):
    embeddings = 2 * VOCAB * H  # embed_tokens and lm_head, untied
    layer = sum(d_in * d_out for d_in, d_out in [*COLUMN.values(), *ROW.values()]) + 2 * H  # + 2 RMSNorms
    total = embeddings + LAYERS * layer + H  # + the final norm
    assert total == 8_030_261_248  # published
    for row in llama8b:
        assert row["model_params"] == 8_030_261_248
        assert row["merged_sync_bytes"] == row["per_rank"]["trl_receives_bytes"] == 2 * 8_030_261_248
        assert row["merged_over_adapter"] == round(2 * 8_030_261_248 / row["adapter_bytes_saved"], 2)


def test_saved_state_dict_is_the_count_in_fp32(script):
    """What PEFT's save_pretrained writes for the BD-LoRA recipe on a bf16 base: the counted elements, all fp32."""
    config = script.load_config("meta-llama/Llama-3.1-8B")
    saved = script.verify_saved("recipes/llama-3.1-8b/openorca/bdlora_r32.yaml", config)
    assert saved == {"elements": 36_175_872, "bytes": 4 * 36_175_872, "dtypes": ["float32"], "tensors": 448}


def test_committed_output_matches(script, llama8b):
    committed = json.loads((SCRIPT.parents[1] / "eval/bench/rl_sync_bytes.json").read_text())
    rows = {row["recipe"]: row for row in committed["rows"]}
    for row in llama8b:
        assert rows[row["recipe"]] == row
