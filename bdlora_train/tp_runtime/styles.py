"""The TP styles the runtime computes (column, row, replicated, expert-parallel), what each adapted layer's shard is
(`AdapterShard`) and where its factors are placed on the mesh."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from bdlora_train.core.layout import COLUMN
from bdlora_train.core.roles import Role, is_block_diagonal

REPLICATED = "replicated"  # a targeted Linear transformers' plan leaves whole on every rank (Qwen2-MoE's shared expert)


EXPERT_PARALLEL = "expert_parallel"  # an expert parameter transformers' EP plan splits by whole experts (ep_size)


@dataclass(frozen=True)
class AdapterShard:
    """How one adapted Linear is sharded: its TP style, the adapter's role, and the mesh its weights live on."""

    style: str  # a Linear's Side (core/layout.py: COLUMN or ROW), REPLICATED, "expert" or EXPERT_PARALLEL
    role: Role  # bd_a | bd_b | plain (plain LoRA)
    nblocks: int  # blocks of the block-diagonal factor (1 for plain LoRA)
    mesh: object
    gather_output: bool = False  # colwise_gather_output: the output shards are all-gathered (the base's own)
    split_input: bool = False  # rowwise_split_input: the input arrives replicated and is split locally
    dense: bool = False  # the factors are dense-stored (tp_runtime/pieces.py), not PEFT-native blocks
    order: torch.Tensor | None = None  # a fused projection: gathered output columns -> the fused layout
    pieces: tuple = (None, None)  # the rank-local Piece lora_A / lora_B holds (None: a DTensor of the whole factor)

    @property
    def world(self) -> int:
        return self.mesh.size()


def factor_placements(shard: AdapterShard):
    """(lora_A placement, lora_B placement) of one layer (the table in the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard

    if is_block_diagonal(shard.role):
        return (Shard(0), Shard(0)) if shard.style == COLUMN else (Shard(0), Shard(1))
    return (Replicate(), Shard(0)) if shard.style == COLUMN else (Shard(1), Replicate())


# The fix when a BD adapter's blocks do not split over the TP ranks (every rank must hold whole blocks).
WHOLE_BLOCKS = "use nblocks={0} (the default under TP) or a multiple of it"


class TrainedStyle(NamedTuple):
    """What `ShardedLora` does beside the split (its side: arch/plans.py `parallel_of` of the style)."""

    gathers_output: bool  # the output shards are all-gathered (colwise_gather_output)
    splits_input: bool  # the input arrives replicated and is split locally (rowwise_split_input)


# transformers' plan styles of a Linear that `ShardedLora` (layers.py) computes. Other styles (packed / expert / MLA
# styles) are refused before the model loads.
TRAINED_STYLES = {
    "colwise": TrainedStyle(False, False),
    "colwise_gather_output": TrainedStyle(True, False),
    "rowwise": TrainedStyle(False, False),
    "rowwise_split_input": TrainedStyle(False, True),
}
