"""A float64 model that computes in float64 throughout: the exact-arithmetic twin of a float32 run.

`torch_dtype: float64` exists to prove the TP runtime exact (docs/tp.md, "Exactness"): a TP run and the one-process
run sum the same products in another order, so in float64 they agree to ~1e-15. transformers' modeling code casts
to float32 in places whatever the model's dtype: RMSNorm (`hidden_states.to(torch.float32)`), MoE routers
(`softmax(router_logits.float())`, `softmax(..., dtype=torch.float)`), DeepSeek-V3's router GEMM
(`F.linear(x.type(torch.float32), ...)`). There a float64 difference of 1e-16 now and then flips one float32
rounding, and the two runs then differ at float32 level (measured here: 3.6e-7 on a tiny Mixtral, 7e-8 on a tiny
DeepSeek-V3 under EP, after 6 steps), on whichever machine the flip happens to occur. `float64_compute` keeps those
casts at float64 while training, so the twin is float64 everywhere.

Written by hand because no library does this: torch's `TorchFunctionMode` is the hook (every torch call passes
through it, transformers' included); the rule is one line: a float32 dtype requested of a float64 computation is
float64.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


def prepare_float64(model) -> None:
    """A float64 model runs its MoE experts in transformers' eager loop: torch's grouped GEMM (transformers' default
    for experts) has no float64 kernel."""
    model.set_experts_implementation("eager")


class _KeepFloat64(TorchFunctionMode):
    """A float32 cast (`.float()`, `.to(torch.float32)`, `.type(torch.float32)`) gives float64, and so does an op's
    `dtype=torch.float32` on tensor inputs (`softmax(x, dtype=torch.float)`). Tensors created from nothing keep the
    dtype asked for (FSDP2 sizes its communication buffers by theirs)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            return func(*args, **kwargs).double()
        if func in (torch.Tensor.to, torch.Tensor.type):
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if kwargs.get("dtype") is torch.float32 and any(isinstance(a, torch.Tensor) for a in args):
            kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


@contextlib.contextmanager
def float64_compute(enabled: bool):
    """Within the block, transformers' float32 casts stay float64 (the module docstring); a no-op unless `enabled`."""
    if not enabled:
        yield
        return
    with _KeepFloat64():
        yield


def recompute_contexts():
    """`torch.utils.checkpoint`'s `context_fn` for a float64 run with gradient checkpointing: the autograd engine
    recomputes a checkpointed forward without the torch-function modes that were active at the forward, so the
    recomputation enters `_KeepFloat64` itself (else it computes other dtypes and checkpoint refuses it)."""
    return contextlib.nullcontext(), _KeepFloat64()
