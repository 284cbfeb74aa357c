"""MoE expert parameters under TP / EP: each rank stages its slice of every expert's delta, and its experts module
adds it to the parameter while the experts run (hooks owned by `ExpertDeltas`)."""

from __future__ import annotations

import torch
from torch import nn

from bdlora_train.core.errors import TPError
from bdlora_train.kernels.experts import expert_delta
from bdlora_train.tp_runtime.layers import TPLoraLayer, become, local_factors, trained_adapters
from bdlora_train.tp_runtime.mesh import local_part
from bdlora_train.tp_runtime.styles import AdapterShard


class ExpertDeltas:
    """What an adapted experts module adds to its parameters while it runs, and the two hooks that do it (handles
    kept: `remove` takes them off). Each expert parameter's wrapper (`ExpertLora`) stages its rank's delta; the
    forward pre-hook, registered after transformers' and FSDP's own, makes each staged parameter its local tensor
    plus the delta (`moe_tp_experts` and `ep_dispatch_experts` leave a non-DTensor parameter as it is); the forward
    hook puts the parameters back (unless FSDP's own hook already put its sharded parameter back)."""

    def __init__(self, experts: nn.Module):
        self.staged: dict[str, torch.Tensor] = {}
        self.swapped: dict[str, tuple] = {}
        self.handles = (
            experts.register_forward_pre_hook(self._add),
            experts.register_forward_hook(self._restore, always_call=True),
        )

    def _add(self, experts: nn.Module, args) -> None:
        for name, delta in self.staged.items():
            current = experts._parameters[name]
            weight = local_part(current)
            if delta.shape != weight.shape:
                raise TPError(
                    f"tp: {name}: this rank's delta {tuple(delta.shape)} does not fit its {tuple(weight.shape)}"
                )
            summed = weight + delta.to(weight.dtype)
            self.swapped[name] = (current, summed)
            experts._parameters[name] = summed

    def _restore(self, experts: nn.Module, args, output) -> None:
        for name, (current, summed) in self.swapped.items():
            if experts._parameters[name] is summed:
                experts._parameters[name] = current
        self.swapped.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def expert_shard(layer, shard: AdapterShard) -> AdapterShard:
    """Give an expert parameter's wrapper its rank-local TP class; its experts module gets one `ExpertDeltas`."""
    experts = layer.get_base_layer()
    if not isinstance(getattr(experts, "bdlora_deltas", None), ExpertDeltas):
        experts.bdlora_deltas = ExpertDeltas(experts)
    return become(layer, ExpertLora, shard)


def _expert_delta(layer, adapter: str, experts: int) -> torch.Tensor:
    """This rank's delta of the `experts` experts it computes, in the parameter's own layout (PEFT's
    `get_delta_factors` on the local pieces: A (E*r_i, d_in_i) expert-major rows, B (d_out_i, r_i*E) rank-major
    columns)."""
    transposed = not layer._did_swap_in_out_features  # PEFT's flag: (E, out, in) parameters are swapped
    return expert_delta(*local_factors(layer, adapter), experts, layer.scaling[adapter], transposed)


class ExpertLora(TPLoraLayer):
    """An expert parameter's PEFT wrapper under TP / EP: its forward stages this rank's delta for the experts module,
    which adds it to the parameter while the experts run."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Stage this rank's delta for its experts module, which adds it to the parameter as the experts run
        (`ExpertDeltas`), after whatever transformers' own hooks put there (the local shard, FSDP's unsharded
        experts)."""
        active = trained_adapters(self)
        if not active:
            return self.base_layer(x, *args, **kwargs)
        experts = self.get_base_layer()
        count = local_part(experts._parameters[self.parameter_name]).shape[0]
        deltas = experts.bdlora_deltas
        deltas.staged[self.parameter_name] = sum(_expert_delta(self, adapter, count) for adapter in active)
        try:
            return self.base_layer(x, *args, **kwargs)
        finally:
            deltas.staged.pop(self.parameter_name, None)
