"""Which quantized base layers BD-LoRA supports, read from a module without importing any quantization library.

Supported: bitsandbytes `Linear4bit` (NF4/FP4, QLoRA) and `Linear8bitLt` (LLM.int8), and an `nn.Linear` whose weight
is torchao's int8 weight-only tensor (`Int8WeightOnlyConfig`). A quantized layer can only exist once its library is
imported, so `sys.modules` is looked up instead of importing bitsandbytes or torchao here.
"""

from __future__ import annotations

import sys

from torch import nn

from bdlora_train.quant.keys import BNB_4BIT, BNB_8BIT, TORCHAO_INT8


def is_torchao_weight(weight) -> bool:
    """A torchao tensor subclass (any of its quantization formats)."""
    torchao_utils = sys.modules.get("torchao.utils")
    return torchao_utils is not None and isinstance(weight, torchao_utils.TorchAOBaseTensor)


def quant_kind(module: nn.Module) -> str | None:
    """BNB_4BIT, BNB_8BIT or TORCHAO_INT8 for a supported quantized Linear; None for anything else (float layers
    and unsupported quantized ones alike: arch/checks.py refuses the latter)."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is not None:
        if isinstance(module, bnb.nn.Linear4bit):
            return BNB_4BIT
        if isinstance(module, bnb.nn.Linear8bitLt):
            return BNB_8BIT
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Linear) and is_torchao_weight(weight):
        # Int8WeightOnlyConfig -> Int8Tensor without activation quantization; the dynamic-activation variant
        # (Int8DynamicActivationInt8WeightConfig) shares the class but quantizes the input too, and int4 / float8
        # formats are other classes: none of them is a dequantized-weight linear.
        if type(weight).__name__ == "Int8Tensor" and getattr(weight, "act_quant_kwargs", None) is None:
            return TORCHAO_INT8
    return None


def model_quant_kinds(model: nn.Module) -> set[str]:
    """Every supported quantized layer kind in `model` (empty for a float model)."""
    return {kind for kind in map(quant_kind, model.modules()) if kind is not None}
