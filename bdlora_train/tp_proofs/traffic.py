"""Collectives one TP training step adds over the frozen base, worked out from a model's config (no weights).

Per adapted projection and training step (forward + backward), at TP N:

  BD-LoRA   nothing: every factor's gradient is local, the row-parallel partial sums ride on the base all-reduce, the
            column-parallel input gradients on the base layer's input-gradient all-reduce (tp/training.py)
  LoRA      column-parallel (q, k, v, gate, up): one all-reduce of lora_A's gradient, r x d_in (PEFT's layout keeps
            lora_A replicated, and each rank's gradient holds only its output shard's share)
            row-parallel (o, down): one all-reduce of x A^T, tokens x r, in the forward (lora_A sharded with the input)

For comparison, the base's own: one all-reduce of tokens x d_out per row-parallel projection (forward) and of
tokens x d_in per column-parallel projection (backward, its input gradient). Sizes are the buffers handed to the
collective (a ring all-reduce moves about 2 (N-1)/N of that per rank); `tp_check(train=True)` counts the same on
real ranks.
"""

from __future__ import annotations

from bdlora_train.core.layout import COLUMN


def training_step_traffic(model, targets: dict, tokens: int, activation_bytes: int = 2, grad_bytes: int = 4) -> dict:
    """{method: {"collectives", "bytes"}} per training step for "base" (its own, adapted projections only), "lora"
    and "bdlora" (extra over the base). `targets`: the adapter's resolved targets (arch/targets.py) with their ranks;
    `tokens`: tokens per step on one TP group; activation / gradient element sizes in bytes (bf16 activations, fp32
    adapter gradients by default)."""
    base = dict(collectives=0, bytes=0)
    lora = dict(collectives=0, bytes=0)
    for target in targets.values():
        lay = target.layout
        if lay.parallel == COLUMN:
            base["bytes"] += tokens * lay.d_in * activation_bytes  # the input gradient (backward)
            lora["bytes"] += target.r * lay.d_in * grad_bytes  # lora_A's gradient
        else:
            base["bytes"] += tokens * lay.d_out * activation_bytes  # the output partial sums (forward)
            lora["bytes"] += tokens * target.r * activation_bytes  # x A^T
        base["collectives"] += 1
        lora["collectives"] += 1
    return {"base": base, "lora": lora, "bdlora": dict(collectives=0, bytes=0)}
