"""Proofs and benchmarks of BD-LoRA under TP (`bdlora tp-check`, `bdlora bench-tp`): shard a model on PyTorch's own TP
API, count collectives, time steps, compare with S-LoRA. Nothing a training run uses lives here (that is
tp_runtime/, whose layers these checks run for BD-LoRA).

  sharded_lora.py     `SLoraLinear`: a Linear sharded by ColwiseParallel / RowwiseParallel plus this rank's S-LoRA shard
                      (the baseline); adapted experts left whole
  shard_model.py      which Linear is column- or row-parallel, every check sharding at a TP degree needs; the S-LoRA
                      model (`shard_model`) and the BD-LoRA one, the training runtime's layers (`runtime_model`)
  ranks.py     spawn N ranks (gloo on CPU, NCCL on GPUs) running a job function; count collectives
  harness.py   `tp_check` / `bench_tp`: the sharded forward, exact vs unsharded, collectives and latency
  traffic.py   the analytic per-step traffic of a training step (bytes per collective), no weights
  train_check.py  `tp_check(train=True)` / `bench_tp(train=True)`: one training step of the tp_runtime/ runtime,
                  counted and timed
  train_step.py   that step's pieces on the ranks: the base loaded sharded, the seeded adapter, forward + backward,
                  the gathered gradients

BD-LoRA, column-parallel: rank i holds A_i (r/N x d_in) and B_ii; x A_i B_ii is its output shard. Row-parallel:
rank i holds A_ii and B_i (d_out x r/N); x_i A_ii B_i is a partial sum the base all-reduce adds up. No collective
of its own (Wang et al., arXiv 2510.23346, section 3). S-LoRA (the baseline) needs one all-gather per group of
column-parallel siblings and one all-reduce per row-parallel layer.
"""

import importlib

# Names are imported on first use (PEP 562): a rank that tp-check spawns imports tp_diagnostics/ranks.py through this
# package, and must silence library chatter before anything imports PEFT (and torchao).
_EXPORTS = {
    "FORWARD_SCHEMES": "bdlora_train.tp_diagnostics.sharded_lora",
    "TOLERANCE": "bdlora_train.tp_diagnostics.harness",
    "TPError": "bdlora_train.core.errors",
    "SLoraLinear": "bdlora_train.tp_diagnostics.sharded_lora",
    "bench_tp": "bdlora_train.tp_diagnostics.harness",
    "comm_counter": "bdlora_train.tp_diagnostics.ranks",
    "random_adapter": "bdlora_train.tp_diagnostics.harness",
    "rel_err": "bdlora_train.tp_diagnostics.ranks",
    "set_mode": "bdlora_train.tp_diagnostics.shard_model",
    "runtime_model": "bdlora_train.tp_diagnostics.shard_model",
    "shard_model": "bdlora_train.tp_diagnostics.shard_model",
    "tp_check": "bdlora_train.tp_diagnostics.harness",
    "tp_styles": "bdlora_train.tp_diagnostics.shard_model",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bdlora_train.tp_diagnostics' has no attribute {name!r}")


def __dir__():
    return __all__
