"""Load a saved adapter onto a base model with the toolkit's BD-LoRA layers, keeping exactly the roles in the file."""

from __future__ import annotations

import warnings

from bdlora_train.adapters.reader import Adapter, read_adapter
from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.peft_integration.config import BlockDiagLoraConfig, prepare_bdlora_config


def load_adapter(base_model, path, adapter_name: str = "default", is_trainable: bool = False):
    """`PeftModel.from_pretrained` with the toolkit's BD-LoRA layers, keeping exactly the roles in the file.

    Falls back to stock PEFT (with a warning) for adapters whose blocks do not pass the TP-alignment checks.
    """
    from peft import PeftModel

    adapter = read_adapter(path)
    if not adapter.has_structure:
        return PeftModel.from_pretrained(base_model, str(path), adapter_name=adapter_name, is_trainable=is_trainable)
    roles = {name: module.bd_role for name, module in adapter.modules.items() if module.bd_role and not module.experts}
    # experts only when the file has expert factors (a bdlora_layout.json lists them): the names an experts=False
    # adapter targets (e.g. a shared expert's gate_proj/up_proj/down_proj) must not pull the experts back in
    has_experts = any(m.experts for m in adapter.modules.values())
    extra = dict(nblocks=adapter.bd_nblocks) if adapter.layout else {}
    extra["experts"] = adapter.layout.get("experts", "tp") if has_experts else False
    try:
        config = BlockDiagLoraConfig.from_lora_config(adapter.config, roles=roles, init_lora_weights=False, **extra)
        prepare_bdlora_config(base_model, config)
        _check_same_structure(adapter, config)
        return PeftModel.from_pretrained(
            base_model, str(path), adapter_name=adapter_name, is_trainable=is_trainable, config=config
        )
    except BlockDiagLoraConfigError as err:
        warnings.warn(f"{path}: {err}; loading with stock PEFT layers instead", stacklevel=2)
        return PeftModel.from_pretrained(base_model, str(path), adapter_name=adapter_name, is_trainable=is_trainable)


def _check_same_structure(adapter: Adapter, config) -> None:
    """The model's layouts must be the file's: same targets, roles, blocks and segments."""
    if set(config.resolved) != set(adapter.modules):
        extra = sorted(set(config.resolved) ^ set(adapter.modules))[:3]
        raise BlockDiagLoraConfigError(f"the base model resolves other targets than the adapter holds (e.g. {extra})")
    for name, module in adapter.modules.items():
        target = config.resolved.get(name)
        if target is None or (module.structure and tuple(target.layout.segments) != module.segments):
            raise BlockDiagLoraConfigError(
                f"{name}: the base model's layout differs from the adapter's bdlora_layout.json"
            )
        if target.role != module.bd_role or target.nblocks != module.bd_nblocks:
            raise BlockDiagLoraConfigError(f"{name}: role/nblocks in the file differ from the base model's TP layout")
