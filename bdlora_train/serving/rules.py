"""What keeps a BD-LoRA adapter from being served in vLLM, said once: `bdlora check-serving` reports each refusal as a
failed check before any server starts, and the vLLM plugin raises the same text when the engine loads the adapter
(tests/vllm/test_plugin_unit.py holds the two equal). Each function returns the refusal, or None when the rule holds.

No torch, no vLLM: the plugin imports this inside vLLM's processes.
"""

from __future__ import annotations

from bdlora_train.core.degrees import divides
from bdlora_train.serving.engines import vllm_max_lora_rank


def dense_export(adapter_dir) -> str:
    """The command that writes the exact plain-LoRA export of an adapter beside it (every engine serves that);
    `adapter_dir` as the reader will find it (check-serving and the plugin: the resolved directory; a model card: the
    directory its own download command writes)."""
    return f"bdlora export {adapter_dir} --to dense-lora --out {adapter_dir}-dense"


def serve_dense(adapter_dir) -> str:
    """The plugin's refusals' last fix: the adapter's exact plain-LoRA export, by a command that runs as printed."""
    return f"serve its exact dense-LoRA export (every rank then computes the full rank): {dense_export(adapter_dir)}"


def experts_refusal(experts: list[str]) -> str | None:
    """Block-diagonal expert factors: vLLM computes expert LoRAs only in its fused-MoE Triton kernels."""
    if not experts:
        return None
    return (
        f"{len(experts)} expert factors (e.g. {experts[0]}) are block-diagonal; vLLM's LoRA on fused-MoE layers "
        "(FusedMoEWithLoRA) runs only on its Triton (CUDA) kernels, which the BD-LoRA plugin does not shard "
        "rank-locally, and vLLM's CPU build has none; fix: train with experts=False (attention and dense-MLP adapters "
        "of MoE models serve rank-locally)"
    )


def nblocks_refusal(tp: int, nblocks: int, servable: list[int], dense_fix: str) -> str | None:
    """A TP degree that does not divide nblocks: a rank's shard would cut blocks. `servable`: the degrees that work
    (core/degrees.py `servable_degrees`, with the base's head counts where the caller knows them); `dense_fix`: the
    adapter's `dense_export` command."""
    if divides(tp, nblocks):
        return None
    return (
        f"nblocks {nblocks} is not divisible by --tensor-parallel-size {tp}: blocks would straddle the TP shards; "
        f"fix: serve at a tensor-parallel size in {servable}, or as plain LoRA: {dense_fix}"
    )


def split_rank(r: int, tp: int) -> str:
    """Why a rank holds what it holds under the plugin: r/TP of every block-diagonal module."""
    return f"r={r} / TP {tp} of the BD-LoRA adapter"


def max_rank_refusal(held: int, limit: int, why: str) -> str | None:
    """Each rank would hold a rank-`held` LoRA (`why`: whose rank, and why that much) wider than vLLM's buffers."""
    if held <= limit:
        return None
    return (
        f"each rank holds rank {held} ({why}), above --max-lora-rank {limit}; "
        f"fix: --max-lora-rank {vllm_max_lora_rank(held)}"
    )
