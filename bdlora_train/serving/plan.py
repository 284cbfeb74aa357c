"""The serve plan: the route an adapter takes on an engine (the bdlora plugin, the dense export, plain LoRA, or none),
`--max-lora-rank`, the served path and name, and the checks that follow from the adapter and the engine's kind alone
(blocks, rank, heads, experts, fused projections); and the model card's serving lines, rendered from the plan.

`check-serving` (check.py) adds what this machine has installed (the engine, the base files, memory) to the same
plan. One rule names the served adapter everywhere (check-serving, the model card, the README): `--lora-modules
NAME=PATH` with NAME the adapter directory's name (check-serving's `--name` overrides it), PATH the directory.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bdlora_train.adapters.reader import Adapter
from bdlora_train.core.degrees import (
    base_shards,
    divides,
    per_rank_rank,
    servable_degrees,
    splitting_degrees,
)
from bdlora_train.core.heads import head_counts, head_dim, text_config
from bdlora_train.core.layout import side_of_role
from bdlora_train.core.roles import BD_A, BD_B
from bdlora_train.models import EMBEDDED, EMBEDDED_HUB_ID, base_spec, load_config
from bdlora_train.serving.engines import (
    SUPPORTED_VLLM_VERSIONS,
    VLLM_MAX_LORA_RANKS,
    VLLM_SPLIT_FUSED,
    EngineStatus,
    cpu_slot_defect,
    cpu_threads_env,
    is_cpu_build,
    numa_nodes,
    serve_launcher,
    serving_status,
    vllm_install,
    vllm_max_lora_rank,
)
from bdlora_train.serving.rules import (
    dense_export,
    experts_refusal,
    kv_heads_refusal,
    max_rank_refusal,
    nblocks_refusal,
    rank_split_refusal,
    serve_dense,
    side_refusal,
    split_rank,
)

# The projections the plugin serves (vLLM's column, merged-column, QKV and row-parallel LoRA layers of Llama-style
# models), with the factor that must be block-diagonal on each; the fused ones (Phi-3, GLM-4) come densely stored
# with segment-aware blocks (bdlora_layout.json).
VLLM_BD_MODULES = {
    "q_proj": BD_B,
    "k_proj": BD_B,
    "v_proj": BD_B,
    "gate_proj": BD_B,
    "up_proj": BD_B,
    "o_proj": BD_A,
    "down_proj": BD_A,
}
VLLM_FUSED_MODULES = {"qkv_proj": BD_B, "gate_up_proj": BD_B}


@dataclass(frozen=True)
class Check:
    """One line of check-serving: which check, its status (ok / warn / fix / fail) and what it found, with the fix."""

    check: str
    status: str
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


def add_check(checks: list, name: str, status: str, message: str) -> None:
    checks.append(Check(name, status, message))


@dataclass
class ServePlan:
    """What serving the adapter takes on an engine: the route, `--max-lora-rank`, the path served, fixes, flags."""

    route: str
    R: int
    path: str
    name: str
    checks: list = field(default_factory=list)
    fixes: list = field(default_factory=list)
    flags: list = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(c.status == "fail" for c in self.checks)

    def command(self, served: str, tp: int, launcher: str) -> str:
        tp_flag = f" --tensor-parallel-size {tp}" if tp > 1 else ""
        extra = "".join(f" {flag}" for flag in self.flags)
        return (f"{launcher} {served} --enable-lora{tp_flag} --max-lora-rank {self.R}{extra} "
                f"--lora-modules {self.name}={self.path}")


def _expert_modules(adapter: Adapter) -> list[str]:
    return sorted(name for name, m in adapter.modules.items() if m.experts)


def _split_modules(adapter: Adapter, config) -> dict[str, tuple[str, ...]]:
    """Adapted fused projections the base's vLLM model class loads only as their parts (engines.VLLM_SPLIT_FUSED)."""
    archs = (getattr(config, "architectures", None) or []) if config is not None else []
    fused = {k: v for arch in archs for k, v in VLLM_SPLIT_FUSED.get(arch, {}).items()}
    return {kind: fused[kind] for kind in sorted({n.rsplit(".", 1)[-1] for n in adapter.modules}) if kind in fused}


def serve_plan(adapter: Adapter, tp: int, engine: EngineStatus, max_lora_rank: int | None, config, name: str | None,
               path: str, dense_path: str) -> ServePlan:
    """The route the adapter takes on `engine` and every check that follows from the adapter, the base config and
    the engine's kind (not from what this machine has installed: `check_serving` adds those). The served name is
    `name`, else the served directory's name (the adapter's, or its dense export's)."""
    plan = ServePlan(route="", R=0, path=path, name=name or "")
    checks = plan.checks
    dense_fix = dense_export(path)
    experts = _expert_modules(adapter)
    splits = _split_modules(adapter, config)
    if not adapter.has_structure:
        plan.route = "plain-lora"
        if engine.engine is not None:  # none installed: check_serving's engine fix says it all
            add_check(checks, "engine", "ok", f"plain LoRA adapter: any vLLM serves it ({engine.message})")
    elif experts:
        plan.route = "none"
        add_check(checks, "experts", "fail", experts_refusal(experts))
    elif engine.active or engine.engine is None:
        plan.route = "plugin"
        if engine.active:
            add_check(checks, "engine", "ok", engine.message + " Each rank computes only its own blocks.")
    else:
        plan.route = "dense-lora"
        plan.fixes.append(dense_fix)
        plan.path = dense_path
        add_check(checks, "engine", "fix", (
            f"{engine.message} Until then the exact dense-lora export serves on it; every rank then computes the "
            "full rank-r LoRA shrink (column-parallel) or expand (row-parallel) instead of its own blocks"))
    if splits and not engine.active and engine.engine is not None and plan.route != "none":
        parts = "; ".join(f"{kind} only as {list(sub)}" for kind, sub in splits.items())
        add_check(checks, "fused", "fail", (
            f"vLLM's {config.architectures[0]} loads {parts}, so vLLM without the bdlora plugin refuses this "
            f"adapter's {sorted(splits)} (as unexpected modules); the plugin splits them at load, exactly, once it is "
            f"active (vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}: the engine check's fix)"))
    elif splits:
        add_check(checks, "fused", "ok", f"{sorted(splits)}: split into {[p for v in splits.values() for p in v]} at "
               "load by the plugin (the parts share A: exact)")
    if plan.route == "plugin":
        _blocks_check(adapter, tp, path, checks, *(head_counts(config) if config is not None else ()))
    if plan.route != "none":
        plan.R = _rank_check(adapter, tp, plan.route, max_lora_rank, checks)
    if config is None:
        add_check(checks, "kv_heads", "warn", "base config not readable; pass --model to check head counts")
    elif plan.route != "none":
        checks.append(_heads_check(config, tp, plan.route, adapter.bd_nblocks, path))
    plan.name = name or Path(plan.path).name
    if cpu_slot_defect(engine.engine, engine.version) and not engine.active:
        plan.flags.append("--max-loras 2")
        add_check(checks, "slots", "ok", (
            "--max-loras 2: vLLM's CPU LoRA ops before 0.33.0 give base requests (slot -1) the last slot's adapter "
            "when every slot is occupied (vllm/lora/ops/torch_ops/lora_ops.py); one slot stays free (the bdlora "
            "plugin guards the ops instead)"))
    return plan


def _is_bd(m) -> bool:
    return m.role is not None or m.structure is not None


def _unsplit(adapter: Adapter, tp: int, route: str) -> list[str]:
    """Modules whose rank TP does not divide, through the plugin: it refuses the adapter at load (vllm_plugin/patch.py
    checks every rank of a BD-LoRA adapter's config, plain modules' too; it never rounds: each GPU holds exactly
    r/TP of a block-diagonal module)."""
    return [name for name, m in adapter.modules.items() if route == "plugin" and not divides(tp, m.r)]


def _held_ranks(adapter: Adapter, tp: int, route: str) -> dict[str, int]:
    """The rank each GPU holds per adapted module: exactly r/TP for block-diagonal modules through the plugin, r
    otherwise (and for a rank TP does not divide, which `_rank_check` refuses)."""
    held = {}
    for name, m in adapter.modules.items():
        split = route == "plugin" and _is_bd(m) and divides(tp, m.r)
        held[name] = per_rank_rank(m.r, tp) if split else m.r
    return held


def _rank_check(adapter: Adapter, tp: int, route: str, max_lora_rank: int | None, checks: list) -> int:
    """The `--max-lora-rank` to serve with (given, or the smallest vLLM accepts for what each rank holds: r/TP
    through the plugin, r otherwise); records the rank check."""
    held = _held_ranks(adapter, tp, route)
    per_rank = max(held.values())
    rank = max(m.r for m in adapter.modules.values())
    R = max_lora_rank if max_lora_rank is not None else vllm_max_lora_rank(per_rank)
    plain = sorted({n.rsplit(".", 1)[-1] for n, r in held.items() if r == rank} if route == "plugin" and tp > 1
                   else set())
    unsplit = _unsplit(adapter, tp, route)
    if unsplit:
        r = adapter.modules[unsplit[0]].r
        add_check(checks, "rank", "fail", rank_split_refusal(unsplit[0], r, tp, adapter.bd_nblocks))
    elif R not in VLLM_MAX_LORA_RANKS:
        add_check(checks, "rank", "fail", f"--max-lora-rank {R} is not accepted by vLLM (allowed: "
               f"{list(VLLM_MAX_LORA_RANKS)})")
    elif per_rank > R:
        why = split_rank(rank, tp) if route == "plugin" and not plain else "the adapter's rank, held whole"
        add_check(checks, "rank", "fail", max_rank_refusal(per_rank, R, why))
    elif route == "plugin":
        extra = f"; plain LoRA modules {plain} hold the full rank {rank}" if plain else ""
        add_check(checks, "rank", "ok", f"each rank holds a rank-{per_rank} LoRA (r={rank} / TP {tp}){extra}; "
               f"--max-lora-rank {R}")
    else:
        add_check(checks, "rank", "ok", f"rank {rank}; --max-lora-rank {R}")
    return R


def _blocks_check(adapter: Adapter, tp: int, path: str, checks: list, heads: int | None = None,
                  kv: int | None = None) -> None:
    """The plugin serves TP = nblocks natively, a TP dividing nblocks re-blocked at load, and TP 1."""
    nblocks = adapter.bd_nblocks
    refusal = nblocks_refusal(tp, nblocks, servable_degrees(nblocks, heads, kv), dense_export(path))
    if refusal:
        add_check(checks, "nblocks", "fail", refusal)
    else:
        how = "natively" if nblocks == tp else f"re-blocked to {tp} at load by the plugin"
        add_check(checks, "nblocks", "ok", f"nblocks {nblocks} at TP {tp}: served {how}")
    unknown, sides, kinds = set(), {}, set()  # sides: (role, the side vLLM splits) -> kinds
    for name, m in adapter.modules.items():
        kind, role = name.rsplit(".", 1)[-1], m.bd_role
        served = (VLLM_FUSED_MODULES.get(kind) or VLLM_BD_MODULES.get(kind)) if m.structure is not None \
            else VLLM_BD_MODULES.get(kind)
        fused = m.structure is not None and m.structure.get("segments", [0])[1:]
        kinds.add(f"{kind} (segments {list(m.segments)})" if fused else kind)
        if role is not None and served is None:
            unknown.add(kind)
        elif role is not None and role != served:
            sides.setdefault((role, side_of_role(served)), set()).add(kind)
    for (role, side), wrong in sorted(sides.items()):
        add_check(checks, "modules", "fail", side_refusal(f"modules {sorted(wrong)}", role, side, serve_dense(path)))
    if unknown:
        add_check(checks, "modules", "fail", (
            f"modules {sorted(unknown)} are not q/k/v/o/gate/up/down (or fused qkv_proj / gate_up_proj) projections, "
            f"the layers the plugin serves rank-locally; serve as plain LoRA: {dense_export(path)}"))
    if not unknown and not sides:
        add_check(checks, "modules", "ok", f"{sorted(kinds)}: vLLM's column, merged-column, QKV and row-parallel LoRA "
               "layers, each rank holding its own blocks")


def _heads_check(config, tp: int, route: str, nblocks: int, path: str) -> Check:
    heads, kv = head_counts(config)
    if not base_shards(heads, kv, tp):
        return Check(
            "kv_heads",
            "fail",
            f"vLLM cannot shard the base model at TP {tp}: num_attention_heads={heads}, "
            f"num_key_value_heads={kv}; use a TP that divides {heads} and {kv} "
            f"(TP in {splitting_degrees(kv, heads=heads, kv=kv)})",
        )
    if route != "plugin":
        return Check(
            "kv_heads", "ok", f"{heads} heads / {kv} KV heads at TP {tp} (plain LoRA: no block alignment needed)"
        )
    refusal = kv_heads_refusal("the base's K/V projections", tp, kv, nblocks, serve_dense(path))
    if refusal:  # the base shards (above), so TP above the KV heads replicates them
        return Check("kv_heads", "fail", refusal)
    return Check("kv_heads", "ok", f"{heads} heads / {kv} KV heads split evenly over TP {tp}")


# The engines a model card writes commands for: vLLM (CUDA) with the plugin active, and vLLM without it.
_CARD_PLUGIN = EngineStatus("vllm", SUPPORTED_VLLM_VERSIONS[-1], True, "verified", "vLLM with the bdlora plugin.")
_CARD_STOCK = EngineStatus(
    "vllm", SUPPORTED_VLLM_VERSIONS[-1], False, "verified", "vLLM without the bdlora plugin refuses use_bdlora."
)


def runtime_loading_command(adapter: Adapter, base: str, config, dtype: str, host: str, port: int,
                            slots: int) -> str:
    """The server command for an RL run's rollouts (docs/rl.md), with the launcher check-serving prints for the vLLM
    installed here (or the one `vllm_install()` builds): the plugin route at TP = nblocks with its --max-lora-rank,
    run-time loading on, `slots` adapter slots (the run's: the new version loads before the old one unloads, and
    asynchronous rollouts keep the versions in flight), the run's dtype, no adapter at start-up, and on vLLM's CPU
    build at TP above the NUMA nodes the threads it needs to start.
    `base` is what the server loads (a Hub id or a directory)."""
    tp = adapter.bd_nblocks if adapter.has_structure else 1
    plan = serve_plan(adapter, tp, _CARD_PLUGIN, None, config, None, "", "")
    tp_flag = f" --tensor-parallel-size {tp}" if tp > 1 else ""
    engine = serving_status().engine
    cpu_env = ""
    if is_cpu_build(engine):
        # the CPU worker reserves most of RAM for its KV cache unless told a size, and refuses to start when less is
        # free (check-serving's memory check); at TP > 1 on fewer NUMA nodes than ranks it stops at start-up without
        # its threads set (engines.py)
        cpu_env = f"VLLM_CPU_KVCACHE_SPACE={cpu_kv_cache_gib(config, tp, dtype)} "
        cpu_env += f"{cpu_threads_env(tp)} " if tp > numa_nodes() else ""
    return (f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 {cpu_env}{serve_launcher(engine)} {base} --enable-lora{tp_flag} "
            f"--max-lora-rank {plan.R} --max-loras {slots} --dtype {dtype} --host {host} --port {port}")


def cpu_kv_cache_gib(config, tp: int, dtype: str) -> int:
    """GiB of KV cache per rank for vLLM's CPU build (VLLM_CPU_KVCACHE_SPACE): two sequences of the model's whole
    context (vLLM refuses a cache that cannot hold one of max_model_len, its default the model's
    max_position_embeddings; the second is room for a step's rollouts), each rank holding its share of the KV heads,
    in whole GiB, at least 1. SmolLM2-135M in float32 at TP 3: 2 x 8192 tokens x 30 layers x 2 x 1 KV head x 64 x 4
    bytes = 0.25 GiB -> 1."""
    width = {"float32": 4, "float64": 8}.get(dtype, 2)
    text = text_config(config)
    _, kv = head_counts(config)
    per_token = 2 * text.num_hidden_layers * math.ceil((kv or 1) / tp) * (head_dim(config) or 1) * width
    tokens = 2 * (getattr(text, "max_position_embeddings", None) or 4096)
    return max(1, math.ceil(per_token * tokens / 2**30))


def serving_lines(adapter: Adapter, base: str, location: str, hub: bool = False) -> list[str]:
    """The model card's serving section, for the adapter at `location` (a Hub repo id when `hub`, downloaded into a
    directory named like the repo, else its local directory): the plugin route at TP = nblocks and, for engines
    without the plugin, the dense export, with the route rules and naming of `check-serving`, whose line comes first
    (it checks the installed engine)."""
    local = location.rsplit("/", 1)[-1] if hub else location
    fetch = [f"hf download {location} --local-dir {local}"] if hub else []
    served = EMBEDDED_HUB_ID if base == EMBEDDED else base
    if served.startswith("tiny:"):
        return [f"The base `{base}` is a toolkit test model that vLLM cannot load: no serve command applies; serve an "
                "adapter trained on a Hub model or a saved model directory."]
    try:
        config = load_config(base_spec(base))
    except (ValueError, OSError):
        config = None
    tp = adapter.bd_nblocks if adapter.has_structure else 1
    dense = f"{local}-dense"
    plugin = serve_plan(adapter, tp, _CARD_PLUGIN, None, config, None, local, dense)
    stock = serve_plan(adapter, tp, _CARD_STOCK, None, config, None, local, dense)
    check = f"bdlora check-serving {local} --tp {tp} --model {served}   # the exact command for the installed engine"
    if not adapter.has_structure:
        route = plugin if stock.failed else stock
        head = (f"A plain LoRA adapter. {failure(stock)}." if stock.failed
                else "A plain LoRA adapter: any engine with LoRA support serves it, e.g.")
        return [head, "", "```bash", *fetch, check, route.command(served, tp, "vllm serve"), "```"]
    if plugin.failed:
        return [f"Not servable by vLLM with tensor parallelism: {failure(plugin)}."]
    install = (" (installed with vLLM in an environment of their own, not the training one)" if hub
               else f" (installed with vLLM in an environment of their own: `{vllm_install()}`)")
    lines = [
        f"With bdlora-train's vLLM plugin{install}, stock `vllm serve` loads this adapter at "
        f"tensor-parallel degree {tp} (or any divisor of it) and each GPU computes only its own blocks, with no "
        f"collective beyond the base model's; `--max-lora-rank` bounds the rank each GPU holds, r / TP:",
        "",
        "```bash",
        *fetch,
        check,
        plugin.command(served, tp, "vllm serve"),
        "```",
        "",
    ]
    if stock.failed:
        return lines + [f"Without the plugin: {failure(stock)}."]
    return lines + [
        "Released vLLM without the plugin (and SGLang, TGI, llama.cpp) refuses `use_bdlora`; the exact plain-LoRA "
        "export serves there, the same function at the cost of every GPU computing the full rank-r LoRA:",
        "",
        "```bash",
        *fetch,
        f"bdlora export {local} --to dense-lora --out {dense}",
        stock.command(served, tp, "vllm serve"),
        "```",
    ]


def failure(plan: ServePlan) -> str:
    return "; ".join(c.message for c in plan.checks if c.status == "fail")
