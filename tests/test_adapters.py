"""Saved adapters: stock PEFT loads them without bdlora_train; `bdlora inspect` describes them."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from bdlora_train import BlockDiagLoraConfig, build_tiny_model, get_peft_model
from bdlora_train.adapters.reader import read_adapter
from bdlora_train.cli import main

STOCK_LOAD = textwrap.dedent(
    """
    import sys, torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from peft import PeftModel
    base_dir, adapter_dir, io = sys.argv[1:4]
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    ids = load_file(io + "/ids.safetensors")["ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert "bdlora_train" not in sys.modules
    save_file({"logits": logits.contiguous()}, io + "/stock.safetensors")
    """
)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_stock_peft_loads_toolkit_adapter_with_same_logits(tmp_path, family):
    base = build_tiny_model(family)
    base.save_pretrained(tmp_path / "base")
    model = get_peft_model(base, BlockDiagLoraConfig(r=4, nblocks=2, lora_alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(0, 256, (2, 11))
    save_file({"ids": ids}, tmp_path / "ids.safetensors")
    with torch.no_grad():
        ours = model.eval()(ids).logits
    script = tmp_path / "stock_load.py"
    script.write_text(STOCK_LOAD)
    subprocess.run(
        [sys.executable, str(script), str(tmp_path / "base"), str(tmp_path / "adapter"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    stock = load_file(tmp_path / "stock.safetensors")["logits"]
    with torch.no_grad(), model.disable_adapter():
        plain = model(ids).logits  # sanity: the adapter is not a no-op
    assert rel_err(stock, ours) < 1e-6
    assert rel_err(plain, ours) > 1e-3


def test_inspect_cli_lists_roles_shapes_and_tp_degrees(tmp_path, capsys):
    model = get_peft_model(
        build_tiny_model("llama", num_key_value_heads=4),
        BlockDiagLoraConfig(r=8, nblocks=4, target_modules=["q_proj", "o_proj"]),
    )
    model.save_pretrained(tmp_path)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    rows = {row["module"]: row for row in info["modules"]}
    assert rows["self_attn.q_proj"]["role"] == "bd_b" and rows["self_attn.q_proj"]["count"] == 2
    assert rows["self_attn.q_proj"]["B_packed"] == [64, 2] and rows["self_attn.q_proj"]["B_dense"] == [64, 8]
    assert rows["self_attn.o_proj"]["A_packed"] == [8, 16] and rows["self_attn.o_proj"]["A_dense"] == [8, 64]
    assert info["tp_degrees"] == [1, 2, 4] and info["native_tp"] == 4
    assert info["total_params"] == model.get_nb_trainable_parameters()[0]
    assert main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "Servable at TP 4 natively" in text and "| self_attn.o_proj | 2 | bd_a |" in text


def test_read_adapter_errors_are_one_line(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 1
    assert "no adapter_config.json" in capsys.readouterr().err
    model = get_peft_model(build_tiny_model("llama"), BlockDiagLoraConfig(r=4, nblocks=2, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[key] = torch.zeros(64, 3)  # not r/nblocks columns
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"q_proj \(bd_b\) has lora_A \(4, 64\) and lora_B \(64, 3\)"):
        read_adapter(tmp_path)
