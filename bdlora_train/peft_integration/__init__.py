"""The PEFT seam: the only folder that touches PEFT's internals (its layer classes, variants, custom-module dispatch,
matching helpers and saved-format details). What it relies on is pinned by tests/peft_integration/test_peft_contract.py.

  config.py        BlockDiagLoraConfig, prepare_bdlora_config, get_peft_model (the explicit seam: nothing patched)
  resolve.py       a PEFT config -> its targets (arch/targets.py) with PEFT's own filters and pattern lookups
  patterns.py      PEFT's `use_bdlora` block, read and written exactly as stock PEFT matches it
  layers.py        the fused BD-LoRA layer (BlockDiagLoraLinear, bdlora_add_), which factors are block-diagonal
  masked.py        densely stored block-diagonal factors, kept block-diagonal by masks
  experts.py       MoE expert parameters (PEFT's ParamWrapper, per-expert blocks)
  quant_layers.py  BD-LoRA layers for bitsandbytes 4/8-bit and torchao int8 bases
  storage.py       how PEFT stores what `use_bdlora` cannot express, and its bdlora_layout.json record
"""
