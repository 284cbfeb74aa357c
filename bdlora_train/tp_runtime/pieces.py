"""Rank-local pieces of the LoRA factors PEFT stores densely (segment-aware fused projections, MoE expert factors).

PEFT keeps these factors as plain 2-D tensors with explicit zeros (peft_integration/storage.py): a fused Linear's
`lora_B` (d_out, r); an expert parameter's `lora_A` (r*E, d_in) with expert e's rows e*r..(e+1)*r and `lora_B`
(d_out, r*E) with expert e's rank column j at j*E + e (PEFT's `ParamWrapper.get_delta_factors`). What TP rank i of
N needs of them is no DTensor placement: along the split dimension, the i-th 1/N of every segment
(`core/blocks.py shard_rows`), and of the rank, its slice (`rank_slice`) in every expert. So each such factor is held
as a DTensor of shape (N, a, b), Shard(0): rank i's piece `W[rows_i][:, cols_i]` (`Piece.local`); `pack` / `unpack`
convert between that and PEFT's tensor (unpack writes the zeros), for the saved adapter and the optimizer state,
so a checkpoint is PEFT's format whatever the TP degree.

  factor spanning the split   lora_A piece (rows, cols)          lora_B piece (rows, cols)
  B (column-parallel)         (rank slice of every expert, all)  (split rows, rank slice of every expert)
  A (row-parallel)            (rank slice of every expert, split) (all, rank slice of every expert)
  plain LoRA, B splits        replicated                         (split rows, all)
  plain LoRA, A splits        (all, split rows)                  replicated

Under expert parallelism (`expert_pieces`) rank k of ep holds whole experts, the k-th contiguous 1/ep of them, so
its pieces are those experts' entries: lora_A's rows e*r..(e+1)*r and lora_B's columns j*E + e, for every rank column j
and each of its experts e (blocks, if any, included whole).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bdlora_train.core.blocks import rank_slice, shard_rows
from bdlora_train.core.degrees import divides


@dataclass(frozen=True, eq=False)
class Piece:
    """Which entries of one PEFT factor tensor each TP rank holds: rows[i] / cols[i] are index tensors (None: all)."""

    shape: tuple[int, int]
    rows: tuple[torch.Tensor | None, ...]
    cols: tuple[torch.Tensor | None, ...]

    @property
    def world(self) -> int:
        return len(self.rows)

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s piece of a tensor shaped like PEFT's."""
        rows, cols = self.rows[rank], self.cols[rank]
        out = full if rows is None else full.index_select(0, rows.to(full.device))
        return out if cols is None else out.index_select(1, cols.to(full.device))

    def pack(self, full: torch.Tensor) -> torch.Tensor:
        """PEFT's tensor -> (N, a, b): every rank's piece."""
        return torch.stack([self.local(full, rank) for rank in range(self.world)])

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(N, a, b) -> PEFT's tensor, zeros where no rank holds an entry (the off-block zeros)."""
        full = packed.new_zeros(self.shape)
        for rank in range(self.world):
            rows = self.rows[rank] if self.rows[rank] is not None else torch.arange(self.shape[0])
            cols = self.cols[rank] if self.cols[rank] is not None else torch.arange(self.shape[1])
            full[rows[:, None], cols[None, :]] = packed[rank]
        return full


def factor_pieces(
    shape_a, shape_b, segments, r: int, world: int, experts: int, factor: str, block_diagonal: bool
) -> tuple[Piece | None, Piece | None]:
    """(lora_A piece, lora_B piece) of one dense-stored layer over `world` TP ranks (None: the factor is replicated;
    see the module docstring). `factor`: the one spanning the split dimension ("A" or "B"); `experts`: E, 0 for a
    Linear; `segments`: sizes along the split dimension."""
    count = max(experts, 1)
    split = [shard_rows(tuple(segments), world, rank) for rank in range(world)]
    if not block_diagonal:
        if factor == "B":
            return None, Piece(tuple(shape_b), tuple(split), (None,) * world)
        return Piece(tuple(shape_a), (None,) * world, tuple(split)), None
    ranks = [torch.arange(r)[rank_slice(r, rank, world)] for rank in range(world)]
    a_rows = tuple((torch.arange(count)[:, None] * r + cols[None, :]).reshape(-1) for cols in ranks)
    b_cols = tuple((cols[:, None] * count + torch.arange(count)[None, :]).reshape(-1) for cols in ranks)
    if factor == "B":
        return Piece(tuple(shape_a), a_rows, (None,) * world), Piece(tuple(shape_b), tuple(split), b_cols)
    return Piece(tuple(shape_a), a_rows, tuple(split)), Piece(tuple(shape_b), (None,) * world, b_cols)


def expert_pieces(shape_a, shape_b, r: int, experts: int, world: int) -> tuple[Piece, Piece]:
    """(lora_A piece, lora_B piece) of an expert parameter over `world` expert-parallel ranks (module docstring):
    rank k's experts are k*E/world .. (k+1)*E/world - 1; B's columns come rank-major, (j, e), as PEFT orders them."""
    if shape_a[0] != r * experts or shape_b[1] != r * experts or not divides(world, experts):
        raise ValueError(
            f"expert_pieces: A {tuple(shape_a)} / B {tuple(shape_b)} are not {experts} experts of rank {r} over "
            f"{world} ranks"
        )
    local = experts // world
    owned = [torch.arange(rank * local, (rank + 1) * local) for rank in range(world)]
    a_rows = tuple((mine[:, None] * r + torch.arange(r)[None, :]).reshape(-1) for mine in owned)
    b_cols = tuple((torch.arange(r)[:, None] * experts + mine[None, :]).reshape(-1) for mine in owned)
    return Piece(tuple(shape_a), a_rows, (None,) * world), Piece(tuple(shape_b), (None,) * world, b_cols)

