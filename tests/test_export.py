"""Exports are exact (same logits as the BD-LoRA adapter) and check-serving tells ready from not ready."""

import json

import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file

from bdlora_train import cli, get_peft_model
from bdlora_train.adapters import load_adapter, read_adapter
from bdlora_train.config import BlockDiagLoraConfig
from bdlora_train.errors import BdloraError, ExportError
from bdlora_train.export import export, repack
from bdlora_train.models import build_tiny_model, tiny_config
from bdlora_train.serving import check_serving
from bdlora_train.tp import random_adapter, rel_err

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


def test_merged_wrong_base_leaves_nothing(nb4, tmp_path):
    path, _ = nb4
    message = r"_proj \(bd_b, nblocks=4\) factors give 64 -> 64, the base Linear is 64 -> 32"
    with pytest.raises(BdloraError, match=message):
        export(path, tmp_path / "m", to="merged", base="tiny:llama")  # 4 heads, the adapter wants 8
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------- check-serving


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A base model config a serving engine could point at (4 heads / 2 KV heads)."""
    path = tmp_path_factory.mktemp("base")
    tiny_config("llama").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """The config of the base the nblocks-4 adapter was trained on (8 heads / 4 KV heads)."""
    path = tmp_path_factory.mktemp("wide")
    tiny_config("llama", **WIDE).save_pretrained(path)
    return path


def _statuses(report):
    return {c["check"]: c["status"] for c in report["checks"]}


def test_serving_ready_prints_exact_command(nb2, base_dir, capsys):
    path, _ = nb2
    assert cli.main(["check-serving", str(path), "--tp", "2", "--base", str(base_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # --json prints pure JSON
    statuses = _statuses(report)
    assert report["ready"] and statuses.pop("base") == "warn" and set(statuses.values()) == {"ok"}
    assert report["command"] == (
        f"vllm serve {base_dir} --enable-lora --tensor-parallel-size 2 --max-lora-rank 8 "
        f"--block-diagonal-sharded-loras --lora-modules nb2={path.resolve()}"
    )


def test_serving_reblock_fix_then_ready(nb4, wide_dir, tmp_path):
    path, _ = nb4
    report = check_serving(path, tp=2, base=str(wide_dir))
    assert not report["ready"] and _statuses(report)["nblocks"] == "fix"
    assert report["fixes"] == [f"bdlora export {path} --reblock 2 --out {path}-nb2"]
    assert report["command"].endswith(f"--lora-modules nb4={path.resolve()}-nb2")
    out = export(path, tmp_path / "nb4-nb2", reblock_to=2)
    again = check_serving(out, tp=2, base=str(wide_dir))
    assert again["ready"], again["checks"]
    assert check_serving(path, tp=4, base=str(wide_dir))["ready"]


def test_serving_not_ready_cases(nb4, nb2, base_dir, wide_dir):
    path, _ = nb4
    bad = check_serving(path, tp=3, base=str(wide_dir))
    assert not bad["ready"] and bad["command"] is None and _statuses(bad)["nblocks"] == "fail"
    mis = check_serving(path, tp=4, max_lora_rank=16, base=str(wide_dir))
    assert _statuses(mis)["rank"] == "fail" and "--max-lora-rank 8" in next(
        c["message"] for c in mis["checks"] if c["check"] == "rank"
    )
    assert _statuses(check_serving(path, tp=4, max_lora_rank=12, base=str(wide_dir)))["rank"] == "fail"
    kv = check_serving(path, tp=4, base=str(base_dir))  # 2 KV heads at TP 4: vLLM replicates them
    assert not kv["ready"] and _statuses(kv)["kv_heads"] == "fail"
    one = check_serving(nb2[0], tp=1, base=str(base_dir))  # TP 1 loads packed tensors unsliced
    assert not one["ready"] and "--to dense-lora" in one["fixes"][0]
    assert "--block-diagonal-sharded-loras" not in one["command"]


def test_serving_plain_lora_and_embedding_changes(tmp_path, base_dir):
    model = build_tiny_model("llama")
    plain = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    plain.save_pretrained(str(tmp_path / "plain"))
    report = check_serving(tmp_path / "plain", tp=2, base=str(base_dir))
    assert report["ready"] and "--block-diagonal-sharded-loras" not in report["command"]

    bd = get_peft_model(build_tiny_model("llama"), BlockDiagLoraConfig(r=8, nblocks=2, modules_to_save=["lm_head"]))
    bd.save_pretrained(str(tmp_path / "mts"))
    report = check_serving(tmp_path / "mts", tp=2, base=str(base_dir))
    assert not report["ready"] and _statuses(report)["embeddings"] == "fail"


def test_serving_tokenizer_with_added_tokens(nb2, tmp_path, base_dir):
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "tok"
    shutil.copytree(nb2[0], path)
    vocab = {f"w{i}": i for i in range(300)}  # the base vocabulary has 256 tokens
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="w0")))
    tokenizer.save_pretrained(str(path))
    report = check_serving(path, tp=2, base=str(base_dir))
    assert _statuses(report)["tokenizer"] == "fail" and not report["ready"]


def test_serving_swapped_roles(tmp_path, base_dir):
    config = BlockDiagLoraConfig(r=8, nblocks=2, target_modules=["q_proj"], roles={"q_proj": "bd_a"})
    get_peft_model(build_tiny_model("llama"), config).save_pretrained(str(tmp_path / "swapped"))
    report = check_serving(tmp_path / "swapped", tp=2, base=str(base_dir))
    assert _statuses(report)["modules"] == "fail" and not report["ready"]


def test_export_keeps_side_files_but_no_other_weights(nb2, tmp_path):
    import shutil

    path = tmp_path / "src"
    shutil.copytree(nb2[0], path)
    (path / "README.md").write_text("card")
    (path / "training_state.bin").write_bytes(b"pickle")
    out = export(path, tmp_path / "dense", to="dense-lora")
    assert (out / "README.md").read_text() == "card" and not (out / "training_state.bin").exists()
    assert set(load_file(str(out / "adapter_model.safetensors"))) == set(
        load_file(str(path / "adapter_model.safetensors"))
    )


def test_serving_wrong_base_shapes(nb4):
    path, _ = nb4  # trained on a tiny Llama with hidden 64
    report = check_serving(path, tp=4, max_lora_rank=8, base="meta-llama/Llama-3.1-8B")
    assert _statuses(report)["shapes"] == "fail" and not report["ready"]


def test_serving_base_not_shardable(nb2, tmp_path):
    """Plain LoRA needs no block alignment, but vLLM still has to split the base model's heads."""
    tiny_config("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3).save_pretrained(tmp_path)
    dense = export(nb2[0], tmp_path / "dense", to="dense-lora")
    assert _statuses(check_serving(dense, tp=4, base=str(tmp_path)))["kv_heads"] == "fail"
    assert _statuses(check_serving(dense, tp=6, base=str(tmp_path)))["kv_heads"] == "ok"  # KV heads replicated x2


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
