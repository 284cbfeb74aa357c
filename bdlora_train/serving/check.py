"""`bdlora check-serving`, and the serve commands a model card prints.

Released vLLM refuses adapters with `use_bdlora` (`vllm/lora/peft_helper.py`, `PEFTHelper._validate_features`).
With this package's vLLM plugin (bdlora_train/vllm_plugin, entry point `vllm.general_plugins`) a tested vLLM
loads them and each TP rank holds and computes only its own rank-slice: a local LoRA of rank r/TP, so
`--max-lora-rank` bounds r/TP. Without the plugin, the exact dense-lora export serves anywhere, at the cost of
every rank computing the full rank-r shrink (column-parallel) or full-width expand (row-parallel) of vLLM's
default LoRA sharding. What the toolkit knows about the installed engine is in engines.py.
"""

from __future__ import annotations

from pathlib import Path

from bdlora_train.adapters.reader import Adapter, read_adapter, read_config
from bdlora_train.adapters.shapes import verify_shapes
from bdlora_train.core.errors import AdapterError, ServingError, first_line
from bdlora_train.core.heads import head_counts
from bdlora_train.core.roles import BD_A, BD_B
from bdlora_train.models import EMBEDDED, EMBEDDED_HUB_ID, base_spec, load_config, meta_model
from bdlora_train.serving.engines import PLUGIN_INSTALL, VLLM_MAX_LORA_RANKS, serving_status, vllm_max_lora_rank

# The projections the plugin serves (vLLM's column, merged-column, QKV and row-parallel LoRA layers of Llama-style
# models), with the factor that must be block-diagonal on each.
VLLM_BD_MODULES = {
    "q_proj": BD_B,
    "k_proj": BD_B,
    "v_proj": BD_B,
    "gate_proj": BD_B,
    "up_proj": BD_B,
    "o_proj": BD_A,
    "down_proj": BD_A,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "added_tokens.json", "vocab.json")


def _check(checks: list, name: str, status: str, message: str) -> None:
    checks.append(dict(check=name, status=status, message=message))


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


def check_serving(
    adapter_path,
    tp: int,
    max_lora_rank: int | None = None,
    base: str | None = None,
    name: str | None = None,
    engine: dict | None = None,
) -> dict:
    """Can the adapter be served at TP `tp`, on which route, with which exact command; every assumption checked.

    Routes: "plugin" (a BD-LoRA adapter through this package's vLLM plugin: each rank computes its own blocks),
    "dense-lora" (the exact plain-LoRA export, for an engine without the plugin), "plain-lora" (a plain LoRA
    adapter). `engine` is `serving_status()` (the installed vLLM; injectable for tests). The printed command is
    one that works on the installed engine, or after the fixes listed with it.
    """
    if tp < 1:
        raise ServingError(f"check-serving: --tp {tp}; use a positive TP degree")
    engine = engine if engine is not None else serving_status()
    adapter = read_adapter(adapter_path)
    path = adapter.path
    checks: list[dict] = []
    fixes: list[str] = []
    raw = read_config(path)
    rank = max(m.r for m in adapter.modules.values())
    dense_out = f"{path}-dense"
    dense_fix = f"bdlora export {path} --to dense-lora --out {dense_out}"
    route = _route(adapter, engine, checks)
    serve_path = str(path.resolve())
    if route == "dense-lora":
        fixes.append(dense_fix)
        serve_path = str(Path(dense_out).resolve())

    if base is not None:
        _check(checks, "base", *_base_identity_check(adapter, base))
    if raw.get("use_dora") or raw.get("lora_bias"):
        _check(
            checks,
            "format",
            "fail",
            "DoRA / lora_bias adapters are not served by vLLM's LoRA path; merge them: "
            f"bdlora export {path} --to merged --out {path}-merged",
        )
    if route == "plugin":
        _blocks_check(adapter, tp, dense_fix, checks)
    R = _rank_check(rank, tp, route, max_lora_rank, checks)
    config, error = _base_config(adapter, base)
    if config is None:
        _check(checks, "kv_heads", "warn", f"base config not readable ({error}); pass --model to check head counts")
    else:
        _check(checks, "kv_heads", *_heads_check(config, tp, route, dense_fix))
        _check(checks, "shapes", *_shape_check(adapter, config))
    _check(checks, "embeddings", *_embeddings_check(adapter, raw, path))
    _check(checks, "tokenizer", *_tokenizer_check(adapter, config))
    served = _served_base(adapter, base)
    if served.startswith("tiny:") or served == "BASE_MODEL":
        _check(
            checks, "base", "warn", f"base {served!r} is no model vLLM can load; pass --model with its Hub id or path"
        )

    statuses = {c["status"] for c in checks}
    command = None
    if "fail" not in statuses:
        command = (
            f"vllm serve {served} --enable-lora --tensor-parallel-size {tp} --max-lora-rank {R} "
            f"--lora-modules {name or path.name}={serve_path}"
        )
    return dict(
        adapter=str(path),
        tp=tp,
        nblocks=adapter.nblocks,
        bdlora=adapter.is_bdlora,
        r=rank,
        route=route,
        engine=engine,
        max_lora_rank=R,
        ready=not statuses & {"fail", "fix"},
        checks=checks,
        fixes=fixes,
        command=command,
    )


def _rank_check(rank: int, tp: int, route: str, max_lora_rank: int | None, checks: list) -> int:
    """The `--max-lora-rank` to serve with (given, or the smallest vLLM accepts for what each rank holds: r/TP
    through the plugin, r otherwise); records the rank check."""
    per_rank = -(-rank // tp) if route == "plugin" else rank  # what each rank holds (ceil)
    R = max_lora_rank if max_lora_rank is not None else vllm_max_lora_rank(per_rank)
    if R not in VLLM_MAX_LORA_RANKS:
        _check(
            checks,
            "rank",
            "fail",
            f"--max-lora-rank {R} is not accepted by vLLM (allowed: {list(VLLM_MAX_LORA_RANKS)})",
        )
    elif per_rank > R:
        what = f"rank r/TP = {rank}/{tp}" if route == "plugin" else f"rank {rank}"
        fix = f"use --max-lora-rank {vllm_max_lora_rank(per_rank)}"
        _check(checks, "rank", "fail", f"each rank holds {what} = {per_rank} > --max-lora-rank {R}; {fix}")
    else:
        held = f"each rank holds a rank-{per_rank} LoRA (r={rank} / TP {tp})" if route == "plugin" else f"rank {rank}"
        _check(checks, "rank", "ok", f"{held}; --max-lora-rank {R}")
    return R


def _route(adapter: Adapter, engine: dict, checks: list) -> str:
    """How this adapter is served by the installed engine (see check_serving); records the engine check."""
    if not adapter.is_bdlora:
        _check(checks, "engine", "ok", f"plain LoRA adapter: any vLLM serves it ({engine['message']})")
        return "plain-lora"
    if engine["active"]:
        _check(checks, "engine", "ok", engine["message"] + " Each rank computes only its own blocks.")
        return "plugin"
    if engine["engine"] is None:
        _check(
            checks,
            "engine",
            "warn",
            f"vLLM is not installed here; where you serve: {PLUGIN_INSTALL} "
            f"(vLLM {', '.join(engine['tested_versions'])}), then the command below",
        )
        return "plugin"
    _check(
        checks,
        "engine",
        "fix",
        f"{engine['message']} Until then the exact dense-lora export serves on it; every "
        "rank then computes the full rank-r LoRA shrink (column-parallel) or expand (row-parallel) instead of its "
        "own blocks",
    )
    return "dense-lora"


def _blocks_check(adapter: Adapter, tp: int, dense_fix: str, checks: list) -> None:
    """The plugin serves TP = nblocks natively, a TP dividing nblocks re-blocked at load, and TP 1."""
    if adapter.nblocks % tp:
        _check(
            checks,
            "nblocks",
            "fail",
            f"TP {tp} does not divide nblocks {adapter.nblocks}: blocks would straddle "
            f"the TP shards; serve at TP in {adapter.tp_degrees()}, or as plain LoRA: {dense_fix}",
        )
    else:
        how = "natively" if adapter.nblocks == tp else f"re-blocked to {tp} at load by the plugin"
        _check(checks, "nblocks", "ok", f"nblocks {adapter.nblocks} at TP {tp}: served {how}")
    wrong = sorted(
        {
            n.rsplit(".", 1)[-1]
            for n, m in adapter.modules.items()
            if VLLM_BD_MODULES.get(n.rsplit(".", 1)[-1]) != m.role
        }
    )
    if wrong:
        _check(
            checks,
            "modules",
            "fail",
            f"modules {wrong} are not q/k/v/o/gate/up/down projections with the roles "
            f"the plugin serves (bd_b for q,k,v,gate,up; bd_a for o,down); serve as plain LoRA: {dense_fix}",
        )
    else:
        kinds = sorted({n.rsplit(".", 1)[-1] for n in adapter.modules})
        _check(checks, "modules", "ok", f"{kinds}: vLLM's column, merged-column, QKV and row-parallel LoRA layers")


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


def serving_lines(base: str, name: str, r: int, nblocks: int, is_bdlora: bool) -> list[str]:
    """The model card's serving section: vLLM with the plugin at TP = nblocks, and the dense export for any engine."""
    local = "ADAPTER_DIR"  # bdlora commands work on a local copy of the adapter
    fetch = [f"hf download {name} --local-dir {local}"] if "/" in name and not Path(name).exists() else []
    if not is_bdlora:
        return [
            "A plain LoRA adapter: any engine with LoRA support serves it, e.g.",
            "",
            "```bash",
            f"vllm serve {base} --enable-lora --lora-modules lora={name} --max-lora-rank {vllm_max_lora_rank(r)}",
            "```",
        ]
    per_rank = -(-r // nblocks)
    return [
        f"With bdlora-train's vLLM plugin (`{PLUGIN_INSTALL}`), stock `vllm serve` loads this adapter at "
        f"tensor-parallel degree {nblocks} (or any divisor of it) and each GPU computes only its own blocks, with "
        f"no collective beyond the base model's; `--max-lora-rank` bounds the rank each GPU holds, r / TP:",
        "",
        "```bash",
        *fetch,
        f"bdlora check-serving {local} --tp {nblocks}      # prints the exact command for the installed engine",
        f"vllm serve {base} --enable-lora --tensor-parallel-size {nblocks} --max-lora-rank "
        f"{vllm_max_lora_rank(per_rank)} --lora-modules bdlora={local}",
        "```",
        "",
        "Released vLLM without the plugin (and SGLang, TGI, llama.cpp) refuses `use_bdlora`; the exact plain-LoRA "
        "export serves there, the same function at the cost of every GPU computing the full rank-r LoRA:",
        "",
        "```bash",
        *fetch,
        f"bdlora export {local} --to dense-lora --out {local}-dense",
        f"vllm serve {base} --enable-lora --lora-modules lora={local}-dense --max-lora-rank {vllm_max_lora_rank(r)}",
        "```",
    ]
