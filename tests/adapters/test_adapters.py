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


def _adapter(path, nblocks=4, r=8, **dims):
    model = get_peft_model(
        build_tiny_model("llama", num_key_value_heads=4, **dims),
        BlockDiagLoraConfig(r=r, nblocks=nblocks, target_modules=["q_proj", "o_proj"]),
    )
    model.save_pretrained(path)
    return path


def test_inspect_prints_export_commands_that_run_as_printed(tmp_path, capsys, monkeypatch):
    """The hints name the adapter as given, a fresh --out each, and every one runs as printed from the same place."""
    import shlex

    monkeypatch.chdir(tmp_path)
    _adapter(tmp_path / "runs" / "x" / "adapter")
    (tmp_path / "runs" / "x" / "adapter-dense").mkdir()  # taken: the hint must not name it
    assert main(["inspect", "runs/x/adapter"]) == 0
    text = capsys.readouterr().out
    commands = [line.split("#")[0].strip() for line in text.splitlines() if line.startswith("  bdlora export ")]
    assert commands == [  # no `--reblock 1`: without TP the adapter serves as it is
        "bdlora export runs/x/adapter --reblock 2 --out runs/x/adapter-nb2",
        "bdlora export runs/x/adapter --to dense-lora --out runs/x/adapter-dense-2",
    ]
    assert "Servable at TP 4 natively (zero extra collectives) and without TP (TP 1) as it is." in text
    assert "ADAPTER" not in text and " D`" not in text
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert [read_adapter(tmp_path / f"runs/x/adapter-{s}").nblocks for s in ("nb2", "dense-2")] == [2, 1]
    assert not read_adapter(tmp_path / "runs/x/adapter-dense-2").is_bdlora
    assert main(["inspect", "runs/x/adapter-dense-2"]) == 0  # plain LoRA: nothing to convert, no command
    assert "bdlora export" not in capsys.readouterr().out


def test_inspect_refuses_a_config_whose_rank_contradicts_the_tensors(tmp_path, capsys):
    path = _adapter(tmp_path / "a")
    config = json.loads((path / "adapter_config.json").read_text())
    config["r"] = 16  # the tensors are rank 8: stock PEFT builds rank-16 layers and fails to load them
    (path / "adapter_config.json").write_text(json.dumps(config))
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "adapter_config.json gives model.layers.0.self_attn.o_proj rank 16, but its tensors have rank 8" in err
    config["r"], config["rank_pattern"] = 8, {"q_proj": 4}  # rank_pattern counts as PEFT reads it
    (path / "adapter_config.json").write_text(json.dumps(config))
    assert main(["inspect", str(path)]) == 1
    assert "gives model.layers.0.self_attn.q_proj rank 4, but its tensors have rank 8" in capsys.readouterr().err


def test_inspect_against_another_base_is_refused_and_a_local_copy_accepted(tmp_path, capsys):
    path = _adapter(tmp_path / "a", nblocks=2)
    config = json.loads((path / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "tiny:llama"  # as `bdlora train` saves it
    (path / "adapter_config.json").write_text(json.dumps(config))
    # tiny:qwen2 has the same shapes: the shape check alone passes, the adapter would compute something else
    assert main(["inspect", str(path), "--model", "tiny:qwen2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model tiny:qwen2 is not the base the adapter was trained on (tiny:llama)" in err
    assert main(["inspect", str(path), "--model", "tiny:llama"]) == 0
    capsys.readouterr()
    copy = tmp_path / "copy"
    build_tiny_model("llama", num_key_value_heads=4).save_pretrained(copy)  # its config names no Hub base
    assert main(["inspect", str(path), "--model", str(copy)]) == 0
    assert "make sure it is a copy of that model (the shapes are checked" in capsys.readouterr().err
