"""`python -m tests.tp_fault FAULT RECIPE KEY=VALUE...`: `python -m bdlora_train.train` with one sharding bug planted in
the TP runtime, for the test that shows the float64 comparison catches it (tests/tp_runtime/test_tp_training.py). Run
under
torchrun like the train module itself.

FAULT:
- `slice`: one block's slice off by one row: rank i of the first layer's q_proj takes lora_A's rows
  [i*r/N - 1, (i+1)*r/N - 1) (wrapping) instead of [i*r/N, (i+1)*r/N).
- `reduction`: plain LoRA's column-parallel lora_A gradient is left a partial sum (the all-reduce skipped).
"""

import sys

from bdlora_train.tp_runtime import dispatch
from bdlora_train.train.entry import main

FAULT = sys.argv.pop(1)
_distribute_factor = dispatch._distribute_factor


def _off_by_one(name, module, mesh, placement):
    if name.endswith("layers.0.self_attn.q_proj") and module.out_features < module.in_features:  # lora_A: (r, d_in)
        module.weight.data = module.weight.data.roll(1, dims=0)
    _distribute_factor(name, module, mesh, placement)


if FAULT == "slice":
    dispatch._distribute_factor = _off_by_one
elif FAULT == "reduction":
    dispatch._reduce_grad_after_backward = lambda param: None
else:
    raise SystemExit(f"tp_fault: unknown fault {FAULT!r}; use slice or reduction")

if __name__ == "__main__":
    sys.exit(main())
