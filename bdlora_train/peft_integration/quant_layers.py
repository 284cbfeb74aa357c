"""BD-LoRA layers for quantized bases: bitsandbytes Linear4bit / Linear8bitLt and torchao int8 weight-only.

PEFT builds these bases' LoRA layers in `peft/tuners/lora/bnb.py` and `peft/tuners/lora/torchao.py`. For BD-LoRA,
stock PEFT (0.21) gets bitsandbytes wrong without a word: `Linear4bit.resolve_lora_variant` /
`Linear8bitLt.resolve_lora_variant` never look at `use_bdlora`, so both factors come out dense while the saved
config still says BD-LoRA (the file then fails to load on an unquantized base); their `__init__` calls
`update_layer` without the module name the BD variant matches roles on; and PEFT's BD variant would give the
packed factor the base weight's storage dtype (uint8 in 4-bit, int8 in 8-bit). torchao's layer builds the right
shapes, but its merge multiplies the packed factors as if they were dense.

The layers here are PEFT's own classes with those three points fixed: the toolkit's fused forward (layers.py,
`FastBlockDiagLoraVariant`) adds `scaling * x A^T B^T` into the base layer's output (the quantized matmul, which
dequantizes the weight), the block-diagonal factor is packed exactly as PEFT stores it and kept in the
adapter's float dtype, and merge / `get_delta_weight` use the dense block-diagonal delta. PEFT's custom-module
dispatch (`LoraConfig._register_custom_module`, tried before its bitsandbytes and torchao dispatchers in
`peft/tuners/lora/model.py` `_create_new_module`) routes the base layers here; `custom_modules()` is that mapping.
"""

from __future__ import annotations

import torch
from peft.import_utils import is_bnb_4bit_available, is_bnb_available
from peft.tuners.lora.layer import LoraLayer
from peft.tuners.lora.torchao import TorchaoLoraLinear
from peft.tuners.lora.variants import BdLoraLinearVariant, BlockDiagonalLinear
from torch import nn

from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.core.roles import BD_A
from bdlora_train.peft_integration.layers import (
    BlockDiagLoraLinear,
    FastBlockDiagLoraVariant,
    check_prepared,
    finish_init,
)
from bdlora_train.peft_integration.patterns import bdlora_field, bdlora_nblocks, stock_roles
from bdlora_train.quant.detect import is_torchao_weight
from bdlora_train.quant.guard import is_repacked, keep_trainable_packing, repacked_error


def dense_delta_weight(module, adapter: str) -> torch.Tensor:
    """scaling * B A with the block-diagonal factor expanded, (d_out, d_in), in the adapter's dtype (fp32 math)."""
    weight_a = BdLoraLinearVariant._get_weight_from_module_maybe_blockdiagonal(module.lora_A[adapter])
    weight_b = BdLoraLinearVariant._get_weight_from_module_maybe_blockdiagonal(module.lora_B[adapter])
    delta = (weight_b.float() @ weight_a.float()) * module.scaling[adapter]
    return delta.to(module.lora_B[adapter].weight.dtype)


class QuantBlockDiagLoraVariant(FastBlockDiagLoraVariant):
    """The fused BD-LoRA variant on a base whose weight is stored quantized (bitsandbytes uint8 / int8).

    Init builds the block-diagonal factor as PEFT's `BdLoraLinearVariant.init` does (same substring role rule,
    same shapes, init and random draws), but in the dense factors' float dtype and device, never the base's storage
    dtype. Merges add the dense delta to the *dequantized* weight PEFT's bitsandbytes layers pass in.
    """

    @staticmethod
    def init(module, adapter_name: str, config, **kwargs) -> None:
        target = kwargs.get("target_name", "")
        check_prepared(config, target)
        use_bdlora = config.use_bdlora
        role = stock_roles([target], use_bdlora)[target]
        if role is None:
            if bdlora_field(use_bdlora, "match_strict"):
                raise BlockDiagLoraConfigError(
                    f"layers: {target} matches neither target_modules_bd_a nor target_modules_bd_b of use_bdlora; "
                    "add it to one of them (or set match_strict=False to train it as plain LoRA)"
                )
            return
        nblocks = bdlora_nblocks(use_bdlora)
        dense = module.lora_A[adapter_name].weight  # after PEFT's device move: the base's device, a float dtype
        make = dict(nblocks=nblocks, dtype=dense.dtype, device=dense.device)
        if role == BD_A:
            r = module.lora_A[adapter_name].out_features
            module.lora_A[adapter_name] = BlockDiagonalLinear(module.in_features, r, init_zero=False, **make)
        else:
            r = module.lora_B[adapter_name].in_features
            module.lora_B[adapter_name] = BlockDiagonalLinear(r, module.out_features, init_zero=True, **make)
        finish_init(module, adapter_name, config, target)

    @staticmethod
    def merge_safe(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        return orig_weight + dense_delta_weight(module, active_adapter).to(orig_weight.dtype)

    @staticmethod
    def merge_unsafe(module, active_adapter: str, orig_weight: torch.Tensor) -> None:
        orig_weight.data += dense_delta_weight(module, active_adapter).to(orig_weight.dtype)

    @staticmethod
    def unmerge(module, active_adapter: str, orig_weight: torch.Tensor) -> torch.Tensor:
        return orig_weight - dense_delta_weight(module, active_adapter).to(orig_weight.dtype)


class _BnbBlockDiagLoraMixin:
    """What a PEFT bitsandbytes LoRA layer needs for BD-LoRA (put before PEFT's class in the bases)."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1, **kwargs):
        # PEFT's bitsandbytes __init__, except that update_layer gets the module name (PEFT's drops it, and the
        # BD variant assigns roles by it).
        nn.Module.__init__(self)
        LoraLayer.__init__(self, base_layer)
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        self._bdlora_name = kwargs.get("target_name", "")
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, target_name=self._bdlora_name)

    def resolve_lora_variant(self, *, config, **kwargs):
        if config.use_bdlora is not None:
            return QuantBlockDiagLoraVariant()
        return super().resolve_lora_variant(config=config, **kwargs)

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        if isinstance(self.lora_variant.get(adapter), BdLoraLinearVariant):
            return dense_delta_weight(self, adapter)
        return super().get_delta_weight(adapter)

    def __repr__(self) -> str:
        return "bdlora." + super().__repr__()[len("lora.") :]


class BlockDiagLoraTorchaoLinear(BlockDiagLoraLinear, TorchaoLoraLinear):
    """PEFT's torchao LoRA layer (merge = dequantize, add, re-quantize) with the fused BD-LoRA path and a BD-aware
    `get_delta_weight` (BlockDiagLoraLinear's), so `merge_and_unload` merges the block-diagonal delta."""


class _TorchaoLinearMeta(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, nn.Linear) and is_torchao_weight(getattr(obj, "weight", None))


class TorchaoLinear(metaclass=_TorchaoLinearMeta):
    """Dispatch key only: `isinstance(layer, TorchaoLinear)` is true for an `nn.Linear` with a torchao weight.

    torchao quantizes `nn.Linear` in place (the class stays, the weight becomes a tensor subclass), and PEFT's
    custom-module dispatch matches on the layer's class; a virtual class is the one way to tell them apart there.
    """


if is_bnb_available():
    from peft.tuners.lora.bnb import Linear8bitLt as _PeftLinear8bitLt

    class BlockDiagLoraLinear8bitLt(_BnbBlockDiagLoraMixin, _PeftLinear8bitLt):
        """PEFT's LoRA layer over a bitsandbytes `Linear8bitLt`, with real block-diagonal factors."""


if is_bnb_4bit_available():
    from peft.tuners.lora.bnb import Linear4bit as _PeftLinear4bit

    class BlockDiagLoraLinear4bit(_BnbBlockDiagLoraMixin, _PeftLinear4bit):
        """PEFT's LoRA layer over a bitsandbytes `Linear4bit` (QLoRA), with real block-diagonal factors.

        Its base never switches to bitsandbytes' inference-only CPU layout, and a base that already did is refused
        at the first forward that could need its gradient (quant/guard.py).
        """

        def __init__(self, base_layer: nn.Module, adapter_name: str, config, **kwargs):
            super().__init__(base_layer, adapter_name, config, **kwargs)
            keep_trainable_packing(self.get_base_layer())

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if torch.is_grad_enabled() and is_repacked(self.get_base_layer()):
                raise repacked_error(self._bdlora_name)
            return super().forward(x, *args, **kwargs)


def custom_modules() -> dict:
    """{quantized base layer type: toolkit layer}, for `LoraConfig._register_custom_module`.

    PEFT takes the first `isinstance` match in insertion order, and all three base types are `nn.Linear`s, so this
    mapping must come before the toolkit's `nn.Linear` entry.
    """
    mapping: dict = {}
    if is_bnb_4bit_available():
        import bitsandbytes as bnb

        mapping[bnb.nn.Linear4bit] = BlockDiagLoraLinear4bit
    if is_bnb_available():
        import bitsandbytes as bnb

        mapping[bnb.nn.Linear8bitLt] = BlockDiagLoraLinear8bitLt
    mapping[TorchaoLinear] = BlockDiagLoraTorchaoLinear
    return mapping
