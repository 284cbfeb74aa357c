"""How each decoder family is laid out under tensor parallelism: scope, plan, fused segments, experts.

Everything BD-LoRA needs to know about an architecture, read from the model rather than from a list of names:

* **Scope.** The language model's decoder (`model.get_decoder()`); a multimodal model's vision/audio tower is
  outside it, so plan patterns (written relative to the text model) never give tower layers a role.
* **Plan.** transformers' `base_model_tp_plan` of the text config, plus `PLAN_ADDITIONS` for families it ships
  without one (OPT, Bloom, MPT, Falcon, GPT-2) or where it leaves a sharded layer out (Qwen2-MoE's shared expert).
* **Layout of a column-parallel output.** Either one contiguous range that TP cuts into N equal pieces, or
  several *segments* (Phi-3 `qkv_proj` = [q | k | v] with sizes H·d, KV·d, KV·d; `gate_up_proj` = [gate | up])
  of which rank i holds the i-th 1/N slice of each: what vLLM's `QKVParallelLinear` / `MergedColumnParallelLinear`
  and transformers' `packed_colwise` shard. Decided by layout, never by name: a plain `colwise` entry means
  transformers itself runs the layer's consumer on contiguous shards (GPT-NeoX and Bloom interleave q, k, v per
  head, so contiguous blocks are whole-head shards); a gather-output entry (transformers gathers because the local
  shard is not self-contained) is decided by `probe_layout`, which perturbs the channels each candidate assigns
  to rank i in a tiny model of the same architecture and checks that only rank i's shard of the consumer
  (o_proj / down_proj) moves.
* **Experts.** transformers 5 stores MoE experts as 3-D parameters (E, d1, d2). Their plan entries say which
  dimension TP shards (`packed_colwise`: gate|up halves of dim 1; `rowwise`: the last dimension; Llama-4's
  transposed `packed_rowwise` / `colwise`), and PEFT's `ParamWrapper` says which LoRA factor spans it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from torch import nn

COLUMN, ROW = "column", "row"
# transformers' styles (transformers/distributed/tensor_parallel.py) -> which side of a Linear TP splits.
COLUMN_STYLES = ("colwise", "colwise_gather_output", "colwise_rep", "packed_colwise")
ROW_STYLES = ("rowwise", "rowwise_split_input", "rowwise_rep")
GATHER_STYLES = ("colwise_gather_output", "colwise_rep")  # output all-gathered: the shard layout is not implied

# Families transformers ships without a TP plan, in its style vocabulary. Attention projections whose modeling code
# views them with the global head count (OPT, Bloom, MPT, Falcon) gather their output and split the next layer's
# input, as transformers does for Phi-3; the MLP is plain Megatron TP.
PLAN_ADDITIONS: dict[str, dict[str, str]] = {
    "opt": {
        "layers.*.self_attn.q_proj": "colwise_gather_output",
        "layers.*.self_attn.k_proj": "colwise_gather_output",
        "layers.*.self_attn.v_proj": "colwise_gather_output",
        "layers.*.self_attn.out_proj": "rowwise_split_input",
        "layers.*.fc1": "colwise",
        "layers.*.fc2": "rowwise",
    },
    "bloom": {
        "h.*.self_attention.query_key_value": "colwise_gather_output",
        "h.*.self_attention.dense": "rowwise_split_input",
        "h.*.mlp.dense_h_to_4h": "colwise",
        "h.*.mlp.dense_4h_to_h": "rowwise",
    },
    "mpt": {
        "blocks.*.attn.Wqkv": "colwise_gather_output",
        "blocks.*.attn.out_proj": "rowwise_split_input",
        "blocks.*.ffn.up_proj": "colwise",
        "blocks.*.ffn.down_proj": "rowwise",
    },
    "falcon": {
        "h.*.self_attention.query_key_value": "colwise_gather_output",
        "h.*.self_attention.dense": "rowwise_split_input",
        "h.*.mlp.dense_h_to_4h": "colwise",
        "h.*.mlp.dense_4h_to_h": "rowwise",
    },
    "gpt2": {
        "h.*.attn.c_attn": "colwise_gather_output",
        "h.*.attn.c_proj": "rowwise_split_input",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
    # DeepSeek MLA: transformers' plan covers only the MLP; vLLM shards the up-projections by head and o_proj by
    # input (q_a_proj / kv_a_proj_with_mqa, the low-rank down-projections, stay replicated: no role).
    "deepseek_v3": {
        "layers.*.self_attn.q_b_proj": "colwise",
        "layers.*.self_attn.kv_b_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
    },
    # transformers' plan leaves the shared expert replicated; vLLM shards it like a dense MLP.
    "qwen2_moe": {
        "layers.*.mlp.shared_expert.gate_proj": "colwise",
        "layers.*.mlp.shared_expert.up_proj": "colwise",
        "layers.*.mlp.shared_expert.down_proj": "rowwise",
    },
}


def text_config(model_config):
    """The language model's config (multimodal configs nest it)."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def model_type(model_config) -> str:
    return getattr(text_config(model_config), "model_type", None) or getattr(model_config, "model_type", "model")


def tp_plan(model_config) -> dict[str, str]:
    """The text model's TP plan: transformers' own plus `PLAN_ADDITIONS` (patterns relative to the text model)."""
    config = text_config(model_config)
    plan = getattr(config, "base_model_tp_plan", None) or getattr(type(config), "base_model_tp_plan", None) or {}
    family = getattr(config, "model_type", None)
    family = {"llama4_text": "llama4"}.get(family, family)
    return {**dict(plan), **PLAN_ADDITIONS.get(family, {})}


def _plan_regex(pattern: str) -> re.Pattern:
    body = r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in pattern.split("."))
    return re.compile(rf"^(?:model\.)?{body}$")


def plan_style(relative_name: str, plan: dict[str, str]) -> str | None:
    """The plan style of a module/parameter named relative to the text model (anchored: a vision tower's
    `encoder.layers.0.self_attn.q_proj` is not the text model's `layers.*.self_attn.q_proj`)."""
    for pattern, style in plan.items():
        if _plan_regex(pattern).match(relative_name):
            return style
    return None


def parallel_of(style: str | None) -> str | None:
    if style in COLUMN_STYLES:
        return COLUMN
    if style in ROW_STYLES:
        return ROW
    return None


def decoder_prefix(model: nn.Module) -> str:
    """Name of the language model's decoder module ("" if it is the model itself, e.g. a bare text model)."""
    decoder = None
    if hasattr(model, "get_decoder"):
        try:
            decoder = model.get_decoder()
        except (AttributeError, NotImplementedError, TypeError):
            decoder = None
    if decoder is not None and decoder is not model:
        for name, module in model.named_modules():
            if module is decoder:
                return name
    # get_decoder() is the model itself (Llama4ForCausalLM): the module holding the decoder layer stack.
    layers = getattr(text_config(getattr(model, "config", None)), "num_hidden_layers", None)
    best = None
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if isinstance(child, nn.ModuleList) and len(child) == layers and child_name in ("layers", "h", "blocks"):
                if best is None or len(name) < len(best):
                    best = name
    return best or ""


def relative(name: str, prefix: str) -> str | None:
    """`name` relative to the decoder module, or None when it lies outside it."""
    if not prefix:
        return name
    return name[len(prefix) + 1 :] if name.startswith(prefix + ".") else None


def is_router(name: str, module: nn.Module, config) -> bool:
    """A MoE router or shared-expert gate (its output is the expert scores or one gate value): never adapted."""
    config = text_config(config)
    experts = {getattr(config, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts")} - {None}
    leaf = name.rsplit(".", 1)[-1]
    out = getattr(module, "out_features", None)
    return ("gate" in leaf or "router" in leaf) and out is not None and (out == 1 or out in experts)


# ---------------------------------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """Where a TP-sharded layer splits and which LoRA factor has to be block-diagonal there.

    name: module name (Linear) or `module.parameter` (experts); style: the TP plan style; parallel: column/row;
    factor: "B" (bd_b: B spans the split dimension) or "A" (bd_a); segments: sizes along the split dimension
    (one entry = contiguous; several = rank i holds the i-th 1/N of each); experts: E for a 3-D parameter, else 0;
    d_in / d_out: LoRA's in/out features as PEFT builds them (per expert).
    """

    name: str
    style: str
    parallel: str
    factor: str
    segments: tuple[int, ...]
    d_in: int
    d_out: int
    experts: int = 0

    @property
    def kind(self) -> str:
        return "expert" if self.experts else "linear"

    @property
    def fused(self) -> bool:
        return len(self.segments) > 1

    @property
    def split(self) -> int:
        return sum(self.segments)


def linear_layout(name: str, module: nn.Module, style: str, segments: tuple[int, ...] | None = None) -> Layout:
    parallel = parallel_of(style)
    split = module.out_features if parallel == COLUMN else module.in_features
    if segments is None:
        segments = (split // 2, split // 2) if style == "packed_colwise" else (split,)
    return Layout(
        name=name,
        style=style,
        parallel=parallel,
        factor="B" if parallel == COLUMN else "A",
        segments=tuple(segments),
        d_in=module.in_features,
        d_out=module.out_features,
    )


def expert_layout(name: str, module: nn.Module, param: torch.Tensor, style: str) -> Layout | None:
    """Layout of a 3-D expert parameter (E, d1, d2) under its plan style; None if the style shards no dimension.

    PEFT's ParamWrapper (peft/tuners/lora/layer.py) reads (E, d1, d2) as (E, out, in) unless the experts module
    says `is_transposed`, and builds per-expert factors with delta_e = B_e A_e: B spans d1 and A spans d2
    (transposed: A spans d1, B spans d2). The factor spanning the dimension TP splits is the block-diagonal one.
    """
    if param.ndim != 3:
        return None
    experts, d1, d2 = param.shape
    if style == "packed_colwise":
        dim, packed = 1, True
    elif style == "packed_rowwise":
        dim, packed = 2, True
    elif style in ("colwise", "colwise_gather_output"):
        dim, packed = 1, False
    elif style in ("rowwise", "rowwise_split_input"):
        dim, packed = 2, False
    else:
        return None
    transposed = bool(getattr(module, "is_transposed", False))
    spans = {1: "A" if transposed else "B", 2: "B" if transposed else "A"}
    d_in, d_out = (d1, d2) if transposed else (d2, d1)
    size = d1 if dim == 1 else d2
    return Layout(
        name=name,
        style=style,
        parallel=COLUMN if spans[dim] == "B" else ROW,
        factor=spans[dim],
        segments=(size // 2, size // 2) if packed else (size,),
        d_in=d_in,
        d_out=d_out,
        experts=experts,
    )


def candidate_segments(config, d_out: int, consumer_in: int | None) -> dict[str, tuple[int, ...]]:
    """Ways a column-parallel output of width d_out may be laid out: contiguous, [q | k | v], [gate | up]."""
    config = text_config(config)
    out = {"contiguous": (d_out,)}
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or getattr(config, "kv_n_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if heads and head_dim and (heads + 2 * kv) * head_dim == d_out:
        out["q|k|v"] = (heads * head_dim, kv * head_dim, kv * head_dim)
    if consumer_in and 2 * consumer_in == d_out:
        out["gate|up"] = (consumer_in, consumer_in)
    return out


def shard_rows(segments: tuple[int, ...], nblocks: int, rank: int) -> torch.Tensor:
    """Indices (along the split dimension) rank `rank` of `nblocks` holds: the rank-th 1/N slice of every segment."""
    out, offset = [], 0
    for size in segments:
        step = size // nblocks
        out.append(torch.arange(offset + rank * step, offset + (rank + 1) * step))
        offset += size
    return torch.cat(out)


def rank_order(segments: tuple[int, ...], nblocks: int) -> torch.Tensor:
    """The permutation that puts rank 0's indices first, then rank 1's, ...: contiguous blocks after it."""
    return torch.cat([shard_rows(segments, nblocks, rank) for rank in range(nblocks)])


def consumer_of(name: str, plan: dict[str, str], model: nn.Module, prefix: str) -> str | None:
    """The row-parallel sibling that consumes a column-parallel layer's output (o_proj for qkv, down for gate_up)."""
    parent = name.rpartition(".")[0]
    for child_name, child in model.get_submodule(parent).named_children():
        full = f"{parent}.{child_name}"
        rel = relative(full, prefix)
        base = child.get_base_layer() if hasattr(child, "get_base_layer") else child  # an adapter already on it
        if isinstance(base, nn.Linear) and rel and parallel_of(plan_style(rel, plan)) == ROW:
            return full
    return None


def probe_layout(model: nn.Module, name: str, candidates: dict[str, tuple[int, ...]], consumer: str) -> str | None:
    """The first candidate whose rank-i channels feed only rank i's contiguous input shard of `consumer`, at N = 2.

    Runs the model on a few tokens with noise added to one candidate slice of `name`'s output and records the
    consumer's input: a layout is right iff every perturbed slice moves only the matching consumer shard.
    """
    layer = model.get_submodule(name)
    sink = model.get_submodule(consumer)
    nblocks = 2
    seen: dict[str, torch.Tensor] = {}
    state: dict = {"rows": None}

    def add_noise(_module, _args, output):
        if state["rows"] is None:
            return output
        noise = torch.zeros_like(output)
        noise[..., state["rows"]] = torch.randn(*output.shape[:-1], len(state["rows"]), generator=state["gen"])
        return output + noise

    def record(_module, args):
        seen["x"] = args[0].detach().clone()

    handles = [layer.register_forward_hook(add_noise), sink.register_forward_pre_hook(record)]
    vocab = text_config(model.config).vocab_size
    ids = torch.randint(3, min(vocab, 200), (1, 6), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            state["rows"] = None
            model(input_ids=ids, use_cache=False)
            clean = seen["x"]
            width = clean.shape[-1]
            for label, segments in candidates.items():
                if any(size % nblocks for size in segments) or width % nblocks:
                    continue
                ok = True
                for rank in range(nblocks):
                    state.update(rows=shard_rows(segments, nblocks, rank), gen=torch.Generator().manual_seed(rank))
                    model(input_ids=ids, use_cache=False)
                    moved = (seen["x"] - clean).abs().flatten(0, -2).amax(0) > 1e-6 * clean.abs().max()
                    mine = torch.zeros(width, dtype=torch.bool)
                    mine[rank * width // nblocks : (rank + 1) * width // nblocks] = True
                    if not moved.any() or (moved & ~mine).any():
                        ok = False
                        break
                if ok:
                    return label
    finally:
        for handle in handles:
            handle.remove()
    return None


@functools.lru_cache(maxsize=None)
def probed_layout(family: str, relative_kind: str) -> str | None:
    """`probe_layout` on a tiny model of `family` for the layer `relative_kind` (e.g. "layers.*.self_attn.qkv_proj")
    built by `models.build_tiny_model`; cached per family. None when no candidate holds or no tiny model exists."""
    from bdlora_train.models import TINY_FAMILIES, build_tiny_model

    family = {"llama4_text": "llama4"}.get(family, family)
    if family not in TINY_FAMILIES:
        return None
    model = build_tiny_model(family)
    prefix = decoder_prefix(model)
    plan = tp_plan(model.config)
    name = f"{prefix}.{relative_kind.replace('*', '0')}".lstrip(".")
    consumer = consumer_of(name, plan, model, prefix)
    if consumer is None:
        return None
    module = model.get_submodule(name)
    candidates = candidate_segments(model.config, module.out_features, model.get_submodule(consumer).in_features)
    return probe_layout(model, name, candidates, consumer)


def layer_kind(relative_name: str) -> str:
    """`layers.3.self_attn.q_proj` -> `layers.*.self_attn.q_proj`."""
    return ".".join("*" if part.isdigit() else part for part in relative_name.split("."))
