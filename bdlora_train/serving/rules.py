"""What keeps a BD-LoRA adapter from being served in vLLM, said once: `bdlora check-serving` reports each refusal as a
failed check before any server starts, and the vLLM plugin raises the same text when the engine loads the adapter
(tests/vllm/test_plugin_unit.py holds the two equal). Each function returns the refusal, or None when the rule holds;
the ones after `max_rank_refusal` are what only the plugin sees (vLLM's layers, the saved tensors), worded here too:
the plugin composes no refusal of its own. Each is one line naming the module, the value and the fix.

No torch, no vLLM: the plugin imports this inside vLLM's processes.
"""

from __future__ import annotations

from bdlora_train.core.degrees import divides, splitting_degrees
from bdlora_train.core.layout import Side, factor_of, role_of, side_of_role
from bdlora_train.core.roles import Role
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


def rank_split_refusal(where: str, r: int, tp: int, nblocks: int) -> str | None:
    """A rank TP does not divide: each GPU holds exactly r/TP of a block-diagonal module (never rounded), so the
    plugin refuses the adapter at load. `where`: the module(s) of rank r."""
    if divides(tp, r):
        return None
    return (
        f"{where}: r={r} is not a multiple of --tensor-parallel-size {tp}, so the bdlora plugin refuses the adapter "
        f"at load (each GPU holds exactly r/TP); fix: serve at --tensor-parallel-size in "
        f"{splitting_degrees(nblocks=nblocks, r=r)}"
    )


def kv_heads_refusal(where: str, tp: int, kv: int, nblocks: int, dense_fix: str) -> str | None:
    """TP above the KV heads (the base still shards: vLLM replicates each KV head on TP/kv ranks), so a rank's K/V
    shard is a replicated head, not its block. `dense_fix`: `serve_dense`'s text for the adapter."""
    if tp <= kv:
        return None
    return (
        f"{where}: --tensor-parallel-size {tp} exceeds the {kv} KV heads, so vLLM replicates each KV head on "
        f"{tp // kv} ranks and a rank's K/V shard is not its block; fix: serve at --tensor-parallel-size in "
        f"{splitting_degrees(kv, nblocks=nblocks, heads=kv)}, or {dense_fix}"
    )


def side_refusal(where: str, role: Role, side: Side, dense_fix: str) -> str | None:
    """A block-diagonal role on a layer TP splits on the other side: no rank holds its blocks locally."""
    if side_of_role(role) == side:
        return None
    return (
        f"{where}: {role} (block-diagonal {factor_of(role)}) on a {side}-parallel layer has no rank-local form; fix: "
        f"train with target_modules_{role_of(side)} for it (roles follow the TP plan), or {dense_fix}"
    )


def uncovered_refusal(module: str, layer: str, dense_fix: str) -> str:
    """A module vLLM serves with a LoRA layer class the plugin does not shard rank-locally (`layer`: its class)."""
    fix = ("drop --fully-sharded-loras (BD-LoRA needs no S-LoRA collectives)" if "Sharded" in layer
           else f"serve at --tensor-parallel-size 1, or {dense_fix}")
    return f"module {module}: vLLM wraps it in {layer}, which the BD-LoRA plugin does not cover; fix: {fix}"


def fused_blocks_refusal(module: str, layer: str, segments: int, dense_fix: str) -> str:
    """PEFT's contiguous blocks over a fused layer vLLM shards segment by segment."""
    return (
        f"module {module}: one LoRA over a fused {layer} (vLLM shards each of its {segments} segments separately, so "
        f"contiguous blocks straddle shards); fix: serve at --tensor-parallel-size 1, train it with bdlora-train "
        f"(segment-aware blocks), or {dense_fix}"
    )


def parts_refusal(module: str, parts: list[str], dense_fix: str) -> str:
    """PEFT's contiguous blocks over a fused projection that vLLM loads as its parts."""
    return (
        f"module {module}: PEFT's contiguous blocks over a fused projection that vLLM loads as {parts} straddle "
        f"those parts; fix: train it with bdlora-train (segment-aware blocks), or {dense_fix}"
    )


def shard_width_refusal(module: str, side: Side, shards: list[int], segments: list[int], tp: int,
                        dense_fix: str) -> str:
    """A module whose blocks (`segments` split into tp) are not the shards vLLM gives a rank (`shards`, full
    sizes)."""
    return (
        f"module {module}: this rank's {side} shard is {[s // tp for s in shards]} wide, not {segments}/{tp}, so "
        f"blocks do not line up with shards; fix: {dense_fix}"
    )


def segments_refusal(module: str, segments: list[int], sizes: list[int], dense_fix: str) -> str:
    """Segment-aware blocks whose segments are not the parts vLLM splits the fused layer into."""
    return (f"module {module}: its blocks follow segments {segments} but vLLM splits the layer into {sizes}; "
            f"fix: {dense_fix}")


def use_bdlora_refusal(value) -> str:
    return (f"adapter_config.json: use_bdlora={value!r} is not a BdLoraConfig dict; fix: save it with PEFT's "
            "LoraConfig(use_bdlora=BdLoraConfig(...))")


def nblocks_value_refusal(nblocks: int) -> str:
    return (f"adapter_config.json: use_bdlora.nblocks={nblocks} must be >= 1; fix: save the adapter with the nblocks "
            "it was trained with")


def packed_refusal(module: str, role: Role, shape_a: tuple, shape_b: tuple, nblocks: int, r: int) -> str:
    """Saved factors that are not PEFT's packed layout for their role (rank `r`, read from the dense factor)."""
    if role == Role.BD_B:
        want = f"lora_B (d_out, r/N) = (*, {r // nblocks if divides(nblocks, r) else '?'})"
    else:
        want = f"lora_A (r, d_in/N) with r = {r}"
    return (
        f"module {module}: {role} factors of shapes A {shape_a}, B {shape_b} are not PEFT's packed BD-LoRA layout "
        f"with nblocks={nblocks} ({want}); fix: check use_bdlora in adapter_config.json matches the saved tensors"
    )


def layout_shape_refusal(module: str, factor: str, shape: tuple, expected: tuple) -> str:
    return (f"module {module}: lora_{factor} {shape} does not match bdlora_layout.json ({expected}); fix: restore "
            "the adapter directory as saved")


def off_block_refusal(module: str, factor: str) -> str:
    return (f"module {module}: lora_{factor} has non-zero entries outside its blocks, unlike its "
            "bdlora_layout.json; fix: re-save the adapter from the toolkit")


def fused_rows_refusal(module: str, rows: int, sizes: list[int]) -> str:
    return (f"module {module}: lora_B has {rows} rows, vLLM's layer {sizes} (sum {sum(sizes)}); fix: check the "
            "adapter was trained on this base model")
