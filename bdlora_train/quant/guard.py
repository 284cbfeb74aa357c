"""The bitsandbytes 4-bit CPU repacking trap, and the guard that keeps training off repacked weights.

On a CPU with AVX512-BF16, `bitsandbytes.nn.Linear4bit.forward` in eval mode on an input that does not require grad
(any evaluation under `no_grad`) converts its weight in place into an inference-only layout
(`bitsandbytes.functional._convert_weight_packed_for_cpu`, called from `Linear4bit.forward` in
bitsandbytes/nn/modules.py, 0.50). From then on `matmul_4bit` takes `gemv_4bit`, which has no backward: the
gradient through the frozen base is dropped without an error, adapters below that layer train on a wrong gradient,
and the loss still falls. Switching back to train mode does not undo it, and the inverse conversion is lossy (the
block scales stay rounded to bf16), so a repacked model is no longer the model that was loaded.

Two defences, applied by the loaders, `train()` and every toolkit 4-bit layer:
  keep_trainable_packing(model)  turns the conversion off on every Linear4bit (the layer's own
                                 `support_avx512bf16_for_cpu` flag, which its __init__ sets from `has_avx512bf16()`),
                                 so evaluations keep the trainable layout and compute exactly as training does;
  check_not_repacked(model)      refuses, in one line, a model that an earlier forward already converted.
"""

from __future__ import annotations

import sys

from torch import nn

from bdlora_train.core.errors import BlockDiagLoraConfigError


def _linear4bit(model: nn.Module):
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            yield name, module


def is_repacked(module: nn.Module) -> bool:
    """A Linear4bit whose weight is in bitsandbytes' inference-only CPU layout."""
    return bool(getattr(getattr(module.weight, "quant_state", None), "packing_format_for_cpu", False))


def repacked_layers(model: nn.Module) -> list[str]:
    return [name for name, module in _linear4bit(model) if is_repacked(module)]


def repacked_error(name: str, count: int = 1) -> BlockDiagLoraConfigError:
    return BlockDiagLoraConfigError(
        f"{name or 'model'}: bitsandbytes 4-bit weight repacked for CPU inference by an earlier eval forward "
        f"({count} layer(s)); its matmul has no backward, so training would silently drop the gradient through the "
        "base - reload the base model (the toolkit's loaders call bdlora_train.quant.keep_trainable_packing, which "
        "prevents this)"
    )


def check_not_repacked(model: nn.Module) -> None:
    """Refuse a model with any repacked 4-bit layer (see the module docstring)."""
    bad = repacked_layers(model)
    if bad:
        raise repacked_error(bad[0], len(bad))


def keep_trainable_packing(model: nn.Module) -> int:
    """Stop every Linear4bit of `model` (or `model` itself) from repacking at eval; returns how many there are."""
    layers = [module for _, module in _linear4bit(model)]
    for module in layers:
        module.support_avx512bf16_for_cpu = False
    return len(layers)
