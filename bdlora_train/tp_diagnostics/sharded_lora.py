"""`SLoraLinear`: S-LoRA sharding of a LoRA layer, the baseline `tp-check` and `bench-tp` compare BD-LoRA with.

A Linear that PyTorch's ColwiseParallel / RowwiseParallel shard as usual, plus this rank's S-LoRA shard of the dense
LoRA, added to the local output *inside* the layer (before RowwiseParallel's output hook issues the base all-reduce),
so `CommDebugMode` sees exactly the collectives S-LoRA needs: column-parallel, A sharded along the rank and one
all-gather of the (tokens x r) A output per group of sibling layers (q|k|v, gate|up); row-parallel, A sharded along
d_in, one all-reduce after A, B sharded along d_out (zero-padded into the base partial sum).

BD-LoRA is not computed here: tp-check runs the training runtime's own layers for it (shard_model.py
`runtime_model`), so what the check proves is what `bdlora train` runs.
"""

from __future__ import annotations

import torch
from torch import nn

from bdlora_train.adapters.reader import ModuleFactors
from bdlora_train.core.blocks import rank_factors, rank_slice
from bdlora_train.core.layout import COLUMN, Side

FORWARD_SCHEMES = ("base", "bdlora", "slora")


class SLoraLinear(nn.Linear):
    """A Linear that ColwiseParallel / RowwiseParallel shard as usual, plus this rank's S-LoRA shard (mode "slora";
    mode "base": the sharded Linear alone).

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
        """Cut this rank's S-LoRA shards out of the dense factors (A: r × d_in, B: d_out × r).

        `order`: the row permutation of a segment-aware fused layer (its base weight is permuted the same way), so
        that rank i's contiguous rows are the i-th 1/N of every segment.
        """
        A = factors.dense_A().to(self.weight)
        B = factors.dense_B().to(self.weight) * factors.scaling  # scaling folded in: one pass less
        if order is not None:
            B = B[order]
        ins, outs = (rank_slice(n, rank, world) for n in (self.in_features, self.out_features))
        # plain attributes, not buffers: distribute_module would turn buffers into replicated DTensors
        self.sl_A = rank_factors(A, B, rank, world)[0].contiguous() if self.side == COLUMN else A[:, ins].contiguous()
        self.sl_B = B[outs].contiguous()  # d_out/N × r
        self.out_slice = outs

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Partial, Replicate

        y = super().forward(x)  # DTensor: Shard(-1) (colwise) or Partial (rowwise)
        if self.mode == "base" or not hasattr(self, "sl_A"):
            return y
        x = x.to_local() if isinstance(x, DTensor) else x
        if self.side == COLUMN:  # A_i's output of every sibling, all-gathered once per group
            out = _addmm(y.to_local(), self.group.project(self, x, y.device_mesh), self.sl_B)
        else:
            xa = DTensor.from_local(x @ self.sl_A.T, y.device_mesh, [Partial()], run_check=False)
            xa = xa.redistribute(y.device_mesh, [Replicate()]).to_local()  # the S-LoRA all-reduce after A
            # B is sharded along d_out: this rank's slice goes into the base partial sum, which the base all-reduce
            # completes (S-LoRA fuses its final gather into that all-reduce).
            out = y.to_local().clone()
            rows = out.view(-1, self.out_features)[:, self.out_slice]
            rows.addmm_(xa.reshape(-1, xa.shape[-1]), self.sl_B.T)
        return DTensor.from_local(out, y.device_mesh, y.placements, run_check=False)


def _addmm(y, xa, B):
    """y + xa·Bᵀ in one kernel (no separate pass for the add)."""
    return torch.addmm(y.reshape(-1, y.shape[-1]), xa.reshape(-1, xa.shape[-1]), B.T).view(y.shape)


def _all_gather_last(t, mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return (
        DTensor.from_local(t, mesh, [Shard(t.dim() - 1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()
    )


class SiblingGroup:
    """Column-parallel siblings fed the same input (q|k|v, gate|up) share one x·A product and one all-gather of it
    (the all-gather is what S-LoRA must pay). The first member called computes it for everyone; a member that sees a
    different input (or comes back twice) triggers a fresh product, so results are always right and only the counts
    depend on the model calling siblings together.
    """

    def __init__(self, members: list[SLoraLinear]):
        self.members = members
        self.A = torch.cat([m.sl_A for m in members])
        self.widths = [m.sl_A.shape[0] for m in members]
        self.cache: dict[int, torch.Tensor] = {}
        self.key = None

    def project(self, member: SLoraLinear, x, mesh):
        key = (x.data_ptr(), tuple(x.shape), tuple(x.stride()))
        if key != self.key or id(member) not in self.cache:
            local = x @ self.A.T  # tokens × Σ r_m/N
            full = _all_gather_last(local, mesh)  # tokens × N·Σ r_m/N, laid out rank by rank
            world = full.shape[-1] // sum(self.widths)
            unflat = full.unflatten(-1, (world, sum(self.widths))).split(self.widths, dim=-1)
            self.cache = {id(m): part.flatten(-2) for m, part in zip(self.members, unflat)}
            self.key = key
        return self.cache.pop(id(member))


class ReplicatedExperts:
    """An adapted experts module in the S-LoRA model, left whole on every rank: S-LoRA's activation-side sharding has
    no counterpart inside the experts' token loop, so in mode "slora" the experts run with their dense delta
    (scaling · B_e A_e per expert) added, which costs no collective; mode "base" runs them as loaded."""

    def __init__(self, module: nn.Module, factors: dict[str, ModuleFactors]):
        from bdlora_train.core.layout import is_transposed

        self.module = module
        self.weights = {}  # parameter name -> mode -> tensor
        for pname, f in factors.items():
            base = getattr(module, pname).detach()
            delta = f.expert_delta(is_transposed(module), base.dtype).to(base.device)
            self.weights[pname] = {"base": base, "slora": base + delta}

    def set_mode(self, mode: str) -> None:
        for pname, by_mode in self.weights.items():
            self.module._parameters[pname] = nn.Parameter(by_mode[mode], requires_grad=False)
