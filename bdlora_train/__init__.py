"""bdlora-train: Block-Diagonal LoRA fine-tuning for tensor-parallel serving, on top of PEFT.

    from bdlora_train import BlockDiagLoraConfig, get_peft_model
    model = get_peft_model(base_model, BlockDiagLoraConfig(r=32, nblocks=8))

Importing the package changes nothing in PEFT or transformers. Names are imported on first use (PEP 562), so
`bdlora --help` and `python -m bdlora_train.train` start without loading torch, PEFT and transformers first.
"""

import importlib

_EXPORTS = {
    "BD_A": "bdlora_train.patterns",
    "BD_B": "bdlora_train.patterns",
    "DEFAULT_TARGET_MODULES": "bdlora_train.roles",
    "BdloraError": "bdlora_train.errors",
    "BlockDiagLoraConfig": "bdlora_train.config",
    "BlockDiagLoraError": "bdlora_train.errors",
    "adapter_layout": "bdlora_train.budget",
    "build_tiny_model": "bdlora_train.models",
    "count_adapter_params": "bdlora_train.budget",
    "default_nblocks": "bdlora_train.roles",
    "get_peft_model": "bdlora_train.config",
    "load_embedded_model": "bdlora_train.models",
    "match_budget": "bdlora_train.budget",
    "prepare_bdlora_config": "bdlora_train.config",
    "resolve_roles": "bdlora_train.roles",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bdlora_train' has no attribute {name!r}")


def __dir__():
    return __all__
