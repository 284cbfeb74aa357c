"""Collectives one TP training step adds over the frozen base, worked out from a model's config (no weights).

Per adapted projection and training step (forward + backward), at TP N:

  BD-LoRA   nothing: every factor's gradient is local, the row-parallel partial sums ride on the base all-reduce, the
            column-parallel input gradients on the base layer's input-gradient all-reduce (tp_runtime/layers.py); the
            same on expert parameters, whose partial sums and input gradients ride on the experts module's own
  LoRA      column-parallel (q, k, v, gate, up): one all-reduce of lora_A's gradient, r x d_in (PEFT's layout keeps
            lora_A replicated, and each rank's gradient holds only its output shard's share)
            row-parallel (o, down): one all-reduce of x A^T, tokens x r, in the forward (lora_A sharded with the input)
            expert parameters (transformers' `moe_tp_experts`, in its plans through 5.24 and Llama-4's after: every
            rank holds its shard of every expert; PEFT's ParamWrapper folds s B_e A_e into the weight, A (r E, d_in),
            B (d_out, r E)):
              column-parallel (`gate_up_proj`, B's side split): lora_A replicated, its gradient r E x d_in all-reduced
              row-parallel (`down_proj`, A's side split): lora_B replicated, its gradient d_out x r E all-reduced
            both in the backward, at the gradient's element size; no x A^T (the delta is folded into the weight)

For comparison, the base's own: one all-reduce of tokens x d_out per row-parallel projection (forward) and of
tokens x d_in per column-parallel projection (backward, its input gradient). An experts module is the same pair: its
partial output, tokens x hidden, all-reduced in the forward (counted on `down_proj`, row-parallel) and its input
gradient, tokens x hidden, in the backward (counted on `gate_up_proj`, column-parallel). Both are on every token of
the step, not the routed ones: transformers' `MoeExpertsParallel` hands the full hidden states to the collective
(each rank runs its shard of every expert on the tokens routed to it, and the sum is over ranks). Left out, like the
router it comes from (not an adapted projection): the all-reduce of the routing weights' gradient, tokens x top_k per
MoE layer (fp32 in Mixtral, the activation dtype in Qwen3-MoE), one more base collective per MoE layer.

Sizes are the buffers handed to the collective (a ring all-reduce moves about 2 (N-1)/N of that per rank);
`tp_check(train=True)` counts the same on real ranks (tests/tp_runtime/test_tp_training.py checks LoRA's extras on the
tiny Llama and the tiny Mixtral, experts included).
"""

from __future__ import annotations

from bdlora_train.core.layout import COLUMN
from bdlora_train.tp_runtime.styles import REPLICATED


def training_step_traffic(
    targets: dict, styles: dict, tokens: int, activation_bytes: int = 2, grad_bytes: int = 4
) -> dict:
    """{method: {"collectives", "bytes"}} per training step for "base" (its own, adapted projections and expert
    parameters only), "lora" and "bdlora" (extra over the base). `targets`: the adapter's resolved targets
    (arch/targets.py) with their ranks; `styles`: what `check_tp_training` made of them (a REPLICATED target, one
    transformers' plan leaves whole on every rank, moves nothing: Qwen2-MoE's shared expert); `tokens`: tokens per
    step on one TP group; activation / gradient element sizes in bytes (bf16 activations, fp32 adapter gradients by
    default). The targets' layouts carry every size."""
    base = dict(collectives=0, bytes=0)
    lora = dict(collectives=0, bytes=0)
    for name, target in targets.items():
        if styles[name] == REPLICATED:
            continue
        lay = target.layout
        if lay.parallel == COLUMN:
            base["bytes"] += tokens * lay.d_in * activation_bytes  # the input gradient (backward)
        else:
            base["bytes"] += tokens * lay.d_out * activation_bytes  # the output partial sums (forward)
        if lay.experts and lay.parallel == COLUMN:
            lora["bytes"] += target.r * lay.experts * lay.d_in * grad_bytes  # lora_A's gradient, (r E, d_in)
        elif lay.experts:
            lora["bytes"] += lay.d_out * target.r * lay.experts * grad_bytes  # lora_B's gradient, (d_out, r E)
        elif lay.parallel == COLUMN:
            lora["bytes"] += target.r * lay.d_in * grad_bytes  # lora_A's gradient
        else:
            lora["bytes"] += tokens * target.r * activation_bytes  # x A^T
        base["collectives"] += 1
        lora["collectives"] += 1
    return {"base": base, "lora": lora, "bdlora": dict(collectives=0, bytes=0)}
