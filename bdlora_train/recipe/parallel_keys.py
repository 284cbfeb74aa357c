"""The recipe's model-parallel keys (tp_size, ep_size, fsdp_size, dp_replicate_size) checked against each other and
against the keys they do not combine with, before anything loads; an expert-parallel refusal names the layouts that
pass every rule this run can check (`ep_hint`)."""

from __future__ import annotations

from dataclasses import dataclass

from bdlora_train.core import launch_env
from bdlora_train.core.degrees import ep_layout_fits, ep_layout_fixes
from bdlora_train.core.errors import RecipeError
from bdlora_train.core.keys import check_fields, key
from bdlora_train.quant.keys import QuantKeys


@dataclass
class ParallelKeys:
    """The recipe's parallelism section: the device, DDP / DeepSpeed / FSDP, and the model-parallel sizes of a base
    transformers shards at load (DistributedConfig)."""

    use_cpu: bool = key(False, "force CPU (also ACCELERATE_USE_CPU=true); gloo backend under torchrun")
    cpu_threads: int | None = key(
        None, "torch.set_num_threads for this run (restored after); tiny models run fastest on 1", low=1
    )
    deepspeed: str | None = key(None, "DeepSpeed JSON, for torchrun launches (accelerate launch passes it itself)")
    fsdp: str = key("", 'e.g. "full_shard auto_wrap", for torchrun launches')
    fsdp_config: dict | None = key(None, "transformers fsdp_config mapping")
    ddp_backend: str | None = key(None, "nccl | gloo | ...; default: what accelerate picks for the device")
    tp_size: int = key(
        1,
        "tensor-parallel degree (transformers DistributedConfig): each rank holds only its adapter blocks; launch "
        "tp_size x fsdp_size x dp_replicate_size processes with torchrun; nblocks defaults to it",
        low=1,
    )
    fsdp_size: int = key(1, "FSDP2 degree next to tp_size (transformers DistributedConfig; data parallel)", low=1)
    dp_replicate_size: int = key(1, "HSDP replicas next to tp_size and fsdp_size (DistributedConfig)", low=1)
    ep_size: int = key(
        1,
        "expert-parallel degree of a MoE base (DistributedConfig): each rank holds whole experts and their adapter; "
        "must be tp_size x fsdp_size (every expert on one rank)",
        low=1,
    )

    @property
    def model_parallel(self) -> bool:
        """Whether transformers shards the base at load (`DistributedConfig`: tp_size and / or ep_size, with
        fsdp_size and dp_replicate_size for the data-parallel dimensions next to them)."""
        return self.tp_size > 1 or self.ep_size > 1

    def check(self) -> None:
        check_fields(self)


def check_parallel_keys(recipe, keys: QuantKeys) -> None:
    """Keys that do not combine with a base sharded by transformers, refused before anything loads."""
    if not recipe.model_parallel:
        for name in ("fsdp_size", "dp_replicate_size"):
            if getattr(recipe, name) > 1:
                raise RecipeError(
                    f"recipe: {name}={getattr(recipe, name)} with tp_size=1: it sizes the data-parallel dimension "
                    "next to TP; without TP launch N processes as they are (DDP), or set fsdp=... / deepspeed=..."
                )
        return
    where = f"tp_size={recipe.tp_size}, fsdp_size={recipe.fsdp_size}, dp_replicate_size={recipe.dp_replicate_size}"
    if recipe.ep_size > 1:
        where += f", ep_size={recipe.ep_size}"
        if recipe.ep_size != recipe.tp_size * recipe.fsdp_size:
            why = "holds every expert on one rank, so ep_size must be tp_size x fsdp_size"
            raise RecipeError(f"recipe: {where}: expert-parallel training {why}{ep_hint(recipe)}")
        if recipe.dp_replicate_size > 1:
            why = "does not combine with HSDP replicas"
            raise RecipeError(f"recipe: {where}: expert-parallel training {why}{ep_hint(recipe)}")
    refused = {
        "deepspeed": "DeepSpeed shards the model its own way; drop deepspeed",
        "fsdp": "transformers applies FSDP2 itself at load (fsdp_size)",
    }
    for name, why in refused.items():
        if getattr(recipe, name):
            raise RecipeError(f"recipe: {name} with {where}: {why}")
    if keys.kind:
        raise RecipeError(
            f"recipe: {keys.switches_on[0]}=true with {where}: transformers' TP plans do not shard "
            "bitsandbytes / torchao layers; train a quantized base with tp_size=1 (QLoRA, one device per process)"
        )
    if recipe.method == "peft-bdlora":
        raise RecipeError(
            f"recipe: method=peft-bdlora with {where}: under TP every adapter runs the toolkit's sharded layer, so "
            "stock PEFT's layer cannot be compared there; use method=bdlora or lora"
        )


def _expert_count(recipe) -> int | None:
    """The experts of the model's MoE layers, from its config; None when the config cannot be read here (an
    unreachable or unknown model: its own check says so when the run loads it) or names no expert count (then
    the model's own check refuses ep_size whatever the layout)."""
    from bdlora_train.core.heads import text_config
    from bdlora_train.models import load_config

    try:
        config = text_config(load_config(recipe.model))
    except Exception:  # the hint is then checked against every rule but the expert count
        return None
    counts = [getattr(config, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts")]
    return next((count for count in counts if isinstance(count, int)), None)


def ep_hint(recipe) -> str:
    """What follows an expert-parallel layout refusal: the layouts that pass every rule this run can check
    (core/degrees.py `ep_layout_fits`: ep_size = tp_size x fsdp_size, no HSDP replicas, the processes launched
    when under a launcher, whole experts when the model's config names their count), else the launches whose
    layouts do; nothing when no layout is known to pass. tp_size is kept (the heads and blocks were checked)."""
    tp, fsdp, ep = recipe.tp_size, recipe.fsdp_size, recipe.ep_size
    experts, processes = _expert_count(recipe), _launched()
    replicas = {"dp_replicate_size": 1} if recipe.dp_replicate_size > 1 else {}

    def layouts(count: int | None) -> list[dict]:
        candidates = [{"fsdp_size": fsdp * recipe.dp_replicate_size, "ep_size": tp * fsdp * recipe.dp_replicate_size}]
        if replicas:  # the layout as it is, without the replicas
            candidates.append({"fsdp_size": fsdp, "ep_size": ep})
        candidates += ep_layout_fixes(tp, fsdp, ep, 1, count, experts)
        found = []
        for change in candidates:
            new = {"fsdp_size": fsdp, "ep_size": ep, **change}
            spelled = {
                **replicas,
                **{k: v for k, v in change.items() if v != {"fsdp_size": fsdp, "ep_size": ep}[k]},
            }
            fits = ep_layout_fits(tp, new["fsdp_size"], new["ep_size"], 1, count, experts) and new["ep_size"] > 1
            if fits and spelled and spelled not in found:
                found.append(spelled)
        return found

    known = [f"{experts} experts"] * (experts is not None) + [f"{processes} processes launched"] * bool(processes)
    here = layouts(processes)
    if here:
        return f"; use {' or '.join(map(_spelled, here))}" + (f" ({', '.join(known)})" if known else "")
    if experts is None:
        return ""
    counts = range(tp, tp * experts + 1, tp)  # every launch whose layout can split the experts whole
    launches = [f"launch {count} processes with {_spelled(found[0])}" for count in counts if (found := layouts(count))]
    if not launches:
        return ""
    where = f"no layout of the {processes} processes launched" if processes else "no change of these sizes alone"
    return f"; {where} gives each rank whole experts of the {experts}: {' or '.join(launches[:2])}"


def _launched() -> int | None:
    """The processes the launcher started (WORLD_SIZE), or None outside a launcher (the run then says how many)."""
    return launch_env.launched_world_size()


def _spelled(change: dict) -> str:
    return " ".join(f"{key}={value}" for key, value in change.items())
