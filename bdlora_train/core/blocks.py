"""Block-diagonal factors as tensors: which rows and rank columns a tensor-parallel rank owns, packed and dense forms.

With N blocks and rank r, TP rank i of N owns the rank columns [i*r/N, (i+1)*r/N) (`rank_slice`) and, along the
dimension TP splits, the i-th 1/N of every segment (`shard_rows`: one segment is a contiguous cut; Phi-3's fused
[q | k | v] has three). A block-diagonal factor is non-zero only where the two meet (`factor_mask`). PEFT packs the
N blocks of a block-diagonal factor along dim 0 (`peft/tuners/lora/variants.py`, `BlockDiagonalLinear`), so the
dense matrix is `torch.block_diag(*packed.chunk(N, dim=0))` (`dense_from_packed`).
"""

from __future__ import annotations

import torch


def rank_slice(r: int, rank: int, world: int) -> slice:
    """The rank columns TP rank `rank` of `world` owns."""
    return slice(rank * r // world, (rank + 1) * r // world)


def rank_factors(A: torch.Tensor, B: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TP rank `rank`'s slice of dense factors A (r, d_in) and B (d_out, r): A[rs], B[:, rs] with rs its
    `rank_slice`, for either role. A column-parallel rank then keeps B's rows of its output shard (B_ii, the rest are
    off-block zeros) and a row-parallel rank A's columns of its input shard (A_ii): the base layer's own sharding,
    which is what vLLM's `slice_lora_b` / `slice_lora_a` do. No other entry of A or B is needed by that rank."""
    rs = rank_slice(A.shape[0], rank, world)
    return A[rs], B[:, rs]


def shard_rows(segments: tuple[int, ...], nblocks: int, rank: int) -> torch.Tensor:
    """Indices (along the split dimension) rank `rank` of `nblocks` holds: the rank-th 1/N slice of every segment."""
    out, offset = [], 0
    for size in segments:
        step = size // nblocks
        out.append(torch.arange(offset + rank * step, offset + (rank + 1) * step))
        offset += size
    return torch.cat(out)


def rank_order(segments: tuple[int, ...], nblocks: int) -> torch.Tensor:
    """The permutation that puts rank 0's indices first, then rank 1's, ...: contiguous blocks after it."""
    return torch.cat([shard_rows(segments, nblocks, rank) for rank in range(nblocks)])


def factor_mask(segments, r: int, nblocks: int) -> torch.Tensor:
    """(split, r) boolean mask of a block-diagonal factor along a split dimension laid out in `segments`: index j
    belongs to rank i iff it lies in the i-th 1/N slice of its segment; rank i owns its `rank_slice` columns."""
    mask = torch.zeros(sum(segments), r, dtype=torch.bool)
    for rank in range(nblocks):
        mask[shard_rows(tuple(segments), nblocks, rank), rank_slice(r, rank, nblocks)] = True
    return mask


def dense_from_packed(packed: torch.Tensor, nblocks: int) -> torch.Tensor:
    """PEFT's packed block-diagonal weight (blocks stacked along dim 0) -> the dense matrix, zeros off the blocks."""
    return packed if nblocks == 1 else torch.block_diag(*packed.chunk(nblocks, dim=0))


def repack(packed: torch.Tensor, nblocks: int, n: int) -> torch.Tensor:
    """A packed block-diagonal weight with nblocks -> n blocks (n divides nblocks): k = nblocks/n consecutive blocks
    become one (a block-diagonal matrix with k*n blocks is block-diagonal with n blocks)."""
    k = nblocks // n
    chunks = packed.chunk(nblocks, dim=0)
    return torch.cat([torch.block_diag(*chunks[j * k : (j + 1) * k]) for j in range(n)], dim=0)
