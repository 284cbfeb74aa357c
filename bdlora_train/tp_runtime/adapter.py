"""`ShardedAdapter`: a run's rank-local adapter as one object, what `shard_adapters` returns: every adapted layer's
shard (its mesh with it), the dense-stored factors held as rank-local pieces (by parameter name), and the experts'
delta hooks (`ExpertDeltas`, whose `remove` takes them off). The Trainer's TP state (save, resume, optimizer state)
goes through it; nothing finds the pieces by scanning the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from bdlora_train.core.errors import TPError
from bdlora_train.tp_runtime import mesh, state
from bdlora_train.tp_runtime.experts import ExpertDeltas
from bdlora_train.tp_runtime.pieces import Piece
from bdlora_train.tp_runtime.styles import EXPERT_PARALLEL, AdapterShard


@dataclass
class ShardedAdapter:
    model: nn.Module
    shards: dict[str, AdapterShard]  # {PEFT layer name: how its adapter is sharded}
    pieces: dict[str, Piece]  # {parameter name: the rank-local piece it holds}
    expert_parallel: frozenset[str]  # parameter names of the factors of experts split by expert parallelism
    deltas: list[ExpertDeltas]  # one per adapted experts module (their forward hooks)

    @classmethod
    def of(cls, model: nn.Module, shards: dict[str, AdapterShard]) -> ShardedAdapter:
        """The adapter `shards` made rank-local in `model`: each shard's pieces found by parameter name."""
        params = dict(model.named_parameters())
        pieces, expert_parallel, deltas = {}, set(), []
        for name, shard in shards.items():
            layer = model.get_submodule(name)
            (adapter,) = layer.lora_A  # shard_adapters refuses a layer with several
            for label, piece in zip("AB", shard.pieces):
                key = f"{name}.lora_{label}.{adapter}.weight"
                if key not in params:
                    raise TPError(f"tp: {name}: no parameter {key} (PEFT's layout changed?)")
                if piece is not None:
                    pieces[key] = piece
                if shard.style == EXPERT_PARALLEL:
                    expert_parallel.add(key)
            owner = getattr(layer.get_base_layer(), "bdlora_deltas", None)
            if isinstance(owner, ExpertDeltas) and all(owner is not d for d in deltas):
                deltas.append(owner)
        return cls(model, shards, pieces, frozenset(expert_parallel), deltas)

    def numel(self, name: str, param: torch.Tensor) -> int:
        """Entries of a parameter as PEFT saves it: a rank-local piece counts as its whole tensor."""
        piece = self.pieces.get(name)
        return piece.shape[0] * piece.shape[1] if piece is not None else param.numel()

    def gathered_state(self) -> dict[str, torch.Tensor]:
        """The adapter in PEFT's layout, every tensor whole (collective: every rank calls it)."""
        return state.gather_adapter_state(self.model, self.pieces)

    def load_checkpoint(self, checkpoint) -> None:
        """Resume: a checkpoint's adapter back into the rank-local parameters (each rank slices its own)."""
        state.load_checkpoint_adapter(self.model, self.pieces, checkpoint)

    def average_over_data_parallel(self, group) -> None:
        """The data-parallel gradient average of the adapter (tp_runtime/mesh.py), its expert-parallel factors apart."""
        trained = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad and p.grad is not None]
        mesh.average_over_data_parallel(
            [p for n, p in trained if n not in self.expert_parallel],
            [p for n, p in trained if n in self.expert_parallel],
            group,
        )

    def save_optimizer(self, optimizer, output_dir, write: bool) -> None:
        state.save_optimizer(self.model, self.pieces, optimizer, output_dir, write)

    def load_optimizer(self, optimizer, checkpoint) -> None:
        state.load_optimizer(self.model, self.pieces, optimizer, checkpoint)
