"""BD-LoRA on quantized bases (QLoRA): bitsandbytes 4-bit / 8-bit and torchao int8 weight-only (docs/quantization.md).

  detect.py  which quantized layers are supported (no quantization library imported)
  layers.py  the BD-LoRA layers PEFT's custom-module dispatch builds for them (BlockDiagLoraConfig registers them)
  guard.py   the bitsandbytes 4-bit CPU repacking trap and its guard
  load.py    recipe keys -> quantized load, kbit training prep, the adapter's base_quantization.json, dequantize_
"""

from bdlora_train.quant.detect import BNB_4BIT, BNB_8BIT, TORCHAO_INT8, model_quant_kinds, quant_kind
from bdlora_train.quant.guard import check_not_repacked, keep_trainable_packing, repacked_layers
from bdlora_train.quant.load import dequantize_, load_quantized, prepare_for_training, quantization_config

__all__ = [
    "BNB_4BIT",
    "BNB_8BIT",
    "TORCHAO_INT8",
    "check_not_repacked",
    "dequantize_",
    "keep_trainable_packing",
    "load_quantized",
    "model_quant_kinds",
    "prepare_for_training",
    "quant_kind",
    "quantization_config",
    "repacked_layers",
]
