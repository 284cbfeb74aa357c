"""adapters.describe (what `bdlora inspect` prints) and adapters.shapes (an adapter checked against its base).

Hand-worked numbers for the tiny Llama at r=4, nblocks=2 (hidden 64, intermediate 128, KV width 32):
  q_proj BD-B: A (4, 64), packed B (64, 2): 256 + 128 = 384;  k_proj: A (4, 64), packed B (32, 2): 320
  o_proj BD-A: packed A (4, 32), B (64, 4): 128 + 256 = 384;  down_proj: packed A (4, 64), B (64, 4): 512
  gate/up BD-B: A (4, 64), packed B (128, 2): 512;  two layers: 2 x 2944 = 5888.
"""

import json

import pytest
import torch

from bdlora_train import BlockDiagLoraConfig, get_peft_model
from bdlora_train.adapters.describe import describe, module_table
from bdlora_train.adapters.reader import read_adapter
from bdlora_train.adapters.shapes import (
    base_identity,
    base_model_for,
    expert_parameter,
    verify_expert_shape,
    verify_shapes,
)
from bdlora_train.core.errors import AdapterError, BlockDiagLoraError
from bdlora_train.models import build_tiny_model, meta_model, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bd_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("describe") / "bd"
    get_peft_model(build_tiny_model("llama"), BlockDiagLoraConfig(r=4, nblocks=2)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def adapter(bd_dir):
    return read_adapter(bd_dir)


@pytest.fixture(scope="module")
def lora_adapter(tmp_path_factory):
    from peft import LoraConfig
    from peft import get_peft_model as peft_model

    path = tmp_path_factory.mktemp("describe") / "lora"
    peft_model(build_tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(path)
    return read_adapter(path)


# ---------------------------------------------------------------------------------------------------- describe


def test_describe_groups_modules_by_kind(adapter):
    info = describe(adapter)
    assert (info["bdlora"], info["use_bdlora"], info["nblocks"], info["native_tp"]) == (True, True, 2, 2)
    assert info["total_params"] == 5888
    assert info["tp_degrees"] == [1, 2]
    assert info["base_model"] == "tiny:llama"
    assert info["dense_stored"] == []
    rows = {row["module"]: row for row in info["modules"]}
    assert sorted(rows) == [
        "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj",
        "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj",
    ]  # fmt: skip
    assert {row["count"] for row in rows.values()} == {2}
    q = rows["self_attn.q_proj"]
    assert (q["role"], q["nblocks"], q["r"], q["params"]) == ("bd_b", 2, 4, 384)
    assert (q["A_packed"], q["B_packed"], q["A_dense"], q["B_dense"]) == ([4, 64], [64, 2], [4, 64], [64, 4])
    o = rows["self_attn.o_proj"]
    assert (o["role"], o["A_packed"], o["B_packed"], o["A_dense"], o["params"]) == (
        "bd_a",
        [4, 32],
        [64, 4],
        [4, 64],
        384,
    )
    assert rows["self_attn.k_proj"]["params"] == 320 and rows["mlp.down_proj"]["params"] == 512


def test_describe_per_module_lists_every_module(adapter):
    rows = describe(adapter, per_module=True)["modules"]
    assert len(rows) == 14 and "count" not in rows[0]
    assert "model.layers.1.mlp.up_proj" in {row["module"] for row in rows}
    assert sum(row["params"] for row in rows) == 5888


def test_describe_of_a_plain_lora_adapter(lora_adapter):
    info = describe(lora_adapter)
    assert (info["bdlora"], info["use_bdlora"], info["native_tp"], info["tp_degrees"]) == (False, False, None, [1])
    (row,) = info["modules"]
    assert (row["module"], row["role"], row["count"], row["params"]) == ("self_attn.q_proj", "lora", 2, 512)
    assert info["total_params"] == 1024


def test_module_table_rows(adapter):
    lines = module_table(describe(adapter))
    assert lines[0].startswith("| module | count | role |") and lines[1].startswith("|---|")
    assert len(lines) == 2 + 7
    assert "| self_attn.q_proj | 2 | bd_b | 4 | (4, 64) | (4, 64) | (64, 2) | (64, 4) | 384 |" in lines
    assert "| mlp.gate_proj | 2 | bd_b | 4 | (4, 64) | (4, 64) | (128, 2) | (128, 4) | 512 |" in lines


def test_module_table_of_a_per_module_description_counts_one_each(adapter):
    lines = module_table(describe(adapter, per_module=True))
    assert len(lines) == 2 + 14 and all(" | 1 | " in line for line in lines[2:])


def test_describe_of_dense_stored_expert_factors(tmp_path):
    path = tmp_path / "mixtral"
    get_peft_model(build_tiny_model("mixtral"), BlockDiagLoraConfig(r=4, nblocks=2)).save_pretrained(path)
    info = describe(read_adapter(path))
    assert info["bdlora"] and not info["use_bdlora"]  # a plain LoRA file to PEFT, BD-LoRA by its layout file
    assert info["native_tp"] == 2 and info["tp_degrees"] == [2]
    assert "gate_up_proj" in info["dense_stored"] and "down_proj" in info["dense_stored"]
    rows = {row["module"]: row for row in info["modules"]}
    gate_up = rows["mlp.experts.gate_up_proj"]
    assert gate_up["role"] == "bd_b (dense, experts segments [64, 64])"
    assert gate_up["params"] == 4 * 4 * (64 + 128)  # stored dense: 4 experts x r(d_in + d_out)


# ------------------------------------------------------------------------------------------------------ shapes


def test_verify_shapes_accepts_the_base_it_was_trained_on(adapter):
    verify_shapes(adapter, meta_model(tiny_config("llama")))
    verify_shapes(adapter, base_model_for(adapter))


def test_verify_shapes_refuses_a_base_of_other_widths(adapter):
    wider = meta_model(tiny_config("llama", hidden_size=128, intermediate_size=256, head_dim=32))
    with pytest.raises(AdapterError) as info:
        verify_shapes(adapter, wider)
    message = str(info.value)
    # the first module checked is model.layers.0's down_proj: 128 -> 64 in the adapter, 256 -> 128 in this base
    assert "\n" not in message
    assert "mlp.down_proj (bd_a, nblocks=2) factors give 128 -> 64, the base Linear is 256 -> 128" in message
    assert "pass the base it was trained on" in message


def test_verify_shapes_refuses_a_base_without_the_module(adapter):
    one_layer = meta_model(tiny_config("llama", num_hidden_layers=1))
    with pytest.raises(AdapterError, match=r"module model\.layers\.1\.\S+ does not exist in the base model; pass"):
        verify_shapes(adapter, one_layer)


def test_verify_shapes_catches_an_edited_nblocks(tmp_path):
    """The file alone cannot show it: o_proj's packed A (4, 32) at nblocks=4 reads as d_in 4 x 32 = 128."""
    edited = tmp_path / "edited"
    config = BlockDiagLoraConfig(r=4, nblocks=2, target_modules=["o_proj"])
    get_peft_model(build_tiny_model("llama"), config).save_pretrained(edited)
    config = json.loads((edited / "adapter_config.json").read_text())
    config["use_bdlora"]["nblocks"] = 4
    (edited / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=r"o_proj \(bd_a, nblocks=4\) factors give 128 -> 64"):
        verify_shapes(read_adapter(edited), meta_model(tiny_config("llama")))


def test_expert_parameter_and_verify_expert_shape(tmp_path):
    path = tmp_path / "mixtral"
    get_peft_model(build_tiny_model("mixtral"), BlockDiagLoraConfig(r=4, nblocks=2)).save_pretrained(path)
    adapter = read_adapter(path)
    base = meta_model(tiny_config("mixtral"))
    param, transposed = expert_parameter(base, "model.layers.0.mlp.experts.gate_up_proj")
    assert tuple(param.shape) == (4, 128, 64) and transposed is False
    assert expert_parameter(base, "model.layers.0.mlp.nothing.gate_up_proj") == (None, False)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    verify_expert_shape(adapter, base, name, adapter.modules[name])
    verify_shapes(adapter, base)
    other = meta_model(tiny_config("mixtral", num_local_experts=8))
    with pytest.raises(AdapterError, match=r"factors give 4 experts 64 -> 128, the base parameter is \(8, 128, 64\)"):
        verify_expert_shape(adapter, other, name, adapter.modules[name])


def test_base_identity(adapter, tmp_path):
    assert base_identity(adapter, "tiny:llama")[0] == "same"
    verdict, message = base_identity(adapter, "tiny:qwen2")
    assert verdict == "other" and "tiny:qwen2 is not the base the adapter was trained on (tiny:llama)" in message
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps({"model_type": "llama", "_name_or_path": "tiny:llama"}))
    assert base_identity(adapter, str(copy))[0] == "same"
    unnamed = tmp_path / "unnamed"
    unnamed.mkdir()
    (unnamed / "config.json").write_text(json.dumps({"model_type": "llama"}))
    verdict, message = base_identity(adapter, str(unnamed))
    assert verdict == "unknown" and "make sure it is a copy of that model" in message
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert base_identity(adapter, str(broken))[0] == "unknown"


def test_base_model_for_an_unknown_base_says_to_pass_model(adapter, tmp_path):
    base = base_model_for(adapter, "tiny:llama")
    assert next(base.parameters()).device == torch.device("meta")
    with pytest.raises(AdapterError) as info:
        base_model_for(adapter, str(tmp_path / "no" / "such" / "base"))
    message = str(info.value)
    assert "\n" not in message and "is needed to check the factor shapes" in message and "pass --model" in message
    assert isinstance(info.value, BlockDiagLoraError)
