"""`TPLoraLinear`: a Linear that PyTorch's ColwiseParallel / RowwiseParallel shard as usual, plus its LoRA shard.

The LoRA term is added to the local output *inside* the layer, i.e. before RowwiseParallel's output hook issues
the base all-reduce, so `CommDebugMode` sees exactly the collectives each sharding needs:

  BD-LoRA   column-parallel: rank i holds A_i (r/N x d_in) and B_ii; x A_i B_ii is its output shard.
            row-parallel: rank i holds A_ii and B_i (d_out x r/N); x_i A_ii B_i is a partial sum the base
            all-reduce adds up. No collective of its own.
  S-LoRA    column-parallel: A sharded along the rank, one all-gather of the (tokens x r) A output per group of
            sibling layers (q|k|v, gate|up); row-parallel: A sharded along d_in, one all-reduce after A, B
            sharded along d_out (zero-padded into the base partial sum).
"""

from __future__ import annotations

import torch
from torch import nn

from bdlora_train.adapters.reader import ModuleFactors
from bdlora_train.core.blocks import rank_factors, rank_slice
from bdlora_train.core.layout import COLUMN, Side

FORWARD_SCHEMES = ("base", "bdlora", "slora")


class TPLoraLinear(nn.Linear):
    """A Linear that ColwiseParallel / RowwiseParallel shard as usual, plus this rank's LoRA shard.

    Subclassing nn.Linear keeps PyTorch's own styles applicable; the LoRA term is accumulated into the local
    output and re-wrapped with the same placement (Shard(-1) or Partial), so it rides on the base layer's
    existing communication.
    """

    def __init__(self, linear: nn.Linear, side: Side):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.side = side
        self.mode = "base"
        self.group: SiblingGroup | None = None  # column-parallel layers fed the same input share x·A

    def set_mode(self, mode: str) -> None:
        self.mode = mode

    def set_factors(self, factors: ModuleFactors, rank: int, world: int, order=None) -> None:
        """Cut this rank's BD-LoRA and S-LoRA shards out of the dense factors (A: r × d_in, B: d_out × r).

        `order`: the row permutation of a segment-aware fused layer (its base weight is permuted the same way), so
        that rank i's contiguous rows are the i-th 1/N of every segment.
        """
        A = factors.dense_A().to(self.weight)
        B = factors.dense_B().to(self.weight) * factors.scaling  # scaling folded in: one pass less
        if order is not None:
            B = B[order]
        ins, outs = (rank_slice(n, rank, world) for n in (self.in_features, self.out_features))
        A_rank, B_rank = rank_factors(A, B, rank, world)  # A_i: r/N × d_in, B_i: d_out × r/N
        # plain attributes, not buffers: distribute_module would turn buffers into replicated DTensors
        if self.side == COLUMN:
            self.bd_A = A_rank.contiguous()  # A_i
            self.bd_B = B_rank[outs].contiguous()  # B_ii: d_out/N × r/N
            self.sl_A = A_rank.contiguous()  # A_i, its output all-gathered
            self.sl_B = B[outs].contiguous()  # d_out/N × r
        else:
            self.bd_A = A_rank[:, ins].contiguous()  # A_ii: r/N × d_in/N
            self.bd_B = B_rank.contiguous()  # B_i
            self.sl_A = A[:, ins].contiguous()  # r × d_in/N, its output all-reduced
            self.sl_B = B[outs].contiguous()  # d_out/N × r
        self.out_slice = outs

    def forward(self, x):
        from torch.distributed.tensor import DTensor

        y = super().forward(x)  # DTensor: Shard(-1) (colwise) or Partial (rowwise)
        if self.mode == "base" or not hasattr(self, "bd_A"):
            return y
        x_local = x.to_local() if isinstance(x, DTensor) else x
        out = self._bdlora(x_local, y) if self.mode == "bdlora" else self._slora(x_local, y)
        return DTensor.from_local(out, y.device_mesh, y.placements, run_check=False)

    def _bdlora(self, x, y):
        xa = self.group.project(self, x, y.device_mesh) if self.group else x @ self.bd_A.T
        return _addmm(y.to_local(), xa, self.bd_B)

    def _slora(self, x, y):
        from torch.distributed.tensor import DTensor, Partial, Replicate

        if self.side == COLUMN:
            return _addmm(y.to_local(), self.group.project(self, x, y.device_mesh), self.sl_B)
        xa = DTensor.from_local(x @ self.sl_A.T, y.device_mesh, [Partial()], run_check=False)
        xa = xa.redistribute(y.device_mesh, [Replicate()]).to_local()  # the S-LoRA all-reduce after A
        # B is sharded along d_out: this rank's slice goes into the base partial sum, which the base all-reduce
        # completes (S-LoRA fuses its final gather into that all-reduce).
        out = y.to_local().clone()
        rows = out.view(-1, self.out_features)[:, self.out_slice]
        rows.addmm_(xa.reshape(-1, xa.shape[-1]), self.sl_B.T)
        return out


def _addmm(y, xa, B):
    """y + xa·Bᵀ in one kernel (no separate pass for the add)."""
    return torch.addmm(y.reshape(-1, y.shape[-1]), xa.reshape(-1, xa.shape[-1]), B.T).view(y.shape)


def _all_gather_last(t, mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return (
        DTensor.from_local(t, mesh, [Shard(t.dim() - 1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()
    )


class SiblingGroup:
    """Column-parallel siblings fed the same input (q|k|v, gate|up) share one x·A product.

    BD-LoRA and S-LoRA both compute x·[A_q; A_k; A_v] as one matmul (one pass over x). For S-LoRA that product
    is what must be all-gathered, so the group also issues one all-gather instead of one per layer. The first
    member called computes it for everyone; a member that sees a different input (or comes back twice)
    triggers a fresh product, so results are always right and only the counts depend on the model calling
    siblings together.
    """

    def __init__(self, members: list[TPLoraLinear]):
        self.members = members
        self.A = {"bdlora": torch.cat([m.bd_A for m in members]), "slora": torch.cat([m.sl_A for m in members])}
        self.widths = {
            mode: [getattr(m, attr).shape[0] for m in members] for mode, attr in (("bdlora", "bd_A"), ("slora", "sl_A"))
        }
        self.cache: dict[int, torch.Tensor] = {}
        self.key = None

    def project(self, member: TPLoraLinear, x, mesh):
        mode = member.mode
        key = (mode, x.data_ptr(), tuple(x.shape), tuple(x.stride()))
        if key != self.key or id(member) not in self.cache:
            widths = self.widths[mode]
            local = x @ self.A[mode].T  # tokens × Σ r_m (BD-LoRA) or Σ r_m/N (S-LoRA)
            if mode == "slora":
                full = _all_gather_last(local, mesh)  # tokens × N·Σ r_m/N, laid out rank by rank
                world = full.shape[-1] // sum(widths)
                parts = [part.flatten(-2) for part in full.unflatten(-1, (world, sum(widths))).split(widths, dim=-1)]
            else:
                parts = local.split(widths, dim=-1)
            self.cache = {id(m): part for m, part in zip(self.members, parts)}
            self.key = key
        return self.cache.pop(id(member))
