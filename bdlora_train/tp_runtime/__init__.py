"""The tensor-parallel training runtime every `tp_size > 1` (or `ep_size > 1`) run uses. The proofs and benchmarks of
TP (collective counters, harnesses, the traffic model) live apart, in tp_diagnostics/.

Modules, top down: dispatch.py (`shard_adapters`: one dispatch per kind of layer), adapter.py (`ShardedAdapter`, what
it returns: the run's rank-local adapter, its pieces and hooks, through which the Trainer saves and resumes),
experts.py and state.py, layers.py
(the TP layer classes), node.py (the sharded one-node autograd function), preflight.py (checks before any weight
loads) and mesh.py, styles.py (the TP styles and `AdapterShard`), pieces.py (rank-local pieces of dense-stored
factors).

Training under tensor parallelism: every rank holds and trains only its own adapter blocks.

The base model comes from transformers, loaded with `DistributedConfig(tp_size=N)`: its Linear weights are DTensors
sharded along the model's TP plan, and transformers' forward hooks move activations between ranks. `shard_adapters`
(dispatch.py) makes every adapted Linear's LoRA factors DTensors on the same TP mesh and gives the layer a TP class
(layers.py) whose forward computes the base *and* the adapter from local shards, inside the base layer's own
communication:

  column-parallel (colwise)   y_i = x W_i^T + b_i + s (x A_i^T) B_ii^T    x replicated, y_i this rank's output shard
  row-parallel (rowwise)      y   = all_reduce(x_i W_i^T + s (x_i A_ii^T) B_i^T) + b

so BD-LoRA adds no collective: forward, the row-parallel partial sums ride on the base all-reduce; backward, every
factor's gradient is local, and the adapter's input gradient on a column-parallel layer joins the base layer's own
input-gradient all-reduce (one reduction, not two: `to_local(grad_placements=[Partial()])`).

Placements of PEFT's saved tensors (the block-diagonal factor packed along dim 0, so its blocks are rows):

  method   layer    lora_A                     lora_B                     extra collectives per layer
  bdlora   column   (r, d_in) Shard(0): A_i    (d_out, r/N) Shard(0): B_ii  none
  bdlora   row      (r, d_in/N) Shard(0): A_ii (d_out, r) Shard(1): B_i     none
  lora     column   (r, d_in) Replicate        (d_out, r) Shard(0)          backward: all-reduce of A's gradient
  lora     row      (r, d_in) Shard(1)         (d_out, r) Replicate         forward: all-reduce of x A^T before B

Plain LoRA uses the layout PEFT's own TP hooks choose (`add_lora_tp_hooks_dtensor`: colwise base -> lora_B sharded,
lora_A replicated; rowwise base -> lora_A sharded, lora_B replicated), whose two reductions are what BD-LoRA avoids.
The adapter is built at its full shapes without PEFT's own TP hooks (`global_adapter_shapes`): PEFT builds LoRA
layers of the local shard's shape on a TP-loaded model (block-diagonal blocks would then not be the served ones), its
hooks shard plain LoRA only, and PEFT 0.21's TP forward fails on the first step (the adapter's full-width output meets
the base layer's local shard).
The adapter is saved gathered (`ShardedAdapter.gathered_state`, state.py: one all-gather per factor, at save time
only) in PEFT's native format, and loaded back by slicing locally (`ShardedAdapter.load_checkpoint`).

Factors PEFT stores densely (a segment-aware fused projection's B; every factor of an adapter that adapts MoE expert
parameters) are held as rank-local pieces instead (pieces.py: no DTensor placement describes a block diagonal):
a fused projection's rank computes the i-th 1/N of every segment and its output is put back in order after the
base's own all-gather (`_shard_dense_linear`); an expert parameter's rank adds its slice of every expert's delta to
its own shard before transformers' `moe_tp_experts` runs the experts (`_shard_expert_layer`). A Linear the model's
plan leaves whole trains replicated (`_replicate_layer`). None adds a collective for BD-LoRA.
"""
