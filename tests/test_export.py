"""Exports are exact (same logits as the BD-LoRA adapter)."""

import json

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file

from bdlora_train import cli, get_peft_model
from bdlora_train.adapters.load import load_adapter
from bdlora_train.adapters.reader import read_adapter
from bdlora_train.core.errors import BlockDiagLoraError, ExportError
from bdlora_train.export import export, repack
from bdlora_train.models import build_tiny_model
from bdlora_train.peft_integration.config import BlockDiagLoraConfig
from bdlora_train.tp_diagnostics import random_adapter, rel_err

WIDE = dict(num_attention_heads=8, num_key_value_heads=4)  # so nblocks 4 lines up with the heads
IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(7))


def _logits(model):
    with torch.no_grad():
        return model.eval()(IDS).logits


@pytest.fixture(scope="module")
def nb4(tmp_path_factory):
    """A BD-LoRA adapter with nblocks 4, random non-zero factors, and its reference logits."""
    path = random_adapter(tmp_path_factory.mktemp("export") / "nb4", "tiny:llama", tp=4, r=8, overrides=WIDE, seed=1)
    ref = _logits(load_adapter(build_tiny_model("llama", **WIDE), path))
    base = _logits(build_tiny_model("llama", **WIDE))
    assert rel_err(ref, base) > 1e-2, "the adapter must change the logits, or exactness proves nothing"
    return path, ref


@pytest.fixture(scope="module")
def nb2(tmp_path_factory):
    path = random_adapter(tmp_path_factory.mktemp("export") / "nb2", "tiny:llama", tp=2, r=8, seed=2)
    return path, _logits(load_adapter(build_tiny_model("llama"), path))


def test_repack_is_block_diagonal_regrouping():
    blocks = [torch.randn(3, 2) for _ in range(4)]
    packed = torch.cat(blocks)  # PEFT's layout: blocks stacked along dim 0
    two = repack(packed, 4, 2)
    assert two.shape == (12, 4)
    assert torch.equal(torch.block_diag(*two.chunk(2)), torch.block_diag(*blocks))
    assert torch.equal(repack(packed, 4, 1), torch.block_diag(*blocks))


def test_dense_lora_is_plain_lora_and_exact(nb4, tmp_path):
    path, ref = nb4
    out = export(path, tmp_path / "dense", to="dense-lora")
    config = json.loads((out / "adapter_config.json").read_text())
    assert "use_bdlora" not in config and config["r"] == 8
    assert LoraConfig.from_pretrained(str(out)).use_bdlora is None
    source, dense = read_adapter(path), read_adapter(out)
    assert not dense.is_bdlora and set(dense.modules) == set(source.modules)
    for name, module in dense.modules.items():
        assert module.A.shape == (8, module.d_in) and module.B.shape == (module.d_out, 8)
        assert torch.equal(module.delta_weight(), source.modules[name].delta_weight())
    stock = PeftModel.from_pretrained(build_tiny_model("llama", **WIDE), str(out))  # stock PEFT, no toolkit
    assert rel_err(_logits(stock), ref) < 1e-5


@pytest.mark.parametrize("n", [2, 1])
def test_reblock_exact(nb4, tmp_path, n):
    path, ref = nb4
    out = export(path, tmp_path / f"nb{n}", reblock_to=n)
    adapter = read_adapter(out)
    assert adapter.nblocks == n and adapter.is_bdlora
    q = adapter.modules["model.layers.0.self_attn.q_proj"]  # bd_b: B packed (d_out, r/n)
    o = adapter.modules["model.layers.0.self_attn.o_proj"]  # bd_a: A packed (r, d_in/n)
    assert q.B.shape == (128, 8 // n) and o.A.shape == (8, 128 // n)
    source = read_adapter(path)
    for name, module in adapter.modules.items():
        assert torch.equal(module.dense_A(), source.modules[name].dense_A())
        assert torch.equal(module.dense_B(), source.modules[name].dense_B())
    assert rel_err(_logits(load_adapter(build_tiny_model("llama", **WIDE), out)), ref) < 1e-5
    stock = PeftModel.from_pretrained(build_tiny_model("llama", **WIDE), str(out))
    assert rel_err(_logits(stock), ref) < 1e-5


def test_reblock_errors(nb4, tmp_path, capsys):
    path, _ = nb4
    with pytest.raises(ExportError, match=r"--reblock 3 does not divide nblocks=4.*\[1, 2, 4\]"):
        export(path, tmp_path / "x", reblock_to=3)
    assert cli.main(["export", str(path), "--reblock", "3", "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("bdlora export: error:") and len(err.splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_merged_cli_exact(nb2, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    path, ref = nb2
    out = tmp_path / "merged"
    assert cli.main(["export", str(path), "--to", "merged", "--out", str(out)]) == 0  # base from the adapter config
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert rel_err(_logits(merged), ref) < 1e-5
    # refuse to overwrite; --force replaces atomically and leaves no temporary directories behind
    assert cli.main(["export", str(path), "--to", "merged", "--out", str(out)]) == 1
    assert "--force" in capsys.readouterr().err
    assert cli.main(["export", str(path), "--to", "dense-lora", "--out", str(out), "--force"]) == 0
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


def test_merged_with_modules_to_save(tmp_path):
    model = build_tiny_model("llama")
    peft_model = get_peft_model(model, BlockDiagLoraConfig(r=4, nblocks=2, modules_to_save=["lm_head"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.05)
    ref = _logits(peft_model)
    peft_model.save_pretrained(str(tmp_path / "a"))
    assert rel_err(_logits(load_adapter(build_tiny_model("llama"), tmp_path / "a")), ref) < 1e-6
    out = export(tmp_path / "a", tmp_path / "m", to="merged", base=build_tiny_model("llama"))
    from transformers import AutoModelForCausalLM

    assert rel_err(_logits(AutoModelForCausalLM.from_pretrained(str(out))), ref) < 1e-5


def test_merged_wrong_base_leaves_nothing(nb4, tmp_path, capsys):
    """Issue 30: a --model of other shapes is named as the cause (with the base the adapter was trained on and the
    fix), not the adapter's nblocks or r."""
    path, _ = nb4
    message = r"_proj \(bd_b, nblocks=4\) factors give 64 -> 64, the base Linear is 64 -> 32"
    with pytest.raises(BlockDiagLoraError, match=message):
        export(path, tmp_path / "m", to="merged", base="tiny:llama")  # 4 heads, the adapter wants 8
    assert list(tmp_path.iterdir()) == []
    trained_on = f"{path}-base"  # random_adapter records the wide tiny Llama's config dir as the base
    assert cli.main(["export", str(path), "--to", "merged", "--model", "tiny:llama", "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"bdlora export: error: {path}: the base does not match: the adapter was trained on {trained_on}, --model "
        "gives tiny:llama (model.layers.0.self_attn."
    ), err
    assert err.rstrip().endswith(f"; pass --model {trained_on} (or a local copy of it), or leave --model out"), err
    assert "edited nblocks" not in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_reblock_to_the_adapters_own_nblocks_is_refused_not_copied(nb4, nb2, tmp_path, capsys):
    path, _ = nb4
    assert cli.main(["export", str(path), "--reblock", "4", "--out", str(tmp_path / "same")]) == 1
    assert capsys.readouterr().err == (
        f"bdlora export: error: --reblock 4 is the adapter's own nblocks (4): the export would be a copy of {path}; "
        f"use --reblock in [1, 2] to serve at a lower TP degree, or serve {path} as it is\n"
    )
    assert not (tmp_path / "same").exists()
    assert cli.main(["export", str(path), "--reblock", "2", "--out", str(tmp_path / "nb2")]) == 0  # a real re-block
    capsys.readouterr()
    one = tmp_path / "nb2"
    assert cli.main(["export", str(one), "--reblock", "1", "--out", str(tmp_path / "nb1")]) == 0
    nb1 = tmp_path / "nb1"
    capsys.readouterr()
    assert cli.main(["export", str(nb1), "--reblock", "1", "--out", str(tmp_path / "again")]) == 1
    assert capsys.readouterr().err.endswith("(1): the export would be a copy of " + f"{nb1}; there is nothing to "
                                            f"re-block, or serve {nb1} as it is\n")


def test_export_keeps_side_files_but_no_other_weights(nb2, tmp_path):
    import shutil

    path = tmp_path / "src"
    shutil.copytree(nb2[0], path)
    (path / "README.md").write_text("the BD-LoRA card")
    (path / "notes.txt").write_text("side file")
    (path / "training_state.bin").write_bytes(b"pickle")
    out = export(path, tmp_path / "dense", to="dense-lora")
    assert (out / "notes.txt").read_text() == "side file" and not (out / "training_state.bin").exists()
    assert (out / "README.md").read_text() != "the BD-LoRA card"  # the export has a card of its own
    assert set(load_file(str(out / "adapter_model.safetensors"))) == set(
        load_file(str(path / "adapter_model.safetensors"))
    )


def _card(path):
    import yaml

    text = (path / "README.md").read_text()
    return yaml.safe_load(text.split("---\n")[1]), text


def _snippet(text: str) -> str:
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_each_export_has_a_card_that_says_what_it_is_and_loads_as_printed(nb2, tmp_path, monkeypatch):
    """dense-lora: a plain LoRA card (no use_bdlora, no roles, nblocks 1); reblock: the new nblocks; merged: a plain
    transformers model. Every card's Python snippet runs as printed (from another directory) and gives the
    adapter's logits."""
    path, ref = nb2
    dense = export(path, tmp_path / "dense", to="dense-lora")
    meta, text = _card(dense)
    assert meta["library_name"] == "peft" and "nblocks-2" not in meta["tags"]
    assert text.splitlines()[text.splitlines().index("---", 1) + 2] == "# LoRA adapter for tiny:llama"
    assert "nblocks = 1 (dense LoRA)" in text and "bd_a" not in text and "bd_b" not in text
    assert f"from the BD-LoRA adapter `{path.resolve()}` (nblocks 2)" in text and "without `use_bdlora`" in text
    nb1 = export(path, tmp_path / "nb1", reblock_to=1)
    meta, text = _card(nb1)
    assert "nblocks-1" in meta["tags"] and "nblocks = 1 (= the tensor-parallel degree" in text
    assert "--reblock 1` from the BD-LoRA adapter" in text and "each group of 2 consecutive blocks" in text
    merged = export(path, tmp_path / "merged", to="merged")
    meta, text = _card(merged)
    assert meta["library_name"] == "transformers" and "peft" not in meta["tags"]
    assert "loads and serves without PEFT" in text
    monkeypatch.chdir(tmp_path.parent)  # the snippets name absolute paths: they run from anywhere
    for out in (dense, nb1, merged):
        _, text = _card(out)
        assert "ADAPTER" not in text.split("## Serving")[0], out
        scope = {}
        exec(_snippet(text), scope)
        assert rel_err(_logits(scope["model"]), ref) < 1e-5, out


@pytest.mark.slow
def test_embedded_smollm2_exports_exact(tmp_path):
    """The real SmolLM2-135M (a dequantized GGUF base): merged, dense and re-blocked exports (~2 min here)."""
    from transformers import AutoModelForCausalLM

    from bdlora_train.models import load_embedded_model

    path = random_adapter(tmp_path / "smol", "embedded", tp=3, r=24, seed=4)
    ids = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = load_adapter(load_embedded_model()[0], path).eval()(ids).logits
        merged_dir = export(path, tmp_path / "merged", to="merged")  # base "embedded" from the adapter config
        merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
        assert rel_err(merged(ids).logits, ref) < 1e-5
        dense = export(path, tmp_path / "dense", to="dense-lora")
        nb1 = export(path, tmp_path / "nb1", reblock_to=1)
        for out in (dense, nb1):
            assert rel_err(PeftModel.from_pretrained(load_embedded_model()[0], str(out)).eval()(ids).logits, ref) < 1e-5
