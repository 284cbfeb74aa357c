"""Exact exports of a BD-LoRA adapter.

  dense-lora  plain LoRA at the same rank r: the block-diagonal factor written out densely (zeros off the
              blocks), no `use_bdlora`, so any PEFT, mainline vLLM or TGI loads it. Same delta, same logits.
  reblock N   nblocks k·N -> N: each group of k consecutive blocks becomes one block (a block-diagonal matrix
              with k·N blocks is block-diagonal with N blocks), re-packed in PEFT's layout; for serving at TP N.
  merged      W + s·B·A written into the base model, saved as safetensors with save_pretrained. An adapter trained
              on a quantized base (base_quantization.json beside it) is merged into that base's dequantized
              weights: the model it was trained with, in float (re-quantizing the sum would round the delta away).

Every export is written into a temporary directory and renamed into place when complete; `out` may never be,
contain or lie inside the source adapter. Each carries a model card (README.md) that says what it is: the
adapter exports a card of their own adapter and where it came from, the merged model a card of a plain
transformers model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from bdlora_train.adapters.reader import (
    CONFIG_NAME,
    KEY_PREFIX,
    WEIGHTS_NAME,
    Adapter,
    read_adapter,
    read_config,
    read_tensors,
    split_key,
)
from bdlora_train.adapters.shapes import base_model_for, expert_parameter, verify_shapes
from bdlora_train.cards import CARD_NAME, card_base, merged_card, run_metrics, write_model_card
from bdlora_train.core.blocks import repack
from bdlora_train.core.degrees import divides
from bdlora_train.core.errors import ExportError
from bdlora_train.core.files import atomic_dir, atomic_write_text, check_disjoint
from bdlora_train.core.roles import BD_A, BD_B
from bdlora_train.models import load_trained_base
from bdlora_train.quant.quantized import SIDE_FILE, dequantize_
from bdlora_train.serving.plan import serving_lines

EXPORTS = ("dense-lora", "merged")
# Other files an adapter directory may carry (tokenizer, base_quantization.json) are copied; other weights never
# are, and the source's model card describes the source: the export gets its own.
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".npy", ".npz")


def _copy_side_files(src: Path, dst: Path) -> None:
    for path in src.iterdir():
        own = (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME)
        if path.is_file() and path.name not in own and not path.name.endswith(_SKIP_SUFFIXES):
            shutil.copy2(path, dst / path.name)


def _write_adapter(adapter: Adapter, config: dict, tensors: dict, out, force: bool) -> Path:
    with atomic_dir(out, force) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        _copy_side_files(adapter.path, tmp)
    return Path(out)


def _raw(adapter: Adapter) -> tuple[dict, dict]:
    config = read_config(adapter.path)
    if config.get("use_dora") or config.get("lora_bias"):
        raise ExportError(
            f"export: {adapter.path} uses DoRA or lora_bias; only plain (BD-)LoRA factors can be exported exactly"
        )
    return config, read_tensors(adapter.path)


# --------------------------------------------------------------------------------------------- conversions


def dense_lora(adapter: Adapter) -> tuple[dict, dict]:
    """(adapter_config dict, tensors) of the same adapter as plain LoRA at rank r."""
    config, tensors = _raw(adapter)
    config.pop("use_bdlora", None)  # absent rather than null: engines that know the key reject it
    out = {}
    for key, tensor in tensors.items():
        hit = split_key(key)
        if hit and hit[0] in adapter.modules:
            module = adapter.modules[hit[0]]
            tensor = module.dense_A() if hit[1] == "lora_A" else module.dense_B()
        out[key] = tensor.contiguous()
    return config, out


def reblock(adapter: Adapter, n: int) -> tuple[dict, dict]:
    """(adapter_config dict, tensors) with nblocks = n, for serving at TP n."""
    if not adapter.is_bdlora:
        raise ExportError(
            f"export: {adapter.path} is a plain LoRA adapter (no use_bdlora); --reblock needs a BD-LoRA adapter"
        )
    if n == adapter.nblocks:
        smaller = [d for d in adapter.tp_degrees() if d < n]
        fix = f"use --reblock in {smaller} to serve at a lower TP degree" if smaller else "there is nothing to re-block"
        raise ExportError(
            f"export: --reblock {n} is the adapter's own nblocks ({n}): the export would be a copy of {adapter.path}; "
            f"{fix}, or serve {adapter.path} as it is"
        )
    if not divides(n, adapter.nblocks):
        raise ExportError(
            f"export: --reblock {n} does not divide nblocks={adapter.nblocks}: blocks can only be merged in "
            "whole groups; "
            f"use --reblock in {adapter.tp_degrees()}, or --to dense-lora"
        )
    config, tensors = _raw(adapter)
    config["use_bdlora"] = {**config["use_bdlora"], "nblocks": n}
    out = {}
    for key, tensor in tensors.items():
        hit = split_key(key)
        role = adapter.modules[hit[0]].role if hit and hit[0] in adapter.modules else None
        if (role == BD_A and hit[1] == "lora_A") or (role == BD_B and hit[1] == "lora_B"):
            tensor = repack(tensor, adapter.nblocks, n)
        out[key] = tensor.contiguous()
    return config, out


def merge_into(model, adapter: Adapter):
    """Add s·B·A (dense, fp32) to every adapted Linear of `model` and load modules_to_save weights; in place."""
    config, _ = _raw(adapter)
    verify_shapes(adapter, model)  # every adapted module is a Linear of the adapter's shape, or one line
    with torch.no_grad():
        for name, module in adapter.modules.items():
            if module.experts:  # a 3-D expert parameter: every expert's delta, in the parameter's own layout
                param, transposed = expert_parameter(model, name)
                param.add_(module.expert_delta(transposed).to(param.dtype))
                continue
            layer = model.get_submodule(name)
            layer.weight.add_(module.delta_weight().to(layer.weight.dtype))
        params = dict(model.named_parameters())
        for key, tensor in adapter.extra_tensors.items():
            name = key.removeprefix(KEY_PREFIX)
            if name not in params or params[name].shape != tensor.shape:
                raise ExportError(
                    f"export: adapter tensor {key} matches no parameter of the base model; cannot merge it"
                )
            params[name].copy_(tensor.to(params[name].dtype))
    model.name_or_path = f"{config.get('base_model_name_or_path')}+{adapter.path.name}"
    return model


def export(
    adapter_path, out, to: str | None = None, reblock_to: int | None = None, base=None, force: bool = False
) -> Path:
    """`bdlora export`: one of to="dense-lora", to="merged" (needs `base`: a spec or a loaded model) or reblock_to=N."""
    if (to is None) == (reblock_to is None):
        raise ExportError("export: give exactly one of --to {dense-lora,merged} or --reblock N")
    if to is not None and to not in EXPORTS:
        raise ExportError(f"export: --to {to!r}; use one of {EXPORTS}")
    adapter = read_adapter(adapter_path)
    check_disjoint(out, adapter.path)
    if base is None or isinstance(base, str):
        # an edited nblocks would export a file PEFT rejects; a --model of other shapes is named as the cause
        verify_shapes(adapter, base_model_for(adapter, base), given=base)
    else:
        verify_shapes(adapter, base)
    if reblock_to is not None:
        _write_adapter(adapter, *reblock(adapter, reblock_to), out, force)
        note = (
            f"Made by `bdlora export --reblock {reblock_to}` from the BD-LoRA adapter `{adapter.path.resolve()}` "
            f"(nblocks {adapter.nblocks}): each group of {adapter.nblocks // reblock_to} consecutive blocks is one "
            f"block here, for serving at tensor-parallel degree {reblock_to}; the same delta weights, the same outputs."
        )
        return _with_card(out, adapter, note)
    if to == "dense-lora":
        _write_adapter(adapter, *dense_lora(adapter), out, force)
        note = (
            f"Made by `bdlora export --to dense-lora` from the BD-LoRA adapter `{adapter.path.resolve()}` (nblocks "
            f"{adapter.nblocks}): the block-diagonal factors written out densely (zeros off the blocks), without "
            "`use_bdlora`. The same delta weights and outputs as plain LoRA, which every engine with LoRA support "
            "loads; under tensor parallelism each GPU then computes the full-rank LoRA."
            if adapter.is_bdlora
            else f"Made by `bdlora export --to dense-lora` from the adapter `{adapter.path.resolve()}`, already plain "
            "LoRA: the same factors."
        )
        return _with_card(out, adapter, note)
    if Path(out).exists() and not force:  # fail before loading a model
        raise ExportError(f"export: --out {out} already exists; pass --force to replace it or choose another directory")
    tokenizer = None
    if base is None or isinstance(base, str):
        model, tokenizer = load_trained_base(adapter.base_spec(base), adapter.path)
    else:
        model = base
    dequantize_(model)  # trained on a quantized base: merge into its dequantized weights (docs/quantization.md)
    merge_into(model, adapter)
    with atomic_dir(out, force) as tmp:
        model.save_pretrained(str(tmp))  # safetensors (transformers never writes pickles here)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    card = merged_card(out, adapter, _training_facts(adapter), quantized=(adapter.path / SIDE_FILE).is_file())
    atomic_write_text(Path(out) / CARD_NAME, card)
    return Path(out)


def _training_facts(adapter: Adapter) -> dict:
    """What an export's card repeats about the source's training (steps, loss, data, seed): the budget and
    parameter counts describe the source, not the export."""
    metrics = run_metrics(adapter.path)
    return {k: metrics[k] for k in ("model", "dataset", "steps", "final_loss", "seed") if k in metrics}


def _with_card(out, adapter: Adapter, note: str) -> Path:
    """The exported adapter in place, with its own card (written last, naming its final path)."""
    exported = read_adapter(out)
    metrics = _training_facts(adapter)
    serving = serving_lines(exported, card_base(exported, metrics), str(Path(out).resolve()))
    write_model_card(out, serving, metrics=metrics, note=note, adapter=exported)
    return Path(out)
