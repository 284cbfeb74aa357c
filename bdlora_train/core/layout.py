"""`Layout`: where a TP-sharded layer splits and which LoRA factor must be block-diagonal there; the axes of a
3-D expert parameter.

transformers 5 stores MoE experts as one (E, d1, d2) parameter per projection. PEFT's `ParamWrapper`
(peft/tuners/lora/layer.py) reads it as (E, out, in) unless the experts module says `is_transposed`, in which case it
is (E, in, out); `expert_dims` and `to_param_layout` are that rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from bdlora_train.core.roles import BD_A, BD_B, Role


class Side(str, Enum):
    """The side of a Linear that tensor parallelism splits: its output (column-parallel: transformers' `colwise`
    styles, vLLM's ColumnParallelLinear) or its input (row-parallel: `rowwise`, RowParallelLinear). A `str`, so it
    compares equal to and prints as "column" / "row"."""

    COLUMN = "column"
    ROW = "row"

    def __str__(self) -> str:
        return self.value


COLUMN, ROW = Side.COLUMN, Side.ROW
# One bit, three spellings: a column-parallel split makes B block-diagonal (role bd_b), a row-parallel split A (bd_a).
# This is the one role -> side table (the training runtime, the TP diagnostics and the vLLM plugin read it through
# `side_of_role` / `role_of`); which factor spans the split is derived here too, and nowhere else.
_SIDE = {BD_B: COLUMN, BD_A: ROW}
_FACTOR = {BD_B: "B", BD_A: "A"}


def side_of_role(role: Role) -> Side:
    """The side a block-diagonal role belongs on: bd_b -> COLUMN, bd_a -> ROW."""
    return _SIDE[role]


def role_of(parallel: str | None) -> Role | None:
    """The block-diagonal role of a split side: COLUMN -> bd_b, ROW -> bd_a, None (not split) -> None."""
    return {side: role for role, side in _SIDE.items()}.get(parallel)


def factor_of(role: Role) -> str:
    """The factor a block-diagonal role makes block-diagonal: bd_b -> "B", bd_a -> "A"."""
    return _FACTOR[role]


def role_of_factor(factor: str) -> Role:
    """The role whose block-diagonal factor is `factor` ("B" -> bd_b, "A" -> bd_a)."""
    return {name: role for role, name in _FACTOR.items()}[factor]


@dataclass(frozen=True)
class Layout:
    """name: module name (Linear) or `module.parameter` (experts); style: the TP plan style; role: bd_b (column-
    parallel: B spans the split dimension and is block-diagonal) or bd_a (row-parallel: A); segments: sizes along the
    split dimension (one entry = contiguous; several = rank i holds the i-th 1/N of each); experts: E for a 3-D
    parameter, else 0; d_in / d_out: LoRA's in/out features as PEFT builds them (per expert)."""

    name: str
    style: str
    role: Role
    segments: tuple[int, ...]
    d_in: int
    d_out: int
    experts: int = 0

    @property
    def parallel(self) -> str:
        """COLUMN (TP splits the output) or ROW (the input)."""
        return _SIDE[self.role]

    @property
    def factor(self) -> str:
        """The block-diagonal factor: "B" (it spans the split output) or "A" (the split input)."""
        return _FACTOR[self.role]

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
