"""Serving engines: what vLLM accepts, `bdlora check-serving`, and the serve commands a model card prints.

Everything the toolkit knows about engines lives here, so export.py and hub.py never need the TP simulator or
each other for it.
"""

from __future__ import annotations

from pathlib import Path

from bdlora_train.adapters import Adapter, read_adapter, read_config, verify_shapes
from bdlora_train.errors import AdapterError, ServingError, first_line
from bdlora_train.patterns import BD_A, BD_B
from bdlora_train.roles import head_counts

# vllm.config.lora.MaxLoRARanks: the only values `--max-lora-rank` accepts.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The projections vLLM's BD-LoRA path slices, with the factor it expects to be block-diagonal.
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


def vllm_max_lora_rank(r: int) -> int:
    """The smallest `--max-lora-rank` value vLLM accepts that holds rank r (r itself when none does)."""
    return min([v for v in VLLM_MAX_LORA_RANKS if v >= r] or [r])


def _check(checks: list, name: str, status: str, message: str) -> None:
    checks.append(dict(check=name, status=status, message=message))


def _base_config(adapter: Adapter, base: str | None):
    from bdlora_train.models import load_config

    try:
        return load_config(adapter.base_spec(base)), None
    except (ValueError, OSError) as err:
        return None, first_line(err)


def _served_base(adapter: Adapter, base: str | None) -> str:
    from bdlora_train.models import EMBEDDED, EMBEDDED_HUB_ID

    spec = base or adapter.config.base_model_name_or_path or "BASE_MODEL"
    return EMBEDDED_HUB_ID if spec == EMBEDDED else spec


def _shape_check(adapter: Adapter, config) -> tuple[str, str]:
    """Every adapted module exists in the base model with the adapter's (d_in, d_out); read on the meta device."""
    from bdlora_train.models import meta_model

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
    from bdlora_train.models import base_spec

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
    adapter_path, tp: int, max_lora_rank: int | None = None, base: str | None = None, name: str | None = None
) -> dict:
    """What vLLM's BD-LoRA path assumes, checked one by one; the serve command, or the fixes to apply first."""
    if tp < 1:
        raise ServingError(f"check-serving: --tp {tp}; use a positive TP degree")
    adapter = read_adapter(adapter_path)
    path = adapter.path
    checks: list[dict] = []
    fixes: list[str] = []
    serve_path = str(path.resolve())
    raw = read_config(path)
    ranks = sorted({m.r for m in adapter.modules.values()})
    rank = max(ranks)
    R = max_lora_rank if max_lora_rank is not None else vllm_max_lora_rank(rank)
    bd = adapter.is_bdlora
    dense_out = f"{path}-dense"
    dense_fix = f"bdlora export {path} --to dense-lora --out {dense_out}"

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
    if not bd:
        _check(
            checks, "bdlora", "ok", "plain LoRA adapter: mainline vLLM serves it at any TP (S-LoRA style communication)"
        )
    elif tp == 1:
        _check(
            checks,
            "nblocks",
            "fix",
            f"TP 1: vLLM's BD-LoRA path loads the packed tensors unsliced; at TP 1 there "
            f"is no communication to save, so serve the dense export: {dense_fix}",
        )
        fixes.append(dense_fix)
        serve_path, bd = str(Path(dense_out).resolve()), False
    elif adapter.nblocks == tp:
        _check(
            checks,
            "nblocks",
            "ok",
            f"nblocks {adapter.nblocks} == TP {tp}: the blocks are the TP shards (vLLM assumes nblocks == TP)",
        )
    elif adapter.nblocks % tp == 0:
        fix = f"bdlora export {path} --reblock {tp} --out {path}-nb{tp}"
        _check(
            checks,
            "nblocks",
            "fix",
            f"nblocks {adapter.nblocks} != TP {tp}, but {tp} divides it: vLLM would slice "
            f"wrong blocks (it takes nblocks == TP); re-block first: {fix}",
        )
        fixes.append(fix)
        serve_path = str(Path(f"{path}-nb{tp}").resolve())
    else:
        _check(
            checks,
            "nblocks",
            "fail",
            f"TP {tp} does not divide nblocks {adapter.nblocks}: blocks straddle the TP shards; "
            f"serve at TP in {adapter.tp_degrees()}, or as plain LoRA: {dense_fix}",
        )

    if R not in VLLM_MAX_LORA_RANKS:
        _check(
            checks,
            "rank",
            "fail",
            f"--max-lora-rank {R} is not accepted by vLLM (allowed: {list(VLLM_MAX_LORA_RANKS)})",
        )
    elif rank > R:
        _check(
            checks,
            "rank",
            "fail",
            f"adapter rank {rank} > --max-lora-rank {R}: vLLM refuses it; use --max-lora-rank "
            f"{vllm_max_lora_rank(rank) if rank <= VLLM_MAX_LORA_RANKS[-1] else '(none fits)'}",
        )
    elif bd and ranks != [R]:
        if len(ranks) == 1 and rank in VLLM_MAX_LORA_RANKS:
            fix_text = f"serve with --max-lora-rank {rank}"
        else:
            usable = [v for v in VLLM_MAX_LORA_RANKS if v % adapter.nblocks == 0]
            retrain = (
                f"retrain with one rank in {usable}"
                if usable
                else f"no vLLM max-lora-rank is a multiple of nblocks={adapter.nblocks}"
            )
            fix_text = f"{retrain}, or serve as plain LoRA: {dense_fix}"
        _check(
            checks,
            "rank",
            "fail",
            f"adapter rank(s) {ranks} != --max-lora-rank {R}: vLLM's BD-LoRA path slices the "
            f"packed tensors by max-lora-rank/TP, so ranks > 0 would read wrong rows; {fix_text}",
        )
    else:
        _check(checks, "rank", "ok", f"rank {rank} fits --max-lora-rank {R}")

    config, error = _base_config(adapter, base)
    if config is None:
        _check(checks, "kv_heads", "warn", f"base config not readable ({error}); pass --base to check head counts")
    else:
        heads, kv = head_counts(config)
        if heads % tp or (kv % tp and tp % kv):
            _check(
                checks,
                "kv_heads",
                "fail",
                f"vLLM cannot shard the base model at TP {tp}: num_attention_heads={heads}, "
                f"num_key_value_heads={kv}; use a TP that divides {heads} and {kv}",
            )
        elif not bd:
            _check(
                checks,
                "kv_heads",
                "ok",
                f"{heads} heads / {kv} KV heads at TP {tp} (plain LoRA: no block alignment needed)",
            )
        elif kv % tp:
            _check(
                checks,
                "kv_heads",
                "fail",
                f"TP {tp} does not divide num_attention_heads={heads} / num_key_value_heads={kv}: "
                f"vLLM replicates KV heads and the K/V blocks no longer line up; serve at a TP dividing {kv}, "
                f"or: {dense_fix}",
            )
        else:
            _check(checks, "kv_heads", "ok", f"{heads} heads / {kv} KV heads split evenly over TP {tp}")

    if config is not None:
        _check(checks, "shapes", *_shape_check(adapter, config))

    if bd:
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
                f"modules {wrong} are not q/k/v/o/gate/up/down projections with the roles vLLM "
                f"slices (bd_b for q,k,v,gate,up; bd_a for o,down); serve as plain LoRA: {dense_fix}",
            )
        else:
            kinds = sorted({n.rsplit(".", 1)[-1] for n in adapter.modules})
            _check(checks, "modules", "ok", f"{kinds}: projections vLLM's BD-LoRA path shards")

    targets = raw.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    embed_targets = [t for t in targets if any(k in t for k in ("embed", "lm_head", "wte"))]
    if raw.get("modules_to_save") or adapter.extra_tensors or raw.get("trainable_token_indices") or embed_targets:
        what = raw.get("modules_to_save") or embed_targets or sorted(adapter.extra_tensors)[:3] or "trainable tokens"
        _check(
            checks,
            "embeddings",
            "fail",
            f"the adapter changes {what} (modules_to_save / embeddings / lm_head), which "
            f"vLLM's LoRA loading does not apply; serve a merged model: bdlora export {path} --to merged --out "
            f"{path}-merged",
        )
    else:
        _check(checks, "embeddings", "ok", "no modules_to_save, embedding or lm_head changes")

    _check(checks, "tokenizer", *_tokenizer_check(adapter, config))
    served = _served_base(adapter, base)
    if served.startswith("tiny:") or served == "BASE_MODEL":
        _check(
            checks, "base", "warn", f"base {served!r} is no model vLLM can load; pass --base with its Hub id or path"
        )

    statuses = {c["status"] for c in checks}
    ready = not statuses & {"fail", "fix"}
    lora_name = name or path.name
    command = None
    if "fail" not in statuses:
        flags = " --block-diagonal-sharded-loras" if bd else ""
        command = (
            f"vllm serve {served} --enable-lora --tensor-parallel-size {tp} "
            f"--max-lora-rank {R}{flags} --lora-modules {lora_name}={serve_path}"
        )
    return dict(
        adapter=str(path),
        tp=tp,
        nblocks=adapter.nblocks,
        bdlora=adapter.is_bdlora,
        r=rank,
        max_lora_rank=R,
        ready=ready,
        checks=checks,
        fixes=fixes,
        command=command,
    )


def serving_lines(base: str, name: str, r: int, nblocks: int, is_bdlora: bool) -> list[str]:
    """vLLM commands: the BD-LoRA path (PR #28136) when the rank allows it, and the dense export for any engine."""
    dense_rank = vllm_max_lora_rank(r)
    local = "ADAPTER_DIR"  # bdlora commands work on a local copy of the adapter
    fetch = [f"hf download {name} --local-dir {local}"] if "/" in name and not Path(name).exists() else []
    dense = [
        "```bash",
        *fetch,
        f"bdlora export {local} --to dense-lora --out {local}-dense",
        f"vllm serve {base} --enable-lora --lora-modules lora={local}-dense --max-lora-rank {dense_rank}",
        "```",
    ]
    if not is_bdlora:
        return [
            "A plain LoRA adapter: any engine with LoRA support serves it, e.g.",
            "",
            "```bash",
            f"vllm serve {base} --enable-lora --lora-modules lora={name} --max-lora-rank {dense_rank}",
            "```",
        ]
    lines = [f"Check the adapter against vLLM's BD-LoRA path first: `bdlora check-serving {local} --tp {nblocks}`.", ""]
    if r in VLLM_MAX_LORA_RANKS:
        lines += [
            f"With vLLM's block-diagonal LoRA support (PR #28136) at tensor-parallel degree {nblocks}, each GPU "
            "applies "
            "its own blocks with no extra communication:",
            "",
            "```bash",
            f"vllm serve {base} --enable-lora --lora-modules bdlora={name} \\",
            f"    --tensor-parallel-size {nblocks} --max-lora-rank {r} --block-diagonal-sharded-loras",
            "```",
            "",
            f"Keep `--max-lora-rank` equal to the adapter rank ({r}; a larger value mis-slices the blocks) and "
            f"`--tensor-parallel-size` equal to nblocks ({nblocks}); a TP degree D that divides {nblocks} needs "
            f"`bdlora export {local} --reblock D --out {local}-tpD` first.",
        ]
    else:
        lines += [
            f"r = {r} is not one of vLLM's --max-lora-rank values {list(VLLM_MAX_LORA_RANKS)}, and vLLM's "
            "BD-LoRA path needs --max-lora-rank equal to the rank, so serve the dense export below "
            f"(or retrain with r in that list and a multiple of {nblocks})."
        ]
    lines += [
        "",
        "Engines without BD-LoRA support (mainline vLLM rejects `use_bdlora`; SGLang, TGI, llama.cpp) serve the "
        "equivalent plain LoRA, exactly the same function:",
        "",
    ] + dense
    return lines
