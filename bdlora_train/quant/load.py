"""A quantized base from recipe keys: load it, prepare it for training, record it with the adapter, undo it for export.

Recipe keys (train/recipe.py) -> a transformers quantization config:
  load_in_4bit (+ bnb_4bit_quant_type, bnb_4bit_compute_dtype, bnb_4bit_use_double_quant)  BitsAndBytesConfig, 4-bit
  load_in_8bit                                                                            BitsAndBytesConfig, 8-bit
  torchao_int8                                                          TorchAoConfig(Int8WeightOnlyConfig())
The model is loaded by transformers with that config; the tiny and embedded models, which are built in memory, go
through a temporary checkpoint so the quantization is exactly what the same weights from the Hub would get. Before
training, PEFT's `prepare_model_for_kbit_training` (freeze, fp32 norms/embeddings, gradient checkpointing) runs as
PEFT users expect. The keys are saved next to the adapter (`base_quantization.json`), so `bdlora export --to merged`
can rebuild the exact base the adapter was trained on and merge into its *dequantized* weights.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from bdlora_train.errors import ExportError, ModelSpecError, RecipeError, first_line
from bdlora_train.quant.detect import BNB_4BIT, BNB_8BIT, TORCHAO_INT8, is_torchao_weight, model_quant_kinds
from bdlora_train.quant.guard import check_not_repacked, keep_trainable_packing

SWITCHES = {"load_in_4bit": BNB_4BIT, "load_in_8bit": BNB_8BIT, "torchao_int8": TORCHAO_INT8}
QUANT_KEYS = (*SWITCHES, "bnb_4bit_quant_type", "bnb_4bit_compute_dtype", "bnb_4bit_use_double_quant")
QUANT_TYPES = ("nf4", "fp4")
SIDE_FILE = "base_quantization.json"  # next to adapter_config.json; PEFT ignores it, export --to merged reads it


def recipe_kind(recipe) -> str | None:
    """BNB_4BIT, BNB_8BIT, TORCHAO_INT8, or None for a float base."""
    return next((kind for key, kind in SWITCHES.items() if getattr(recipe, key)), None)


def check_recipe(recipe) -> None:
    """The quantization keys' own checks, called by Recipe.validate (no model needed)."""
    on = [key for key in SWITCHES if getattr(recipe, key)]
    if len(on) > 1:
        raise RecipeError(f"recipe: {' and '.join(k + '=true' for k in on)}; a base is quantized one way, pick one")
    if recipe.bnb_4bit_quant_type not in QUANT_TYPES:
        raise RecipeError(f"recipe: bnb_4bit_quant_type={recipe.bnb_4bit_quant_type!r}; use one of {QUANT_TYPES}")
    if recipe.bnb_4bit_compute_dtype not in (None, "float32", "bfloat16", "float16"):
        raise RecipeError(
            f"recipe: bnb_4bit_compute_dtype={recipe.bnb_4bit_compute_dtype!r}; use float32, bfloat16, float16 or "
            "null (= torch_dtype)"
        )
    four_bit_only = (
        recipe.bnb_4bit_use_double_quant or recipe.bnb_4bit_compute_dtype or recipe.bnb_4bit_quant_type != "nf4"
    )
    if four_bit_only and not recipe.load_in_4bit:
        raise RecipeError("recipe: bnb_4bit_* keys apply to load_in_4bit=true only; set it or drop them")
    if on and (getattr(recipe, "deepspeed", None) or getattr(recipe, "fsdp", None)):
        raise RecipeError(
            f"recipe: {on[0]}=true with deepspeed/fsdp is not supported (a quantized base is trained on one device "
            "per process); drop deepspeed/fsdp, or train an unquantized base with them"
        )


def quantization_config(recipe):
    """The transformers quantization config the recipe asks for, or None."""
    kind = recipe_kind(recipe)
    if kind is None:
        return None
    if kind == TORCHAO_INT8:
        from torchao.quantization import Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        return TorchAoConfig(quant_type=Int8WeightOnlyConfig())
    from transformers import BitsAndBytesConfig

    if kind == BNB_8BIT:
        return BitsAndBytesConfig(load_in_8bit=True)
    from bdlora_train.train.recipe import dtype

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=recipe.bnb_4bit_quant_type,
        bnb_4bit_compute_dtype=dtype(recipe.bnb_4bit_compute_dtype or recipe.torch_dtype),
        bnb_4bit_use_double_quant=recipe.bnb_4bit_use_double_quant,
    )


def _device_map():
    """Every quantized layer on this process's device: its GPU (LOCAL_RANK under torchrun/accelerate) or the CPU."""
    if torch.cuda.is_available():
        return {"": int(os.environ.get("LOCAL_RANK", "0"))}
    return "cpu"


def _from_pretrained(path: str, quantization, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, quantization_config=quantization, device_map=_device_map(), trust_remote_code=False
        )
    except (OSError, ValueError, ImportError, RuntimeError) as err:
        method = getattr(quantization, "quant_method", "quantized")
        raise ModelSpecError(
            f"--model {path}: cannot load it {getattr(method, 'value', method)} ({first_line(err, 160)})"
        ) from None
    keep_trainable_packing(model)  # evaluations (compare scores the base first) must not repack 4-bit weights
    return model


def load_quantized(
    spec: str, quantization, dtype: torch.dtype = torch.float32, seed: int = 0, with_tokenizer: bool = True
):
    """(model, tokenizer or None) for a --model spec, quantized as `quantization` (a transformers config) says."""
    from bdlora_train.models import EMBEDDED, load_model

    if spec == EMBEDDED or spec.startswith("tiny:"):
        # built in memory: quantize via a checkpoint
        model, tokenizer = load_model(spec, dtype=dtype, seed=seed, with_tokenizer=with_tokenizer)
        name = model.name_or_path
        with tempfile.TemporaryDirectory(prefix="bdlora-quant-") as tmp:
            model.save_pretrained(tmp)
            del model
            model = _from_pretrained(tmp, quantization, dtype)
        model.name_or_path = name  # the adapter's base_model_name_or_path stays the spec's (e.g. the Hub id)
        return model, tokenizer
    from transformers import AutoTokenizer

    model = _from_pretrained(spec, quantization, dtype)
    if not with_tokenizer:
        return model, None
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec, trust_remote_code=False)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


def prepare_for_training(model, recipe):
    """train(): the base must be quantized as the recipe says (never silently float, never silently quantized),
    never repacked for inference; then PEFT's `prepare_model_for_kbit_training`. Returns `model`."""
    wanted, found = recipe_kind(recipe), model_quant_kinds(model)
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
            "load it with bdlora_train.models.load_model(spec, quantization=quantization_config(recipe))"
        )
    check_not_repacked(model)
    keep_trainable_packing(model)
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=recipe.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )


def write_side_file(adapter_dir, recipe) -> None:
    """Record the base's quantization next to the adapter (nothing for a float base)."""
    if recipe_kind(recipe) is None:
        return
    keys = {key: getattr(recipe, key) for key in (*QUANT_KEYS, "torch_dtype")}
    from bdlora_train.files import atomic_write_text

    atomic_write_text(Path(adapter_dir) / SIDE_FILE, json.dumps(keys, indent=2, sort_keys=True) + "\n")


def read_side_file(adapter_dir):
    """The keys `write_side_file` saved, as a namespace `quantization_config` accepts; None for a float base."""
    path = Path(adapter_dir) / SIDE_FILE
    if not path.is_file():
        return None
    from types import SimpleNamespace

    try:
        keys = json.loads(path.read_text())
        if not isinstance(keys, dict) or set(keys) - set(_SIDE_DEFAULTS):
            raise ValueError(f"expected a mapping of {sorted(_SIDE_DEFAULTS)}")
        record = SimpleNamespace(**{**_SIDE_DEFAULTS, **keys})
        check_recipe(record)
    except (ValueError, TypeError) as err:  # RecipeError is a ValueError
        raise ExportError(f"export: {path} is not a valid base quantization record ({first_line(err)})") from None
    return record if recipe_kind(record) else None


def load_trained_base(spec: str, adapter_dir, with_tokenizer: bool = True):
    """(model, tokenizer or None): the base at `spec` as the adapter in `adapter_dir` was trained on it, quantized the
    same way when the adapter carries base_quantization.json (export --to merged, TrainResult.model)."""
    from bdlora_train.models import load_model
    from bdlora_train.train.recipe import dtype

    record = read_side_file(adapter_dir)
    if record is None:
        return load_model(spec, with_tokenizer=with_tokenizer)
    quantization = quantization_config(record)
    return load_model(spec, dtype(record.torch_dtype), with_tokenizer=with_tokenizer, quantization=quantization)


_SIDE_DEFAULTS = {
    **dict.fromkeys(SWITCHES, False),
    "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_compute_dtype": None,
    "bnb_4bit_use_double_quant": False,
    "torch_dtype": "float32",
}


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
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    return model
