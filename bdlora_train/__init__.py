"""bdlora-train: Block-Diagonal LoRA fine-tuning for tensor-parallel serving, on top of PEFT.

    from bdlora_train import BlockDiagLoraConfig, get_peft_model
    model = get_peft_model(base_model, BlockDiagLoraConfig(r=32, nblocks=8))

Importing the package changes nothing in PEFT or transformers. Names are imported on first use (PEP 562), so
`bdlora --help` and `python -m bdlora_train.train` start without loading torch, PEFT and transformers first.
Importing it prints nothing: the lines optional libraries log or warn while PEFT imports or uses them (torchao's
native kernels without a CPU build, torch's pytree notes on torchao's enums, bitsandbytes' `kernels` hint, PEFT's
note at every save of a tiny model) are filtered by message at their loggers and modules (core/chatter.py); every
other warning and log line, the user's own included, is untouched.
"""

import importlib

from bdlora_train.core.chatter import filter_library_chatter

filter_library_chatter()

_EXPORTS = {
    "BD_A": "bdlora_train.core.roles",
    "BD_B": "bdlora_train.core.roles",
    "DEFAULT_TARGET_MODULES": "bdlora_train.core.roles",
    "BdloraError": "bdlora_train.core.errors",
    "BlockDiagLoraConfig": "bdlora_train.peft_integration.config",
    "BlockDiagLoraConfigError": "bdlora_train.core.errors",
    "BlockDiagLoraError": "bdlora_train.core.errors",
    "adapter_layout": "bdlora_train.budget",
    "bdlora_optimizer": "bdlora_train.trainer.optim",
    "bdlora_param_groups": "bdlora_train.trainer.optim",
    "build_tiny_model": "bdlora_train.models.tiny",
    "count_adapter_params": "bdlora_train.budget",
    "default_nblocks": "bdlora_train.core.heads",
    "get_peft_model": "bdlora_train.peft_integration.config",
    "load_adapter": "bdlora_train.adapters.load",
    "load_embedded_model": "bdlora_train.models.embedded",
    "match_budget": "bdlora_train.budget",
    "prepare_bdlora_config": "bdlora_train.peft_integration.config",
    "resolve_roles": "bdlora_train.peft_integration.resolve",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bdlora_train' has no attribute {name!r}")


def __dir__():
    return __all__
