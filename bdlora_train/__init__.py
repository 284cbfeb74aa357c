"""bdlora-train: Block-Diagonal LoRA fine-tuning for tensor-parallel serving, on top of PEFT.

    from bdlora_train import BlockDiagLoraConfig, get_peft_model
    model = get_peft_model(base_model, BlockDiagLoraConfig(r=32, nblocks=8))

Importing the package changes nothing in PEFT or transformers.
"""

from bdlora_train.budget import adapter_layout, count_adapter_params, match_budget
from bdlora_train.config import BlockDiagLoraConfig, get_peft_model, prepare_bdlora_config
from bdlora_train.errors import BdloraError, BlockDiagLoraError
from bdlora_train.models import build_tiny_model, load_embedded_model
from bdlora_train.patterns import BD_A, BD_B
from bdlora_train.roles import DEFAULT_TARGET_MODULES, default_nblocks, resolve_roles

__all__ = [
    "BD_A",
    "BD_B",
    "DEFAULT_TARGET_MODULES",
    "BdloraError",
    "BlockDiagLoraConfig",
    "BlockDiagLoraError",
    "adapter_layout",
    "build_tiny_model",
    "count_adapter_params",
    "default_nblocks",
    "get_peft_model",
    "load_embedded_model",
    "match_budget",
    "prepare_bdlora_config",
    "resolve_roles",
]
