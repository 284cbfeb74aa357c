"""Which Linear layers TP shards and how, with every check sharding at a TP degree needs; `shard_model`."""

from __future__ import annotations

from torch import nn

from bdlora_train.adapters import Adapter
from bdlora_train.errors import TPError
from bdlora_train.patterns import BD_A, BD_B
from bdlora_train.roles import check_heads, plan_role, text_config, tp_plan
from bdlora_train.tp.layers import COLWISE, MODES, ROWWISE, SiblingGroup, TPLoraLinear


def tp_styles(model, tp: int, adapter: Adapter | None = None) -> dict[str, str]:
    """{module name: "colwise"|"rowwise"} for the model's TP plan, after every check that sharding at `tp` needs.

    Works on meta-device models, so the parent process validates before spawning ranks.
    """
    config = text_config(model.config)
    plan = tp_plan(model.config)
    if not plan:
        raise TPError(
            f"tp: model_type={config.model_type!r} has no tensor-parallel plan; use a Llama/Qwen2/Mistral-style decoder"
        )
    if adapter is not None:
        _check_blocks(adapter, tp)
    check_heads(model.config, tp, label="--tp", error=TPError)
    styles = {}
    for name, module in model.named_modules():
        raw = _plan_style(name, plan) if isinstance(module, nn.Linear) else None
        if raw is None or plan_role(name, plan) is None:
            continue
        if raw not in (COLWISE, ROWWISE):  # packed / gathered / local styles shard differently from Megatron TP
            raise TPError(
                f"tp: {name} has TP style {raw!r}; only plain 'colwise' / 'rowwise' Linear layers are supported"
            )
        style = raw
        split = module.out_features if style == COLWISE else module.in_features
        if split % tp:
            raise TPError(f"tp: {name} ({style}) has {split} features along the split, not divisible by --tp {tp}")
        styles[name] = style
    if adapter is not None:
        _check_roles(adapter, styles, tp)
    return styles


def _plan_style(name: str, plan: dict[str, str]) -> str | None:
    """The raw TP-plan style of a module (roles.plan_role gives only the role it implies)."""
    return next((style for pattern, style in plan.items() if plan_role(name, {pattern: style})), None)


def _check_blocks(adapter: Adapter, tp: int) -> None:
    if not adapter.is_bdlora:
        raise TPError(
            f"tp: {adapter.path} is a plain LoRA adapter (no use_bdlora): BD-LoRA sharding needs block-diagonal "
            "factors; "
            "train with BlockDiagLoraConfig(nblocks=TP)"
        )
    if adapter.nblocks % tp:
        raise TPError(
            f"tp: adapter nblocks={adapter.nblocks} is not a multiple of --tp {tp}: blocks would straddle TP shards; "
            f"use --tp in {adapter.tp_degrees()}"
        )


def _check_roles(adapter: Adapter, styles: dict[str, str], tp: int) -> None:
    expected = {COLWISE: BD_B, ROWWISE: BD_A}
    for name, module in adapter.modules.items():
        if name not in styles:
            raise TPError(
                f"tp: adapter module {name} is not a column- or row-parallel Linear of the base model's TP plan"
            )
        if module.role != expected[styles[name]]:
            raise TPError(
                f"tp: {name} is {styles[name]}-parallel but the adapter stores role {module.role!r} "
                f"(needs {expected[styles[name]]!r}); its blocks do not follow the TP shards"
            )
        if module.r % tp:
            raise TPError(f"tp: {name} has rank r={module.r}, not divisible by --tp {tp}")


def shard_model(model, mesh, adapter: Adapter | None = None) -> list[TPLoraLinear]:
    """Shard `model` in place over `mesh` (its TP plan) and attach this rank's LoRA shards; returns the LoRA layers."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world, rank = mesh.size(), mesh.get_local_rank()
    styles = tp_styles(model, world, adapter)
    layers = []
    for name, factors in (adapter.modules if adapter else {}).items():
        parent_name, _, leaf = name.rpartition(".")
        layer = TPLoraLinear(model.get_submodule(name), styles[name])
        layer.set_factors(factors, rank, world)
        setattr(model.get_submodule(parent_name), leaf, layer)
        layers.append((name, layer))
    plan = {name: ColwiseParallel() if style == COLWISE else RowwiseParallel() for name, style in styles.items()}
    # Every rank already holds the full weights (same seed / same files): slice locally, no scatter.
    parallelize_module(model, mesh, plan, src_data_rank=None)
    siblings: dict[str, list[TPLoraLinear]] = {}  # by parent module: q|k|v under self_attn, gate|up under mlp
    for name, layer in layers:
        if layer.style == COLWISE:
            siblings.setdefault(name.rpartition(".")[0], []).append(layer)
    for members in siblings.values():
        group = SiblingGroup(members)
        for layer in members:
            layer.group = group
    return [layer for _, layer in layers]


def set_mode(layers: list[TPLoraLinear], mode: str) -> None:
    if mode not in MODES:
        raise TPError(f"tp: mode={mode!r}; use one of {MODES}")
    for layer in layers:
        layer.mode = mode
