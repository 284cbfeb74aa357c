"""`Layout`: where a TP-sharded layer splits and which LoRA factor must be block-diagonal there; the axes of a
3-D expert parameter.

transformers 5 stores MoE experts as one (E, d1, d2) parameter per projection. PEFT's `ParamWrapper`
(peft/tuners/lora/layer.py) reads it as (E, out, in) unless the experts module says `is_transposed`, in which case it
is (E, in, out); `expert_dims` and `to_param_layout` are that rule.
"""

from __future__ import annotations

from dataclasses import dataclass

COLUMN, ROW = "column", "row"


@dataclass(frozen=True)
class Layout:
    """name: module name (Linear) or `module.parameter` (experts); style: the TP plan style; parallel: column/row;
    factor: "B" (B spans the split dimension: block-diagonal B) or "A"; segments: sizes along the split dimension
    (one entry = contiguous; several = rank i holds the i-th 1/N of each); experts: E for a 3-D parameter, else 0;
    d_in / d_out: LoRA's in/out features as PEFT builds them (per expert)."""

    name: str
    style: str
    parallel: str
    factor: str
    segments: tuple[int, ...]
    d_in: int
    d_out: int
    experts: int = 0

    @property
    def kind(self) -> str:
        return "expert" if self.experts else "linear"

    @property
    def fused(self) -> bool:
        return len(self.segments) > 1

    @property
    def split(self) -> int:
        return sum(self.segments)


def is_transposed(module) -> bool:
    """Whether an experts module stores its (E, d1, d2) parameters as (E, in, out) (transformers' `is_transposed`)."""
    return bool(getattr(module, "is_transposed", False))


def expert_dims(shape, transposed: bool) -> tuple[int, int, int]:
    """(experts, d_in, d_out) of an expert parameter of shape (E, d1, d2), as PEFT's ParamWrapper reads it."""
    experts, d1, d2 = shape
    return (experts, d1, d2) if transposed else (experts, d2, d1)


def to_param_layout(delta, transposed: bool):
    """A per-expert delta in PEFT's (E, d_out, d_in) -> the parameter's own (E, d1, d2) layout."""
    return delta.transpose(1, 2) if transposed else delta


def expert_axis(factor: str, transposed: bool) -> int:
    """The dimension (1 or 2) of an (E, d1, d2) parameter that the block-diagonal `factor` ("A" or "B") spans."""
    out_dim = 2 if transposed else 1
    return out_dim if factor == "B" else 3 - out_dim
