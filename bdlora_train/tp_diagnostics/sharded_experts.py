"""TP-sharded MoE experts (transformers' `moe_tp_experts`) with their BD-LoRA and S-LoRA shards.

Every rank holds the i-th 1/N of every expert along the plan's split dimension (gate_up: the i-th half of gate
and of up, `packed_colwise`; down: the i-th slice of its input, `rowwise`), runs the experts module on its local
parameters, and the partial outputs are all-reduced once per MoE layer, as transformers' MoeExpertsParallel does.
BD-LoRA: rank i adds its slice of every expert's delta from its own blocks only (B_e[rows_i, k_i] A_e[k_i, :] or
B_e[:, k_i] A_e[k_i, cols_i]), so the experts' all-reduce is the only collective. S-LoRA's activation-side sharding
has no counterpart inside the experts' token loop, so in S-LoRA mode the expert deltas come from the replicated
dense factors and add no collective: the S-LoRA column counts the Linear layers' collectives only.
An expert-parallel adapter (nblocks 1: whole experts per rank) leaves the experts replicated and unsharded.
"""

from __future__ import annotations

import torch
from torch import nn

from bdlora_train.core.blocks import rank_slice, shard_rows
from bdlora_train.core.layout import Layout, expert_axis, is_transposed, to_param_layout


class ExpertShard:
    """One experts module's local parameters in each mode (base / bdlora / slora)."""

    def __init__(self, module: nn.Module, weights: dict[str, dict[str, torch.Tensor]]):
        self.module = module
        self.weights = weights  # param name -> mode -> tensor
        self.mode = "base"

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        for pname, by_mode in self.weights.items():
            self.module._parameters[pname] = nn.Parameter(by_mode[mode], requires_grad=False)


def _local_weights(param, layout: Layout, factors, transposed: bool, rank: int, world: int, sharded: bool):
    dim = expert_axis(layout.factor, transposed)
    idx = shard_rows(layout.segments, world, rank).to(param.device) if sharded else None
    base = param.detach().index_select(dim, idx) if sharded else param.detach().clone()
    out = {"base": base, "bdlora": base, "slora": base}
    if factors is None:
        return out
    a, b = (t.to(param) for t in factors.expert_factors())  # (E, r, d_in), (E, d_out, r)
    scaling = factors.scaling
    dense = to_param_layout(scaling * torch.bmm(b, a), transposed)
    out["slora"] = base + (dense.index_select(dim, idx) if sharded else dense)
    if not sharded:
        out["bdlora"] = out["slora"]
        return out
    rs = rank_slice(factors.r, rank, world)
    if layout.factor == "B":  # B spans the split: rows idx of B, rank block of A
        local = scaling * torch.bmm(b[:, idx, rs], a[:, rs, :])
    else:  # A spans the split
        local = scaling * torch.bmm(b[:, :, rs], a[:, rs, idx])
    out["bdlora"] = base + to_param_layout(local, transposed)
    return out


def shard_experts(model, mesh, layouts: dict[str, Layout], factors: dict) -> list[ExpertShard]:
    """Shard every experts module of `layouts` over `mesh` in place; returns their ExpertShards (mode switches)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    world, rank = mesh.size(), mesh.get_local_rank()
    owners: dict[str, list[str]] = {}
    for name in layouts:
        owners.setdefault(name.rpartition(".")[0], []).append(name)
    shards = []
    for owner_name, names in owners.items():
        module = model.get_submodule(owner_name)
        transposed = is_transposed(module)
        expert_parallel = any(factors.get(n) is not None and factors[n].bd_nblocks == 1 for n in names)
        sharded = not expert_parallel
        weights = {}
        for name in names:
            pname = name.rpartition(".")[2]
            weights[pname] = _local_weights(
                getattr(module, pname), layouts[name], factors.get(name), transposed, rank, world, sharded
            )
        shard = ExpertShard(module, weights)
        shard.set_mode("base")
        if sharded:

            def all_reduce(_module, _args, output, mesh=mesh):
                # each rank ran its slice of every expert: sum the partial outputs (transformers' MoeExpertsParallel)
                return (
                    DTensor.from_local(output, mesh, [Partial()], run_check=False)
                    .redistribute(mesh, [Replicate()])
                    .to_local()
                )

            module.register_forward_hook(all_reduce)
        shards.append(shard)
    return shards
