"""Saved adapters in PEFT's native (BD-)LoRA format: read and check them, describe them, load them.

  reader.py    adapter_config.json + adapter_model.safetensors (+ bdlora_layout.json) -> Adapter / ModuleFactors
  shapes.py    the base on the meta device and every factor shape checked against it
  describe.py  what `bdlora inspect` prints and the model card shows
  load.py      load_adapter: PeftModel.from_pretrained with the toolkit's layers and exactly the file's roles

Works on any adapter directory PEFT writes, from BlockDiagLoraConfig or a stock `LoraConfig(use_bdlora=...)`.
Roles are read back exactly as stock PEFT assigns them, so the toolkit never disagrees with PEFT about a file.
"""
