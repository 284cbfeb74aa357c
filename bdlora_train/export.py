"""Exact exports of a BD-LoRA adapter, and whether vLLM's BD-LoRA path can serve it.

  dense-lora  plain LoRA at the same rank r: the block-diagonal factor written out densely (zeros off the
              blocks), no `use_bdlora`, so any PEFT, mainline vLLM or TGI loads it. Same delta, same logits.
  reblock N   nblocks k·N -> N: each group of k consecutive blocks becomes one block (a block-diagonal matrix
              with k·N blocks is block-diagonal with N blocks), re-packed in PEFT's layout; for serving at TP N.
  merged      W + s·B·A written into the base model, saved as safetensors with save_pretrained.

`check-serving` checks the assumptions of vLLM's `--block-diagonal-sharded-loras` (PR #28136, NOTES §4) and
prints the exact `vllm serve` command, or the export that fixes the adapter first.
"""

from __future__ import annotations

import argparse
import json
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bdlora_train.adapters import CONFIG_NAME, WEIGHTS_NAME, Adapter, read_adapter
from bdlora_train.files import replace_dir
from bdlora_train.roles import BD_A, BD_B

EXPORTS = ("dense-lora", "merged")
_PREFIX = "base_model.model."
# Other files an adapter directory may carry (tokenizer, model card) are copied; other weights never are.
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".npy", ".npz")
# vllm.config.lora.MaxLoRARanks: the only values `--max-lora-rank` accepts.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The projections vLLM's BD-LoRA path slices, with the factor it expects to be block-diagonal.
VLLM_BD_MODULES = {
    "q_proj": BD_B, "k_proj": BD_B, "v_proj": BD_B, "gate_proj": BD_B, "up_proj": BD_B,
    "o_proj": BD_A, "down_proj": BD_A,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "added_tokens.json", "vocab.json")


class ExportError(ValueError):
    """An export or serving request the adapter cannot satisfy."""


# --------------------------------------------------------------------------------------------- writing


@contextmanager
def atomic_dir(out, force: bool = False):
    """Yield a temporary sibling of `out`; rename it to `out` only when the block finished without error."""
    out = Path(out)
    if out.exists() and not force:
        raise ExportError(f"export: --out {out} already exists; pass --force to replace it or choose another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _copy_side_files(src: Path, dst: Path) -> None:
    for path in src.iterdir():
        if path.is_file() and path.name not in (CONFIG_NAME, WEIGHTS_NAME) and not path.name.endswith(_SKIP_SUFFIXES):
            shutil.copy2(path, dst / path.name)


def _write_adapter(adapter: Adapter, config: dict, tensors: dict, out, force: bool) -> Path:
    with atomic_dir(out, force) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        _copy_side_files(adapter.path, tmp)
    return Path(out)


def _raw(adapter: Adapter) -> tuple[dict, dict]:
    config = json.loads((adapter.path / CONFIG_NAME).read_text())
    if config.get("use_dora") or config.get("lora_bias"):
        raise ExportError(f"export: {adapter.path} uses DoRA or lora_bias; only plain (BD-)LoRA factors can be exported exactly")
    return config, load_file(str(adapter.path / WEIGHTS_NAME))


def _module_of(key: str) -> tuple[str, str] | None:
    for factor in ("lora_A", "lora_B"):
        marker = f".{factor}.weight"
        if key.endswith(marker):
            return key[: -len(marker)].removeprefix(_PREFIX), factor
    return None


# --------------------------------------------------------------------------------------------- conversions


def repack(packed: torch.Tensor, nblocks: int, n: int) -> torch.Tensor:
    """PEFT's packed block-diagonal weight (blocks stacked along dim 0) with nblocks -> n blocks."""
    k = nblocks // n
    chunks = packed.chunk(nblocks, dim=0)
    return torch.cat([torch.block_diag(*chunks[j * k:(j + 1) * k]) for j in range(n)], dim=0)


def dense_lora(adapter: Adapter) -> tuple[dict, dict]:
    """(adapter_config dict, tensors) of the same adapter as plain LoRA at rank r."""
    config, tensors = _raw(adapter)
    config.pop("use_bdlora", None)  # absent rather than null: engines that know the key reject it
    out = {}
    for key, tensor in tensors.items():
        hit = _module_of(key)
        if hit and hit[0] in adapter.modules:
            module = adapter.modules[hit[0]]
            tensor = module.dense_A() if hit[1] == "lora_A" else module.dense_B()
        out[key] = tensor.contiguous()
    return config, out


def reblock(adapter: Adapter, n: int) -> tuple[dict, dict]:
    """(adapter_config dict, tensors) with nblocks = n, for serving at TP n."""
    if not adapter.is_bdlora:
        raise ExportError(f"export: {adapter.path} is a plain LoRA adapter (no use_bdlora); --reblock needs a BD-LoRA adapter")
    if n < 1 or adapter.nblocks % n:
        raise ExportError(
            f"export: --reblock {n} does not divide nblocks={adapter.nblocks}: blocks can only be merged in whole groups; "
            f"use --reblock in {adapter.tp_degrees()}, or --to dense-lora"
        )
    config, tensors = _raw(adapter)
    config["use_bdlora"] = {**config["use_bdlora"], "nblocks": n}
    out = {}
    for key, tensor in tensors.items():
        hit = _module_of(key)
        role = adapter.modules[hit[0]].role if hit and hit[0] in adapter.modules else None
        if (role == BD_A and hit[1] == "lora_A") or (role == BD_B and hit[1] == "lora_B"):
            tensor = repack(tensor, adapter.nblocks, n)
        out[key] = tensor.contiguous()
    return config, out


def merge_into(model, adapter: Adapter):
    """Add s·B·A (dense, fp32) to every adapted Linear of `model` and load modules_to_save weights; in place."""
    from torch import nn

    config, _ = _raw(adapter)
    with torch.no_grad():
        for name, module in adapter.modules.items():
            try:
                layer = model.get_submodule(name)
            except AttributeError:
                raise ExportError(f"export: adapter module {name} is not in the base model; pass the right --base") from None
            if not isinstance(layer, nn.Linear) or tuple(layer.weight.shape) != (module.d_out, module.d_in):
                raise ExportError(
                    f"export: {name} of the base model is {type(layer).__name__} {tuple(getattr(layer, 'weight', torch.empty(0)).shape)}, "
                    f"the adapter expects Linear ({module.d_out}, {module.d_in}); pass the right --base"
                )
            layer.weight.add_(module.delta_weight().to(layer.weight.dtype))
        params = dict(model.named_parameters())
        for key, tensor in adapter.extra_tensors.items():
            name = key.removeprefix(_PREFIX)
            if name not in params or params[name].shape != tensor.shape:
                raise ExportError(f"export: adapter tensor {key} matches no parameter of the base model; cannot merge it")
            params[name].copy_(tensor.to(params[name].dtype))
    model.name_or_path = f"{config.get('base_model_name_or_path')}+{adapter.path.name}"
    return model


def export(adapter_path, out, to: str | None = None, reblock_to: int | None = None, base=None, force: bool = False) -> Path:
    """`bdlora export`: one of to="dense-lora", to="merged" (needs `base`: a spec or a loaded model) or reblock_to=N."""
    if (to is None) == (reblock_to is None):
        raise ExportError("export: give exactly one of --to {dense-lora,merged} or --reblock N")
    if to is not None and to not in EXPORTS:
        raise ExportError(f"export: --to {to!r}; use one of {EXPORTS}")
    adapter = read_adapter(adapter_path)
    if Path(out).resolve() == adapter.path.resolve():
        raise ExportError(f"export: --out {out} is the adapter itself; write the export to another directory")
    if reblock_to is not None:
        return _write_adapter(adapter, *reblock(adapter, reblock_to), out, force)
    if to == "dense-lora":
        return _write_adapter(adapter, *dense_lora(adapter), out, force)
    if Path(out).exists() and not force:  # fail before loading a model
        raise ExportError(f"export: --out {out} already exists; pass --force to replace it or choose another directory")
    tokenizer = None
    if base is None or isinstance(base, str):
        from bdlora_train.models import load_model
        from bdlora_train.tp import base_spec

        model, tokenizer = load_model(base_spec(adapter, base))
    else:
        model = base
    merge_into(model, adapter)
    with atomic_dir(out, force) as tmp:
        model.save_pretrained(str(tmp))  # safetensors (transformers never writes pickles here)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return Path(out)


def cli(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bdlora export", description="Exact exports of a BD-LoRA adapter.")
    parser.add_argument("adapter", help="adapter directory (adapter_config.json + adapter_model.safetensors)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--to", choices=EXPORTS, help="dense-lora: plain LoRA for any engine; merged: a full model")
    which.add_argument("--reblock", type=int, metavar="N", help="nblocks k*N -> N (for serving at TP N)")
    parser.add_argument("--out", required=True, help="output directory (written atomically)")
    parser.add_argument("--base", help="base model spec for --to merged (default: the adapter's base_model_name_or_path)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    out = export(args.adapter, args.out, to=args.to, reblock_to=args.reblock, base=args.base, force=args.force)
    what = f"nblocks {args.reblock}" if args.reblock else args.to
    print(f"wrote {what} export of {args.adapter} to {out}")
    return 0


# --------------------------------------------------------------------------------------------- check-serving


def _check(checks: list, name: str, status: str, message: str) -> None:
    checks.append(dict(check=name, status=status, message=message))


def _base_config(adapter: Adapter, base: str | None):
    from bdlora_train.models import load_config
    from bdlora_train.tp import base_spec

    try:
        return load_config(base_spec(adapter, base)), None
    except (ValueError, OSError) as err:
        return None, str(err).splitlines()[0]


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
        return "warn", f"could not build the base model from its config ({str(err).splitlines()[0][:120]})"
    for name, module in adapter.modules.items():
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            return "fail", f"adapter module {name} does not exist in the base model; pass the base it was trained on"
        shape = (getattr(layer, "in_features", None), getattr(layer, "out_features", None))
        if shape != (module.d_in, module.d_out):
            return "fail", (f"{name}: base Linear is {shape[0]} -> {shape[1]}, the adapter was trained for "
                            f"{module.d_in} -> {module.d_out}; pass the base it was trained on")
    return "ok", f"all {len(adapter.modules)} adapted modules match the base model's shapes"


def _tokenizer_check(adapter: Adapter, config) -> tuple[str, str]:
    """(status, message) about tokenizer files in the adapter directory vs the base vocabulary."""
    if not any((adapter.path / f).is_file() for f in _TOKENIZER_FILES):
        return "ok", "no tokenizer files in the adapter: the base tokenizer applies"
    vocab = getattr(config.get_text_config(), "vocab_size", None) if config is not None else None
    try:
        from transformers import AutoTokenizer

        size = len(AutoTokenizer.from_pretrained(str(adapter.path), trust_remote_code=False))
    except (OSError, ValueError) as err:
        return "warn", f"tokenizer files present but unreadable ({str(err).splitlines()[0][:120]})"
    if vocab is None:
        return "warn", f"tokenizer files present ({size} tokens); base vocabulary unknown, pass --base to compare"
    if size > vocab:
        return "fail", (f"the adapter's tokenizer has {size} tokens, {size - vocab} beyond the base vocabulary ({vocab}); "
                        f"vLLM LoRA cannot add tokens; serve a merged model with its tokenizer")
    return "ok", f"tokenizer files present, {size} tokens within the base vocabulary ({vocab})"


def check_serving(adapter_path, tp: int, max_lora_rank: int | None = None, base: str | None = None,
                  name: str | None = None) -> dict:
    """What vLLM's BD-LoRA path assumes, checked one by one; the serve command, or the fixes to apply first."""
    if tp < 1:
        raise ExportError(f"check-serving: --tp {tp}; use a positive TP degree")
    adapter = read_adapter(adapter_path)
    path = adapter.path
    checks: list[dict] = []
    fixes: list[str] = []
    serve_path = str(path.resolve())
    raw = json.loads((path / CONFIG_NAME).read_text())
    ranks = sorted({m.r for m in adapter.modules.values()})
    rank = max(ranks)
    R = max_lora_rank if max_lora_rank is not None else min([v for v in VLLM_MAX_LORA_RANKS if v >= rank] or [rank])
    bd = adapter.is_bdlora
    dense_out = f"{path}-dense"
    dense_fix = f"bdlora export {path} --to dense-lora --out {dense_out}"

    if raw.get("use_dora") or raw.get("lora_bias"):
        _check(checks, "format", "fail", "DoRA / lora_bias adapters are not served by vLLM's LoRA path; merge them: "
               f"bdlora export {path} --to merged --out {path}-merged")
    if not bd:
        _check(checks, "bdlora", "ok", "plain LoRA adapter: mainline vLLM serves it at any TP (S-LoRA style communication)")
    elif tp == 1:
        _check(checks, "nblocks", "fix", f"TP 1: vLLM's BD-LoRA path loads the packed tensors unsliced; at TP 1 there "
               f"is no communication to save, so serve the dense export: {dense_fix}")
        fixes.append(dense_fix)
        serve_path, bd = str(Path(dense_out).resolve()), False
    elif adapter.nblocks == tp:
        _check(checks, "nblocks", "ok", f"nblocks {adapter.nblocks} == TP {tp}: the blocks are the TP shards (vLLM assumes nblocks == TP)")
    elif adapter.nblocks % tp == 0:
        fix = f"bdlora export {path} --reblock {tp} --out {path}-nb{tp}"
        _check(checks, "nblocks", "fix", f"nblocks {adapter.nblocks} != TP {tp}, but {tp} divides it: vLLM would slice "
               f"wrong blocks (it takes nblocks == TP); re-block first: {fix}")
        fixes.append(fix)
        serve_path = str(Path(f"{path}-nb{tp}").resolve())
    else:
        _check(checks, "nblocks", "fail", f"TP {tp} does not divide nblocks {adapter.nblocks}: blocks straddle the TP shards; "
               f"serve at TP in {adapter.tp_degrees()}, or as plain LoRA: {dense_fix}")

    if R not in VLLM_MAX_LORA_RANKS:
        _check(checks, "rank", "fail", f"--max-lora-rank {R} is not accepted by vLLM (allowed: {list(VLLM_MAX_LORA_RANKS)})")
    elif rank > R:
        _check(checks, "rank", "fail", f"adapter rank {rank} > --max-lora-rank {R}: vLLM refuses it; use --max-lora-rank "
               f"{min(v for v in VLLM_MAX_LORA_RANKS if v >= rank) if rank <= VLLM_MAX_LORA_RANKS[-1] else '(none fits)'}")
    elif bd and ranks != [R]:
        if len(ranks) == 1 and rank in VLLM_MAX_LORA_RANKS:
            fix_text = f"serve with --max-lora-rank {rank}"
        else:
            usable = [v for v in VLLM_MAX_LORA_RANKS if v % adapter.nblocks == 0]
            retrain = (f"retrain with one rank in {usable}" if usable else
                       f"no vLLM max-lora-rank is a multiple of nblocks={adapter.nblocks}")
            fix_text = f"{retrain}, or serve as plain LoRA: {dense_fix}"
        _check(checks, "rank", "fail", f"adapter rank(s) {ranks} != --max-lora-rank {R}: vLLM's BD-LoRA path slices the "
               f"packed tensors by max-lora-rank/TP, so ranks > 0 would read wrong rows; {fix_text}")
    else:
        _check(checks, "rank", "ok", f"rank {rank} fits --max-lora-rank {R}")

    config, error = _base_config(adapter, base)
    if config is None:
        _check(checks, "kv_heads", "warn", f"base config not readable ({error}); pass --base to check head counts")
    else:
        text = config.get_text_config()
        heads = text.num_attention_heads
        kv = getattr(text, "num_key_value_heads", None) or heads
        if heads % tp or (kv % tp and tp % kv):
            _check(checks, "kv_heads", "fail", f"vLLM cannot shard the base model at TP {tp}: num_attention_heads={heads}, "
                   f"num_key_value_heads={kv}; use a TP that divides {heads} and {kv}")
        elif not bd:
            _check(checks, "kv_heads", "ok", f"{heads} heads / {kv} KV heads at TP {tp} (plain LoRA: no block alignment needed)")
        elif kv % tp:
            _check(checks, "kv_heads", "fail", f"TP {tp} does not divide num_attention_heads={heads} / num_key_value_heads={kv}: "
                   f"vLLM replicates KV heads and the K/V blocks no longer line up; serve at a TP dividing {kv}, or: {dense_fix}")
        else:
            _check(checks, "kv_heads", "ok", f"{heads} heads / {kv} KV heads split evenly over TP {tp}")

    if config is not None:
        _check(checks, "shapes", *_shape_check(adapter, config))

    if bd:
        wrong = sorted({n.rsplit(".", 1)[-1] for n, m in adapter.modules.items()
                        if VLLM_BD_MODULES.get(n.rsplit(".", 1)[-1]) != m.role})
        if wrong:
            _check(checks, "modules", "fail", f"modules {wrong} are not q/k/v/o/gate/up/down projections with the roles vLLM "
                   f"slices (bd_b for q,k,v,gate,up; bd_a for o,down); serve as plain LoRA: {dense_fix}")
        else:
            kinds = sorted({n.rsplit(".", 1)[-1] for n in adapter.modules})
            _check(checks, "modules", "ok", f"{kinds}: projections vLLM's BD-LoRA path shards")

    targets = raw.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    embed_targets = [t for t in targets if any(k in t for k in ("embed", "lm_head", "wte"))]
    if raw.get("modules_to_save") or adapter.extra_tensors or raw.get("trainable_token_indices") or embed_targets:
        what = raw.get("modules_to_save") or embed_targets or sorted(adapter.extra_tensors)[:3] or "trainable tokens"
        _check(checks, "embeddings", "fail", f"the adapter changes {what} (modules_to_save / embeddings / lm_head), which "
               f"vLLM's LoRA loading does not apply; serve a merged model: bdlora export {path} --to merged --out {path}-merged")
    else:
        _check(checks, "embeddings", "ok", "no modules_to_save, embedding or lm_head changes")

    _check(checks, "tokenizer", *_tokenizer_check(adapter, config))
    served = _served_base(adapter, base)
    if served.startswith("tiny:") or served == "BASE_MODEL":
        _check(checks, "base", "warn", f"base {served!r} is no model vLLM can load; pass --base with its Hub id or path")

    statuses = {c["status"] for c in checks}
    ready = not statuses & {"fail", "fix"}
    lora_name = name or path.name
    command = None
    if "fail" not in statuses:
        flags = " --block-diagonal-sharded-loras" if bd else ""
        command = (f"vllm serve {served} --enable-lora --tensor-parallel-size {tp} "
                   f"--max-lora-rank {R}{flags} --lora-modules {lora_name}={serve_path}")
    return dict(adapter=str(path), tp=tp, nblocks=adapter.nblocks, bdlora=adapter.is_bdlora, r=rank, max_lora_rank=R,
                ready=ready, checks=checks, fixes=fixes, command=command)


def format_serving(report: dict) -> str:
    lines = [f"check-serving {report['adapter']}  TP {report['tp']}  nblocks {report['nblocks']}  r {report['r']}  "
             f"max-lora-rank {report['max_lora_rank']}"]
    for check in report["checks"]:
        lines.append(f"  [{check['status']:>4}] {check['check']}: {check['message']}")
    if report["ready"]:
        lines.append(f"ready: {report['command']}")
    elif report["command"]:
        lines.append("not ready as is; fix, then serve:")
        lines += [f"  {fix}" for fix in report["fixes"]] + [f"  {report['command']}"]
    else:
        lines.append("not ready: see the failed checks above for the fix")
    return "\n".join(lines)


def check_serving_cli(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bdlora check-serving",
                                     description="Check an adapter against vLLM's BD-LoRA serving path; exit 1 when not ready.")
    parser.add_argument("adapter", help="adapter directory")
    parser.add_argument("--tp", type=int, required=True, help="tensor-parallel size to serve at")
    parser.add_argument("--max-lora-rank", type=int, help="vLLM --max-lora-rank (default: the smallest allowed value >= r)")
    parser.add_argument("--base", help="base model spec / Hub id (default: the adapter's base_model_name_or_path)")
    parser.add_argument("--name", help="LoRA module name in --lora-modules (default: the adapter directory's name)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args(argv)
    report = check_serving(args.adapter, args.tp, args.max_lora_rank, args.base, args.name)
    print(format_serving(report))
    if args.json:
        print(json.dumps(report))
    return 0 if report["ready"] else 1
