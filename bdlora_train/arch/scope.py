"""The language model's decoder inside a model, the modules target resolution reads, and what is never adapted.

A multimodal model's vision/audio tower lies outside the decoder (`model.get_decoder()`), so plan patterns (written
relative to the text model) never give tower layers a role. `ModelView` is what resolution reads from a model: its
Linear modules and 3-D expert parameters under their canonical names (PEFT's wrapper levels removed), the decoder
prefix and the TP plan.
"""

from __future__ import annotations

import re

from torch import nn

from bdlora_train.arch.plans import expert_tp_entries, parallel_of, plan_style, tp_plan
from bdlora_train.core.heads import text_config
from bdlora_train.core.layout import ROW
from bdlora_train.core.naming import canonical, layer_kind, relative, unwrap


def decoder_prefix(model: nn.Module) -> str:
    """Name of the language model's decoder module ("" if it is the model itself, e.g. a bare text model)."""
    decoder = None
    if hasattr(model, "get_decoder"):
        try:
            decoder = model.get_decoder()
        except (AttributeError, NotImplementedError, TypeError):
            decoder = None
    if decoder is not None and decoder is not model:
        for name, module in model.named_modules():
            if module is decoder:
                return name
    # get_decoder() is the model itself (Llama4ForCausalLM): the module holding the decoder layer stack.
    layers = getattr(text_config(getattr(model, "config", None)), "num_hidden_layers", None)
    best = None
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if isinstance(child, nn.ModuleList) and len(child) == layers and child_name in ("layers", "h", "blocks"):
                if best is None or len(name) < len(best):
                    best = name
    return best or ""


def is_router(name: str, module: nn.Module, config) -> bool:
    """A MoE router or shared-expert gate (its output is the expert scores or one gate value): never adapted."""
    config = text_config(config)
    experts = {getattr(config, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts")} - {None}
    leaf = name.rsplit(".", 1)[-1]
    out = getattr(module, "out_features", None)
    return ("gate" in leaf or "router" in leaf) and out is not None and (out == 1 or out in experts)


def consumer_of(name: str, plan: dict[str, str], model: nn.Module, prefix: str) -> str | None:
    """The row-parallel sibling that consumes a column-parallel layer's output (o_proj for qkv, down for gate_up)."""
    parent = name.rpartition(".")[0]
    for child_name, child in model.get_submodule(parent).named_children():
        full = f"{parent}.{child_name}"
        rel = relative(full, prefix)
        if isinstance(unwrap(child), nn.Linear) and rel and parallel_of(plan_style(rel, plan)) == ROW:
            return full
    return None


class ModelView:
    """What resolution reads from a model: its Linear modules, expert parameters, decoder scope and TP plan."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = getattr(model, "config", None)
        self.family = getattr(self.config, "model_type", None) or type(model).__name__
        self.prefix = decoder_prefix(model) if self.config is not None else ""
        self.plan = tp_plan(self.config) if self.config is not None else {}
        self.modules: dict[str, nn.Module] = {}
        self.experts: dict[str, tuple[nn.Module, str]] = {}  # "module.param" -> (owning module, param name)
        for name, module in model.named_modules():
            if not name or ".lora_" in name or name.endswith(".base_layer"):
                continue
            base = unwrap(module)
            self.modules[canonical(name)] = base
            for pname, param in base.named_parameters(recurse=False):
                if param.ndim == 3:
                    self.experts[f"{canonical(name)}.{pname}"] = (base, pname)
        for name, module in model.named_modules():  # experts modules that PEFT already wrapped
            if name.endswith(".base_layer") and not hasattr(module, "get_base_layer"):
                for pname, param in module.named_parameters(recurse=False):
                    if param.ndim == 3:
                        self.experts.setdefault(f"{canonical(name)}.{pname}", (module, pname))

    def relative(self, name: str) -> str | None:
        return relative(name, self.prefix)

    def style(self, name: str) -> str | None:
        rel = self.relative(name)
        return plan_style(rel, self.plan) if rel is not None else None

    def in_layers(self, name: str) -> bool:
        rel = self.relative(name)
        return rel is not None and re.match(r"^[A-Za-z_]+\.\d+\.", rel) is not None

    def short(self, name: str) -> str:
        """`model.layers.3.self_attn.q_proj` -> `self_attn.q_proj` (the kind of layer, for messages)."""
        rel = self.relative(name)
        kind = layer_kind(rel if rel is not None else name)
        return re.sub(r"^[A-Za-z_]+\.\*\.", "", kind)

    def catalogue(self) -> list[str]:
        """The kinds of TP-sharded projections of the decoder layers: for messages."""
        kinds: dict[str, str] = {}
        for name, module in self.modules.items():
            if isinstance(module, nn.Linear) and parallel_of(self.style(name)) and self.in_layers(name):
                kinds.setdefault(self.short(name), name)
        for key in self.experts:
            if self.style(key) and self.in_layers(key):
                kinds.setdefault(self.short(key), key)
        return sorted(kinds)


def split_experts(model) -> dict[str, str]:
    """For a TP run without expert parallelism on the (meta-device) `model`: `expert_tp_entries` added to its text
    config's plan (what the run's checks read), returned with the decoder's prefix (what transformers'
    `DistributedConfig(tp_plan=...)` takes to load the base with the experts split)."""
    entries = expert_tp_entries(model.config)
    if entries:
        config = text_config(model.config)
        config.base_model_tp_plan = {**(config.base_model_tp_plan or {}), **entries}
    prefix = decoder_prefix(model)
    return {f"{prefix}.{key}" if prefix else key: style for key, style in entries.items()}
