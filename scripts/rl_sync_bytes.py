"""Bytes one GRPO policy sync moves to a vLLM server: TRL's merged full-weight broadcast vs the toolkit's adapter.

After every optimizer step the rollout server must generate with the new policy. Two ways:

- TRL (`GRPOTrainer(use_vllm=True)`, trl/generation/vllm_generation.py `_iter_named_params` / `sync_weights`): a
  PEFT model is merged (`merge_adapter`), and EVERY parameter of the model except the LoRA factors is streamed
  under its vLLM name (`VLLMClient.update_named_params`: an NCCL broadcast from the trainer, rank 0, to a group of
  the server's world size + 1), at the parameter's dtype: bf16 for a bf16 base, 2 bytes per parameter. Every
  server rank receives every full tensor and loads its shard of it.
- The toolkit (bdlora_train/rl/rollouts.py `ServerRollouts`): `save_pretrained` writes only the adapter's tensors
  (adapter_model.safetensors) and the server loads them under a new name. PEFT keeps a bf16 base's adapter in fp32
  (`autocast_adapter_dtype=True`, its default) and saves it so: 4 bytes per stored element. A block-diagonal factor
  PEFT cannot express (on a MoE base every factor: PEFT cannot combine use_bdlora with target_parameters) is stored
  densely with its explicit zeros: the file holds `stored` elements, more than the `params` that train.

Everything is counted, exactly, on the real architectures built on the meta device (no weights, no download): the
configs are the toolkit's (`bdlora_train.models.load_config`: the Hub cache, else the shape fields of the public
config.json bundled in bdlora_train/models/snapshots/), each recipe's PEFT config is the one its run trains
(`train.run_plan.plan_run` on the meta model: targets, roles, nblocks, r), the counts are `budget.adapter_layout`
/ `count_adapter_params`, cross-checked against `budget.bdlora_params` / `lora_baseline`.

Per TP rank of a server at TP = nblocks (the degree each BD-LoRA recipe is served at): TRL's ranks each receive the
whole merged model; under the toolkit each rank reads every tensor of the adapter file (vLLM 0.32
`LoRAModel.from_local_checkpoint` loads all keys on every rank; only remote experts under expert parallelism are
skipped) and keeps its local LoRA (`vllm_plugin/sharding.py`: rank-slice r/T of the dense factor and the rank's
diagonal block; at T = nblocks exactly 1/nblocks of the BD-LoRA's parameters). A plain LoRA is sliced by vLLM
itself (not --fully-sharded-loras): column-parallel layers keep all of A and 1/T of B's rows, row-parallel layers
1/T of A's columns and all of B. Counted as parameters (the server holds them at its --lora-dtype, padded to
--max-lora-rank). The plugin refuses MoE expert factors (docs/serving-vllm.md), so the MoE row has no per-rank
count.

    python scripts/rl_sync_bytes.py --out eval/bench/rl_sync_bytes            # writes .json and .md, seconds
    python scripts/rl_sync_bytes.py --out /tmp/rl_sync_bytes --verify         # + PEFT's saved state dict, ~30 s

`--verify` builds each PEFT model on a meta bf16 base and checks that `get_peft_model_state_dict` (what
`save_pretrained` writes) has exactly the counted elements, all fp32. Bytes are tensor payload: the safetensors JSON
header (key names, shapes, offsets), adapter_config.json and bdlora_layout.json come on top (kilobytes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the configs are bundled: no Hub lookups, no download

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bdlora_train.budget import adapter_layout, bdlora_params, count_adapter_params, lora_baseline  # noqa: E402
from bdlora_train.core.roles import BD_A, BD_B  # noqa: E402
from bdlora_train.models import load_config, meta_model  # noqa: E402
from bdlora_train.recipe.load import load_recipe  # noqa: E402
from bdlora_train.train.run_plan import plan_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ADAPTER_BYTES = 4  # fp32: PEFT autocasts a bf16 base's adapter to fp32 and saves it so
MERGED_BYTES = 2  # bf16: the base's dtype, which TRL's merged sync broadcasts
# (model, [recipes]); the first recipe is the BD-LoRA one whose nblocks is the server's TP degree
MODELS = (
    ("meta-llama/Llama-3.1-8B", ("recipes/llama-3.1-8b/openorca/bdlora_r32.yaml",
                                 "recipes/llama-3.1-8b/openorca/lora_r16.yaml")),
    ("meta-llama/Llama-3.1-70B", ("recipes/llama-3.1-70b/openorca/bdlora_r32.yaml",
                                  "recipes/llama-3.1-70b/openorca/lora_r16.yaml")),
    ("Qwen/Qwen3-30B-A3B", ("recipes/qwen3-30b-a3b/openorca/bdlora_tp4.yaml",)),
)
CONFIG_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "attention_bias", "mlp_bias",
)
RECIPE_OVERRIDES = ("report_to=none",)  # the logger changes nothing counted, and needs no wandb installed


def model_params(model) -> int:
    """Every parameter of the model once (tied weights once, as TRL's sync and vLLM see them)."""
    return sum(p.numel() for p in model.parameters())


def kept_per_rank(layout: dict, tp: int, sides: dict) -> int | None:
    """Parameters of the adapter one of `tp` server ranks keeps (module docstring); None where the plugin does not
    serve it (expert factors). `sides`: {module: BD_B (column-parallel) | BD_A (row-parallel)}."""
    if any(e["experts"] for e in layout.values()):
        return None
    total = 0
    for name, e in layout.items():
        r, d_in, d_out = e["r"], e["d_in"], e["d_out"]
        if e["role"] is None:  # plain LoRA, vLLM's own slicing
            column = sides[name] == BD_B
            total += r * d_in + r * d_out // tp if column else r * d_in // tp + r * d_out
            continue
        if e["nblocks"] != tp or e["storage"] != "packed":
            raise ValueError(f"{name}: per-rank count written for packed factors at nblocks == TP, got {e}")
        rank = r // tp  # the rank's slice of r
        if e["role"] == BD_B:  # A_i = A[rs_i, :], B_ii = B[out_i, rs_i]
            total += rank * d_in + (d_out // tp) * rank
        elif e["role"] == BD_A:  # A_ii = A[rs_i, in_i], B_i = B[:, rs_i]
            total += rank * (d_in // tp) + d_out * rank
        else:
            raise ValueError(f"{name}: role {e['role']!r}")
    return total


def count_recipe(path: str, model, tp: int | None, sides: dict | None) -> tuple[dict, dict, int]:
    """(row, {module: side} of a block-diagonal plan, nblocks) for one recipe on the meta model."""
    recipe = load_recipe(str(ROOT / path), list(RECIPE_OVERRIDES))
    plan = plan_run(recipe, model)
    layout = adapter_layout(model, plan.peft_config)
    params = count_adapter_params(model, plan.peft_config)
    stored = sum(e["stored"] for e in layout.values())
    if plan.block_diagonal:  # the same count from budget.py's own entry points
        check = bdlora_params(model, plan.r, plan.nblocks, recipe.targets)
    else:
        check = count_adapter_params(model, lora_baseline(model, plan.r, plan.nblocks, recipe.targets))
    if check != params or params != sum(e["params"] for e in layout.values()):
        raise AssertionError(f"{path}: counts disagree ({params} vs {check})")
    own_sides = {n: e["role"] for n, e in layout.items()} if plan.block_diagonal else {}
    tp = tp or plan.nblocks
    total = model_params(model)
    linear = [e for e in layout.values() if not e["experts"]]
    experts = [e for e in layout.values() if e["experts"]]
    kept = kept_per_rank(layout, tp, sides or own_sides)
    row = {
        "model": recipe.model,
        "recipe": path,
        "method": plan.method,
        "r": plan.r,
        "nblocks": plan.nblocks,
        "target_modules": list(plan.target_modules),
        "adapted_linear_modules": len(linear),
        "adapted_expert_parameters": len(experts),
        "experts_per_parameter": max((e["experts"] for e in experts), default=0),
        "storage": sorted({e.get("storage", "lora") for e in layout.values()}),
        "adapter_params": params,
        "adapter_stored_elements": stored,
        "adapter_bytes_saved": stored * ADAPTER_BYTES,
        "model_params": total,
        "merged_sync_bytes": total * MERGED_BYTES,
        "merged_over_adapter": round(total * MERGED_BYTES / (stored * ADAPTER_BYTES), 2),
        "adapter_fraction_of_merged": round(stored * ADAPTER_BYTES / (total * MERGED_BYTES), 6),
        "server_tp": tp,
        "per_rank": {
            "trl_receives_bytes": total * MERGED_BYTES,
            "adapter_reads_bytes": stored * ADAPTER_BYTES,
            "adapter_keeps_params": kept,
            "adapter_keeps_note": (
                "the plugin refuses MoE expert factors (docs/serving-vllm.md): not served"
                if kept is None
                else (f"exactly adapter_params / {tp}" if kept * tp == params else "vLLM's plain-LoRA slicing")
            ),
        },
    }
    return row, own_sides, plan.nblocks


def verify_saved(path: str, config) -> dict:
    """What `save_pretrained` writes for the recipe's adapter on a bf16 base: {elements, bytes, dtypes}."""
    from peft import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from bdlora_train.peft_integration.config import get_peft_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plan = plan_run(load_recipe(str(ROOT / path), list(RECIPE_OVERRIDES)), model)
    if plan.block_diagonal:
        peft_model = get_peft_model(model, plan.peft_config, prepared=True)
    else:
        import peft

        peft_model = peft.get_peft_model(model, plan.peft_config)
    state = get_peft_model_state_dict(peft_model)
    return {
        "elements": sum(t.numel() for t in state.values()),
        "bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in state.values()}),
        "tensors": len(state),
    }


def versions() -> dict:
    import peft
    import transformers
    import trl

    return {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "trl": trl.__version__}


def build(verify: bool = False) -> dict:
    rows, configs = [], {}
    for model_id, recipes in MODELS:
        config = load_config(model_id)
        configs[model_id] = {k: getattr(config, k) for k in CONFIG_FIELDS if hasattr(config, k)}
        model = meta_model(config)
        tp, sides = None, None
        for path in recipes:
            row, own_sides, nblocks = count_recipe(path, model, tp, sides)
            if tp is None:  # the BD-LoRA recipe first: its nblocks is the serving TP degree
                tp, sides = nblocks, own_sides
            if verify:
                saved = verify_saved(path, config)
                if saved["elements"] != row["adapter_stored_elements"] or saved["bytes"] != row["adapter_bytes_saved"]:
                    raise AssertionError(f"{path}: PEFT saves {saved}, counted {row['adapter_stored_elements']}")
                row["saved_state_dict_checked"] = saved
            rows.append(row)
    return {
        "what": "bytes one GRPO policy sync moves to the vLLM server, trainer -> server: TRL's merged full-weight "
                "broadcast vs the toolkit's adapter file",
        "units": {"adapter": f"{ADAPTER_BYTES} B/element (fp32, PEFT autocast_adapter_dtype on a bf16 base)",
                  "merged": f"{MERGED_BYTES} B/param (bf16: every weight of the model, TRL's merged sync)",
                  "bytes": "tensor payload; safetensors header and JSON side files (kilobytes) not counted"},
        "notes": [
            "adapter_params: trainable (free) parameters; adapter_stored_elements: what the file holds, densely "
            "stored block-diagonal factors with their explicit zeros (MoE: every factor, PEFT cannot combine "
            "use_bdlora with target_parameters)",
            "merged sync is the same for every method on a model: the whole model, every step",
            "per_rank at the server's TP degree (the BD-LoRA recipe's nblocks): TRL broadcasts every full tensor "
            "to every rank; vLLM 0.32 reads every adapter tensor on every rank, and the rank keeps "
            "adapter_keeps_params (vllm_plugin/sharding.py; plain LoRA: vLLM's slicing, not fully sharded)",
            "the server's weights and the GRPO rewards / log-probs it returns are not part of a sync",
        ],
        "versions": versions(),
        "configs": configs,
        "rows": rows,
    }


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def markdown(report: dict, command: str) -> str:
    lines = [
        "# Bytes per GRPO policy sync to vLLM: TRL's merged sync vs the adapter",
        "",
        f"`{command}`",
        "",
        "Exact counts on the real architectures built on the meta device (configs: bdlora_train/models/snapshots), "
        "each recipe's adapter as its run builds it (train/run_plan.py). Adapter as saved: fp32, 4 B/element "
        "(PEFT's autocast_adapter_dtype on a bf16 base); TRL's merged sync: every weight of the model in bf16, "
        "2 B/param, every step. GB/MB are 10^9/10^6 bytes; exact bytes in the .json. Tensor payload only "
        "(safetensors header and side files: kilobytes).",
        "",
        "| model | method | r | nblocks | adapter params | adapter file (fp32) | model params | merged sync (bf16) "
        "| merged / adapter | TP | per rank: TRL receives | per rank: adapter read / kept params |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        rank = row["per_rank"]
        kept = "not served" if rank["adapter_keeps_params"] is None else f"{rank['adapter_keeps_params']:,}"
        params = f"{row['adapter_params']:,}"
        if row["adapter_stored_elements"] != row["adapter_params"]:
            params += f" ({row['adapter_stored_elements']:,} stored)"
        lines.append(
            f"| {row['model']} | {row['method']} | {row['r']} | {row['nblocks']} | {params} "
            f"| {_size(row['adapter_bytes_saved'])} | {row['model_params']:,} | {_size(row['merged_sync_bytes'])} "
            f"| {row['merged_over_adapter']:.1f}x | {row['server_tp']} | {_size(rank['trl_receives_bytes'])} "
            f"| {_size(rank['adapter_reads_bytes'])} / {kept} |"
        )
    lines += [
        "",
        "- Qwen3-30B-A3B: attention and all 128 experts' gate_up_proj / down_proj of every layer; on a MoE base every "
        "block-diagonal factor is stored densely with its zeros (PEFT cannot combine use_bdlora with "
        "target_parameters), so the file holds LoRA r=32's elements, not the BD-LoRA's free parameters. The vLLM "
        "plugin does not serve expert factors yet (docs/serving-vllm.md), and a GRPO run refuses tp_size > 1 "
        "(recipe/schema.py): the row is what syncing this adapter would move.",
        "- Per TP rank: TRL's NCCL broadcast gives every server rank every full tensor. The adapter path does not "
        "read a 1/N shard either: vLLM 0.32 loads every adapter tensor on every rank; after the plugin a rank keeps "
        "exactly 1/nblocks of the BD-LoRA's parameters (its rank slice and diagonal block, vllm_plugin/sharding.py); "
        "a plain LoRA keeps all of A on column-parallel and all of B on row-parallel layers (vLLM's slicing).",
        "- Not counted: the safetensors JSON header, adapter_config.json and bdlora_layout.json (kilobytes).",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output prefix: writes PREFIX.json and PREFIX.md")
    parser.add_argument("--verify", action="store_true",
                        help="also build each PEFT model on a meta bf16 base and check its saved state dict (~30 s)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    report = build(verify=args.verify)
    command = "python scripts/rl_sync_bytes.py --out " + args.out + (" --verify" if args.verify else "")
    report["command"] = command
    report = {"command": report.pop("command"), **report}
    json_path, md_path = Path(args.out + ".json"), Path(args.out + ".md")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    md_path.write_text(markdown(report, command))
    print(markdown(report, command))
    print(f"wrote {json_path} and {md_path} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
