"""The segments of a fused column-parallel output, decided by layout, never by name.

A column-parallel output is either one contiguous range that TP cuts into N equal pieces, or several *segments*
(Phi-3 `qkv_proj` = [q | k | v] with sizes H*d, KV*d, KV*d; `gate_up_proj` = [gate | up]) of which rank i holds the
i-th 1/N slice of each: what vLLM's `QKVParallelLinear` / `MergedColumnParallelLinear` and transformers'
`packed_colwise` shard. A plain `colwise` plan entry means transformers itself runs the layer's consumer on
contiguous shards (GPT-NeoX and Bloom interleave q, k, v per head, so contiguous blocks are whole-head shards). A
gather-output entry (transformers gathers because the local shard is not self-contained) is decided by
`probe_layout`: noise added to the channels each candidate assigns to rank i of a tiny model of the same
architecture must move only rank i's shard of the consumer (o_proj / down_proj).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from bdlora_train.arch.plans import tp_plan
from bdlora_train.arch.scope import consumer_of, decoder_prefix
from bdlora_train.core.blocks import shard_rows
from bdlora_train.core.degrees import divides, segments_split
from bdlora_train.core.heads import head_counts, head_dim, text_config


def candidate_segments(config, d_out: int, consumer_in: int | None) -> dict[str, tuple[int, ...]]:
    """Ways a column-parallel output of width d_out may be laid out: contiguous, [q | k | v], [gate | up]."""
    out = {"contiguous": (d_out,)}
    heads, kv = head_counts(config)
    size = head_dim(config)
    if heads and size and (heads + 2 * kv) * size == d_out:
        out["q|k|v"] = (heads * size, kv * size, kv * size)
    if consumer_in and 2 * consumer_in == d_out:
        out["gate|up"] = (consumer_in, consumer_in)
    return out


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
                if not (segments_split(segments, nblocks) and divides(nblocks, width)):
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
def probed_layout(build_model, family: str, relative_kind: str) -> str | None:
    """`probe_layout` on `build_model(family)` (a tiny model of that family, or None when there is none) for the
    layer `relative_kind` (e.g. "layers.*.self_attn.qkv_proj"); cached per factory, family and layer kind."""
    with torch.random.fork_rng(devices=[]):  # building a model seeds the global stream: the caller's draws stay its own
        model = build_model(family)
    if model is None:
        return None
    prefix = decoder_prefix(model)
    plan = tp_plan(model.config)
    name = f"{prefix}.{relative_kind.replace('*', '0')}".lstrip(".")
    consumer = consumer_of(name, plan, model, prefix)
    if consumer is None:
        return None
    module = model.get_submodule(name)
    candidates = candidate_segments(model.config, module.out_features, model.get_submodule(consumer).in_features)
    return probe_layout(model, name, candidates, consumer)
