"""Tensor-parallel BD-LoRA on PyTorch's own TP API: shard a model, count collectives, compare with S-LoRA.

  layers.py   `TPLoraLinear`: a Linear sharded by ColwiseParallel / RowwiseParallel plus this rank's LoRA shard
  plan.py     which Linear is column- or row-parallel, every check sharding at a TP degree needs, `shard_model`
  ranks.py     spawn N ranks (gloo on CPU, NCCL on GPUs) running a job function; count collectives
  harness.py   `tp_check` / `bench_tp`: the sharded forward, exact vs unsharded, collectives and latency
  training.py  training under TP: each rank holds and trains only its adapter blocks (train/ uses it)
  train_check.py  `tp_check(train=True)` / `bench_tp(train=True)`: one training step, counted and timed

BD-LoRA, column-parallel: rank i holds A_i (r/N x d_in) and B_ii; x A_i B_ii is its output shard. Row-parallel:
rank i holds A_ii and B_i (d_out x r/N); x_i A_ii B_i is a partial sum the base all-reduce adds up. No collective
of its own (Wang et al., arXiv 2510.23346, section 3). S-LoRA (the baseline) needs one all-gather per group of
column-parallel siblings and one all-reduce per row-parallel layer.
"""

from bdlora_train.core.errors import TPError
from bdlora_train.tp.harness import TOLERANCE, bench_tp, random_adapter, tp_check
from bdlora_train.tp.layers import MODES, TPLoraLinear
from bdlora_train.tp.plan import set_mode, shard_model, tp_styles
from bdlora_train.tp.ranks import comm_counter, rel_err

__all__ = [
    "MODES",
    "TOLERANCE",
    "TPError",
    "TPLoraLinear",
    "bench_tp",
    "comm_counter",
    "random_adapter",
    "rel_err",
    "set_mode",
    "shard_model",
    "tp_check",
    "tp_styles",
]
