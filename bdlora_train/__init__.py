"""bdlora-train: Block-Diagonal LoRA fine-tuning for tensor-parallel serving, on top of PEFT."""

from bdlora_train.budget import adapter_layout, count_adapter_params, match_budget
from bdlora_train.config import BlockDiagLoraConfig
from bdlora_train.models import build_tiny_model, load_embedded_model
from bdlora_train.roles import BD_A, BD_B, DEFAULT_TARGET_MODULES, BlockDiagLoraError, resolve_roles

__all__ = [
    "BD_A",
    "BD_B",
    "DEFAULT_TARGET_MODULES",
    "BlockDiagLoraConfig",
    "BlockDiagLoraError",
    "adapter_layout",
    "build_tiny_model",
    "count_adapter_params",
    "load_embedded_model",
    "match_budget",
    "resolve_roles",
]
