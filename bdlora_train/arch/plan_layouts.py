"""The TP layout of a Linear or a 3-D expert parameter under its plan style, and every layout a model's plan shards."""

from __future__ import annotations

import torch
from torch import nn

from bdlora_train.arch.fused import candidate_segments, probed_layout
from bdlora_train.arch.plans import GATHER_STYLES, parallel_of
from bdlora_train.arch.scope import ModelView, consumer_of
from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.core.layout import COLUMN, Layout, expert_axis, expert_dims, is_transposed, role_of, role_of_factor
from bdlora_train.core.naming import layer_kind


def linear_layout(name: str, module: nn.Module, style: str, segments: tuple[int, ...] | None = None) -> Layout:
    parallel = parallel_of(style)
    split = module.out_features if parallel == COLUMN else module.in_features
    if segments is None:
        segments = (split // 2, split // 2) if style == "packed_colwise" else (split,)
    return Layout(
        name=name,
        style=style,
        role=role_of(parallel),
        segments=tuple(segments),
        d_in=module.in_features,
        d_out=module.out_features,
    )


# plan style of an expert parameter -> (dimension of (E, d1, d2) it splits, whether that dimension is gate|up halves)
_EXPERT_SPLITS = {
    "packed_colwise": (1, True),
    "packed_rowwise": (2, True),
    "colwise": (1, False),
    "colwise_gather_output": (1, False),
    "rowwise": (2, False),
    "rowwise_split_input": (2, False),
}


def expert_layout(name: str, module: nn.Module, param: torch.Tensor, style: str) -> Layout | None:
    """Layout of a 3-D expert parameter (E, d1, d2) under its plan style; None if the style shards no dimension.

    PEFT's ParamWrapper builds per-expert factors with delta_e = B_e A_e (core/layout.py: which factor spans which
    axis); the factor spanning the dimension TP splits is the block-diagonal one.
    """
    if param.ndim != 3 or style not in _EXPERT_SPLITS:
        return None
    dim, packed = _EXPERT_SPLITS[style]
    transposed = is_transposed(module)
    role = role_of_factor("B" if expert_axis("B", transposed) == dim else "A")
    experts, d_in, d_out = expert_dims(param.shape, transposed)
    size = param.shape[dim]
    return Layout(
        name=name,
        style=style,
        role=role,
        segments=(size // 2, size // 2) if packed else (size,),
        d_in=d_in,
        d_out=d_out,
        experts=experts,
    )


def column_segments(view: ModelView, name: str, module: nn.Module, style: str, probe_model=None):
    """Segments of a column-parallel Linear: implied by transformers' style, else probed on a tiny model of the
    family (`probe_model(family)`, see fused.py); None for a contiguous output."""
    if style not in GATHER_STYLES:
        return None  # colwise: contiguous (transformers runs the consumer on contiguous shards); packed: halves
    consumer = consumer_of(name, view.plan, view.model, view.prefix)
    consumer_in = view.modules[consumer].in_features if consumer in view.modules else None
    candidates = candidate_segments(view.config, module.out_features, consumer_in)
    if len(candidates) == 1:
        return candidates["contiguous"]  # no fused reading of its width: one projection
    label = probed_layout(probe_model, view.family, layer_kind(view.relative(name))) if probe_model else None
    if label not in candidates:  # None: nothing confirmed; or a reading this model's widths do not allow
        raise BlockDiagLoraConfigError(
            f"{name}: {style} output of width {module.out_features} could be laid out as {sorted(candidates)} and "
            f"no layout could be confirmed on a tiny {view.family} model; drop it from target_modules"
        )
    return candidates[label]


def plan_layouts(model: nn.Module, probe_model=None) -> dict[str, Layout]:
    """Every Linear and expert parameter of the language model's decoder that its TP plan shards, with its layout
    (what a TP harness or engine shards; independent of what an adapter targets)."""
    view = ModelView(model)
    out: dict[str, Layout] = {}
    for name, module in view.modules.items():
        style = view.style(name)
        if not isinstance(module, nn.Linear) or parallel_of(style) is None:
            continue
        segments = column_segments(view, name, module, style, probe_model) if parallel_of(style) == COLUMN else None
        out[name] = linear_layout(name, module, style, segments)
    for key, (module, pname) in view.experts.items():
        style = view.style(key)
        layout = expert_layout(key, module, getattr(module, pname), style) if style else None
        if layout is not None:
            out[key] = layout
    return out
