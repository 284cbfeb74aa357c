"""A quantized base from its keys: the transformers quantization config, the load, training prep, the side file that
records it next to the adapter, and the dequantization that undoes it for a merged export.

Keys (the recipe's; quant/keys.py) -> a transformers quantization config:
  load_in_4bit (+ bnb_4bit_quant_type, bnb_4bit_compute_dtype, bnb_4bit_use_double_quant)  BitsAndBytesConfig, 4-bit
  load_in_8bit                                                                            BitsAndBytesConfig, 8-bit
  torchao_int8                                                          TorchAoConfig(Int8WeightOnlyConfig())
Before training, PEFT's `prepare_model_for_kbit_training` (freeze, fp32 norms/embeddings, gradient checkpointing)
runs as PEFT users expect. The keys are saved next to the adapter (`base_quantization.json`), so
`bdlora export --to merged` can rebuild the exact base the adapter was trained on and merge into its *dequantized*
weights. Loading a model spec (tiny, embedded, Hub) is models/'s job; this module loads checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from bdlora_train.core import launch_env
from bdlora_train.core.dtypes import dtype_of
from bdlora_train.core.errors import ExportError, ModelSpecError, RecipeError, first_line
from bdlora_train.core.files import atomic_write_text
from bdlora_train.quant.detect import BNB_4BIT, BNB_8BIT, TORCHAO_INT8, is_torchao_weight, model_quant_kinds
from bdlora_train.quant.guard import check_not_repacked, keep_trainable_packing
from bdlora_train.quant.keys import SWITCHES, QuantKeys

SIDE_FILE = "base_quantization.json"  # next to adapter_config.json; PEFT ignores it, export --to merged reads it


def quantization_config(keys: QuantKeys):
    """The transformers quantization config the keys ask for, or None."""
    kind = keys.kind
    if kind is None:
        return None
    if kind == TORCHAO_INT8:
        from torchao.quantization import Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        return TorchAoConfig(quant_type=Int8WeightOnlyConfig())
    from transformers import BitsAndBytesConfig

    if kind == BNB_8BIT:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=keys.bnb_4bit_quant_type,
        bnb_4bit_compute_dtype=dtype_of(keys.bnb_4bit_compute_dtype or keys.torch_dtype),
        bnb_4bit_use_double_quant=keys.bnb_4bit_use_double_quant,
    )


def _device_map():
    """Every quantized layer on this process's device: its GPU (LOCAL_RANK under torchrun/accelerate) or the CPU."""
    if torch.cuda.is_available():
        return {"": launch_env.local_rank() or 0}
    return "cpu"


def from_pretrained(path: str, quantization, dtype: torch.dtype, local_files_only: bool = False):
    """A checkpoint loaded by transformers, quantized as `quantization` (a transformers config) says
    (`local_files_only`: the Hub cache only, models/reach.py)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype,
            quantization_config=quantization,
            device_map=_device_map(),
            trust_remote_code=False,
            use_kernels=False,
            local_files_only=local_files_only,
        )
    except (OSError, ValueError, ImportError, RuntimeError) as err:
        method = getattr(quantization, "quant_method", "quantized")
        raise ModelSpecError(
            f"--model {path}: cannot load it {getattr(method, 'value', method)} ({first_line(err, 160)})"
        ) from None
    keep_trainable_packing(model)  # evaluations (compare scores the base first) must not repack 4-bit weights
    return model


def prepare_for_training(model, keys: QuantKeys, gradient_checkpointing: bool = False):
    """train(): the base must be quantized as the keys say (never silently float, never silently quantized), never
    repacked for inference; then PEFT's `prepare_model_for_kbit_training`. Returns `model`."""
    wanted, found = keys.kind, model_quant_kinds(model)
    if wanted is None:
        if found:
            raise RecipeError(
                f"recipe: the base model is quantized ({', '.join(sorted(found))}) but none of load_in_4bit / "
                "load_in_8bit / torchao_int8 is set; set the one that matches, so the adapter records its base"
            )
        return model
    if found != {wanted}:
        key = next(k for k, kind in SWITCHES.items() if kind == wanted)
        raise RecipeError(
            f"recipe: {key}=true but the base model passed in is {', '.join(sorted(found)) or 'not quantized'}; "
            "load it with bdlora_train.models.load_model(spec, quantization=quantization_config(keys))"
        )
    check_not_repacked(model)
    keep_trainable_packing(model)
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )


def write_side_file(adapter_dir, keys: QuantKeys) -> None:
    """Record the base's quantization next to the adapter (nothing for a float base)."""
    if keys.kind is None:
        return
    text = json.dumps(dataclasses.asdict(keys), indent=2, sort_keys=True) + "\n"
    atomic_write_text(Path(adapter_dir) / SIDE_FILE, text)


def read_side_file(adapter_dir) -> QuantKeys | None:
    """The keys `write_side_file` saved; None for a float base."""
    path = Path(adapter_dir) / SIDE_FILE
    if not path.is_file():
        return None
    allowed = {f.name for f in dataclasses.fields(QuantKeys)}
    try:
        keys = json.loads(path.read_text())
        if not isinstance(keys, dict) or set(keys) - allowed:
            raise ValueError(f"expected a mapping of {sorted(allowed)}")
        record = QuantKeys(**keys).check()
    except (ValueError, TypeError) as err:  # RecipeError is a ValueError
        raise ExportError(f"export: {path} is not a valid base quantization record ({first_line(err)})") from None
    return record if record.kind else None


def drop_quantizer_tag(model) -> None:
    """Forget that transformers loaded `model` quantized (its `hf_quantizer`, `is_quantized` and the config's
    `quantization_config`), once its weights are plain float tensors: Trainer, save_pretrained and .float() refuse
    a tagged model."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def dequantize_(model) -> torch.nn.Module:
    """Replace every quantized Linear weight by its dequantized float weight, in place (for merged exports).

    bitsandbytes: transformers' `model.dequantize()`. torchao has no transformers dequantize (5.24 raises
    NotImplementedError), so its weights are swapped for `weight.dequantize()` here, and the quantizer tag dropped.
    """
    check_not_repacked(model)  # a repacked 4-bit weight dequantizes with bf16-rounded scales: not the trained base
    kinds = model_quant_kinds(model)
    if kinds & {BNB_4BIT, BNB_8BIT}:
        model.dequantize()
    if any(is_torchao_weight(getattr(m, "weight", None)) for m in model.modules()):
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if is_torchao_weight(weight):
                module.weight = torch.nn.Parameter(weight.dequantize(), requires_grad=False)
        drop_quantizer_tag(model)
    return model
