"""The tensor-parallel degree rules.

Every rule that says whether a TP degree (or a number of blocks N) lines up with an adapter or a model lives here,
once, as a small pure function (no torch, no PEFT, no transformers): callers elsewhere ask these functions and never
write the modulo themselves (tests/core/test_degrees.py scans the package for an inline copy).

- A TP degree t serves or trains an adapter with N blocks iff t divides N (`divides`, `check_divides`); the degrees
  that do are the divisors of N (`servable_degrees`).
- The rank r splits into N blocks (or over t ranks) iff N divides r (`check_rank`); each rank then holds exactly
  r/t of it (`per_rank_rank`): there is no rounding, a rank t does not divide is refused (vLLM's plugin refuses it
  at load, before it divides anything).
- The dimension TP splits, every fused segment of it (Phi-3's [q | k | v]), must divide into N (`segments_split`,
  `check_segments`).
- A degree splits the attention heads when it divides both the heads and the KV heads (`heads_split`); an engine also
  shards the base when the degree exceeds the KV heads and is a multiple of them, by replicating each KV head
  (`kv_replicated`), but then the K/V blocks no longer line up with the shards (`base_shards` is either).
- Expert-parallel training holds whole experts on each rank: ep_size = tp_size x fsdp_size, that many processes per
  replica, and ep_size divides the experts (`ep_layout_fits`); `ep_layout_fixes` suggests only layouts that pass all
  three.

Each `check_*` raises the error type its caller passes (like `check_rank`'s `error=`) with one line naming the
value, the rule and a fix that passes every rule the caller knows (head counts, the rank, the segments).
"""

from __future__ import annotations

from collections.abc import Iterable

from bdlora_train.core.errors import BlockDiagLoraConfigError

# How far `splitting_degrees` looks when it suggests a degree (or an nblocks) with no upper bound of its own: the
# common serving degrees.
SUGGEST_UP_TO = 8


def divides(degree: int, n: int) -> bool:
    """Whether `degree` (a TP degree, or a number of blocks) divides `n` (nblocks, a rank, a width, a head count).
    A degree below 1 divides nothing."""
    return degree >= 1 and n % degree == 0


def servable_degrees(nblocks: int, heads: int | None = None, kv: int | None = None) -> list[int]:
    """The TP degrees an adapter with `nblocks` blocks lines up with: the divisors of nblocks (a degree below nblocks
    re-blocks, merging nblocks/degree blocks per rank); with `heads` (and `kv`, default `heads`) only those that
    also split the heads."""
    return [d for d in range(1, nblocks + 1) if divides(d, nblocks) and (heads is None or heads_split(heads, kv, d))]


def splitting_degrees(
    limit: int | None = None,
    *,
    nblocks: int | None = None,
    r: int | None = None,
    segments: Iterable[int] = (),
    heads: int | None = None,
    kv: int | None = None,
) -> list[int]:
    """Degrees 1..limit (default: nblocks, else `SUGGEST_UP_TO`) that pass every rule the caller knows: dividing
    `nblocks`, splitting the rank `r`, every segment and the heads: the values a message may suggest."""
    top = limit or nblocks or SUGGEST_UP_TO
    segments = tuple(segments)
    return [
        d
        for d in range(1, top + 1)
        if (nblocks is None or divides(d, nblocks))
        and (r is None or divides(d, r))
        and segments_split(segments, d)
        and (heads is None or heads_split(heads, kv, d))
    ]


def check_divides(
    degree: int,
    nblocks: int,
    where: str,
    *,
    key: str = "tp",
    blocks: str = "nblocks",
    fix: str | None = None,
    heads: int | None = None,
    kv: int | None = None,
    error: type[Exception] = BlockDiagLoraConfigError,
) -> None:
    """Refuse a degree that does not divide nblocks (each rank must hold whole blocks), naming the degrees that do
    (and split the heads, when `heads` is given) unless the caller passes its own `fix`."""
    if not divides(degree, nblocks):
        fix = fix or f"use {key} in {servable_degrees(nblocks, heads, kv)}"
        raise error(
            f"{where}: {key}={degree} does not divide {blocks}={nblocks}: each rank must hold whole blocks; {fix}"
        )


def check_rank(
    r: int, nblocks: int, where: str, key: str = "r", blocks: str = "nblocks", error=BlockDiagLoraConfigError
):
    """Refuse a rank that N blocks (or N TP ranks) cannot split, naming the nearest ranks that work."""
    if not divides(nblocks, r):
        below = r - r % nblocks  # the multiple of nblocks just below r
        choices = sorted({max(nblocks, below), below + nblocks})
        raise error(
            f"{where}: {key}={r} is not a multiple of {blocks}={nblocks}; use "
            + " or ".join(f"{key}={choice}" for choice in choices)
        )


def per_rank_rank(
    r: int,
    degree: int,
    where: str = "BD-LoRA adapter",
    key: str = "r",
    blocks: str = "tp",
    error=BlockDiagLoraConfigError,
) -> int:
    """The rank each of `degree` TP ranks holds of a block-diagonal module of rank r: exactly r/degree. A rank the
    degree does not divide is refused (`check_rank`), never rounded: the ranks' slices would differ in size, and
    vLLM's plugin refuses such an adapter at load."""
    check_rank(r, degree, where, key=key, blocks=blocks, error=error)
    return r // degree


def segments_split(segments: Iterable[int], nblocks: int) -> bool:
    """Whether every segment of a split dimension (one segment for a plain Linear, [q | k | v] for Phi-3's fused
    qkv_proj) divides into `nblocks` blocks (or TP shards)."""
    return all(divides(nblocks, size) for size in segments)


def check_segments(
    segments: Iterable[int],
    nblocks: int,
    where: str,
    *,
    blocks: str = "nblocks",
    what: str = "segments",
    r: int | None = None,
    heads: int | None = None,
    kv: int | None = None,
    error: type[Exception] = BlockDiagLoraConfigError,
) -> None:
    """Refuse a split dimension whose segments do not all divide into nblocks, naming the values that would (and
    also split `r` and the heads, when given)."""
    segments = tuple(segments)
    if not segments_split(segments, nblocks):
        ok = splitting_degrees(max(SUGGEST_UP_TO, nblocks), r=r, segments=segments, heads=heads, kv=kv)
        shown = segments[0] if len(segments) == 1 else list(segments)
        raise error(
            f"{where}: {what}={shown} not all divisible by {blocks}={nblocks}: each block (and TP shard) must take "
            f"the same share of every segment; use {blocks} in {ok}"
        )


def heads_split(heads: int, kv: int | None, degree: int) -> bool:
    """Whether `degree` splits both the attention heads and the KV heads (`kv`, default `heads`) evenly: each rank
    then holds whole heads of both, and blocks line up with the shards."""
    return divides(degree, heads) and divides(degree, heads if kv is None else kv)


def kv_replicated(heads: int, kv: int | None, degree: int) -> bool:
    """Whether an engine shards the base at `degree` only by replicating the KV heads: the degree divides the heads,
    exceeds the KV heads and is a multiple of them (Llama-3.1-8B's 8 KV heads at TP 16). The base still shards, but
    a rank's K/V shard is a replicated head, not its block: BD blocks on K/V no longer line up."""
    kv = heads if kv is None else kv
    return divides(degree, heads) and degree > kv and divides(kv, degree)


def base_shards(heads: int, kv: int | None, degree: int) -> bool:
    """Whether an engine (vLLM) can shard the base model's attention at `degree` at all: the heads split, or the
    KV heads are replicated."""
    return heads_split(heads, kv, degree) or kv_replicated(heads, kv, degree)


def ep_layout_fits(
    tp: int, fsdp: int, ep: int, replicas: int = 1, processes: int | None = None, experts: int | None = None
) -> bool:
    """Whether an expert-parallel layout passes every rule: ep = tp x fsdp (each rank holds whole experts and every
    rank of a replica holds some), tp x fsdp x replicas processes (when the launch is known), ep divides the experts
    (when the model is known)."""
    return (
        ep == tp * fsdp
        and (processes is None or tp * fsdp * replicas == processes)
        and (experts is None or divides(ep, experts))
    )


def ep_layout_fixes(
    tp: int, fsdp: int, ep: int, replicas: int = 1, processes: int | None = None, experts: int | None = None
) -> list[dict[str, int]]:
    """The smallest changes ({key: new value}: ep_size alone, fsdp_size alone, then both) that make a refused layout
    pass every rule of `ep_layout_fits` the caller can check; tp_size is never changed (the heads and the adapter's
    blocks were checked against it). Empty when none does: a hint that fails the next rule is no hint."""
    candidates = [{"ep_size": tp * fsdp}]
    if divides(tp, ep):
        candidates.append({"fsdp_size": ep // tp})
    if processes is not None and divides(tp * replicas, processes):
        per_replica = processes // replicas
        candidates.append({"fsdp_size": per_replica // tp, "ep_size": per_replica})
    fixes = []
    for change in candidates:
        layout = {"fsdp_size": fsdp, "ep_size": ep, **change}
        changed = {key: value for key, value in change.items() if value != {"fsdp_size": fsdp, "ep_size": ep}[key]}
        if changed and changed not in fixes and layout["ep_size"] > 1:
            if ep_layout_fits(tp, layout["fsdp_size"], layout["ep_size"], replicas, processes, experts):
                fixes.append(changed)
    return fixes
