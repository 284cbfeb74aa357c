"""The training processes that share one rollout server (rl/rollouts.py), as the rollouts need to see them: which
process talks to the server for the run (the main one syncs each adapter version once), which processes sample the
same completions (the ranks of one TP group train on the same batch: one of them asks, the rest receive), and the
three agreements the rollouts need (a failure anywhere stops every rank at the same step; the largest log-prob gap
over ranks; a value the main process chose). One process: every method is a no-op and the rollouts run as before.

Plain `torch.distributed` over the process groups the launcher and the trainer already made (accelerate's default
group; a TP run's TP group): integers and floats in tensors, token ids in one flat tensor with their lengths,
never a pickled object.
"""

from __future__ import annotations

import torch


class Ranks:
    """`tp_group`: the process group of this rank's TP peers (they hold the same batch), or None without TP."""

    def __init__(self, tp_group=None):
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None
        self.rank = self.dist.get_rank() if self.dist else 0
        self.world = self.dist.get_world_size() if self.dist else 1
        self.tp_group = tp_group
        tp = dist.get_world_size(tp_group) if self.dist and tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if self.dist and tp_group is not None else 0
        self.samplers = self.world // tp  # the ranks that sample completions of their own (one per TP group)
        self.sampler = self.rank // tp  # this rank's among them (transformers' meshes keep tp the innermost dim)
        # NCCL moves only GPU tensors; gloo (CPU) only CPU ones
        nccl = self.dist is not None and self.dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def asks(self) -> bool:
        """Whether this rank sends its prompts to the server (its TP peers receive its completions)."""
        return self.tp_rank == 0

    def any(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank (collective; every rank waits here: the barrier after a sync)."""
        if self.dist is None:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        self.dist.all_reduce(value, op=self.dist.ReduceOp.MAX)
        return bool(value.item())

    def max(self, value: float) -> float:
        """The largest `value` over the ranks (collective); NaN anywhere is NaN."""
        if self.dist is None:
            return value
        nan = value != value
        both = torch.tensor([float("-inf") if nan else value, 1.0 if nan else 0.0], dtype=torch.float64,
                            device=self.device)
        self.dist.all_reduce(both, op=self.dist.ReduceOp.MAX)
        return float("nan") if both[1].item() else both[0].item()

    def main_value(self, value: int) -> int:
        """The main process's `value` on every rank (collective)."""
        if self.dist is None:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.dist.broadcast(tensor, src=0)
        return int(tensor.item())

    def share_samples(self, token_ids: list[list[int]] | None, logprobs: list[list[float]] | None):
        """The TP group's asking rank's completions (token ids and the server's log-probs) on every rank of the
        group (collective over the TP group; the other ranks pass None). Without TP, returned as given."""
        if self.dist is None or self.tp_group is None:
            return token_ids, logprobs
        src = self.dist.get_global_rank(self.tp_group, 0)
        on = {"device": self.device}
        count = torch.tensor([len(token_ids) if self.asks else 0], dtype=torch.int64, **on)
        self.dist.broadcast(count, src=src, group=self.tp_group)
        lengths = torch.tensor([len(t) for t in token_ids] if self.asks else [0] * int(count.item()),
                               dtype=torch.int64, **on)
        self.dist.broadcast(lengths, src=src, group=self.tp_group)
        total = int(lengths.sum().item())
        ids = torch.tensor([t for seq in token_ids for t in seq] if self.asks else [0] * total, dtype=torch.int64,
                           **on)
        lps = torch.tensor([x for seq in logprobs for x in seq] if self.asks else [0.0] * total,
                           dtype=torch.float64, **on)
        self.dist.broadcast(ids, src=src, group=self.tp_group)
        self.dist.broadcast(lps, src=src, group=self.tp_group)
        bounds = [0, *torch.cumsum(lengths, 0).tolist()]
        return ([ids[a:b].tolist() for a, b in zip(bounds, bounds[1:])],
                [lps[a:b].tolist() for a, b in zip(bounds, bounds[1:])])
