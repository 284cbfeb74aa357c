"""Quantized bases (QLoRA): bitsandbytes 4-bit / 8-bit and torchao int8 weight-only (docs/quantization.md).

  detect.py  which quantized layers are supported (no quantization library imported)
  guard.py   the bitsandbytes 4-bit CPU repacking trap and its guard
  keys.py    QuantKeys: the recipe keys, checked (no torch)
  quantized.py  QuantKeys -> transformers quantization config, quantized load, kbit training prep, the adapter's
             base_quantization.json, dequantize_
The BD-LoRA layers for these bases are PEFT layers: peft_integration/quant_layers.py.
"""
