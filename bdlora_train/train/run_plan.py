"""One plan per run: `plan_run(recipe, model)` works out, once, every fact a training run needs about its adapter.

The facts: the method, nblocks (core/heads.py `choose_nblocks`: the recipe's, else the TP degree under TP, else the
default that splits the heads), r and lora_alpha (r matched to a LoRA budget when the recipe asks), the resolved
targets and their roles (peft_integration/resolve.py: every alignment check, PEFT's own filters), under TP the
per-module
plan styles (tp_runtime/preflight.py), the budget baseline (the matched LoRA rank and its parameter count), the
learning-rate multipliers (`bd_lr_ratio` resolved, `loraplus_lr_ratio`), and the PEFT config itself
(recipe/methods.py), bound to the resolved targets.

Under TP the plan is made on the meta-device model before any weight loads (launch/checks.py
`check_model_parallel`) and reused by the run on the sharded model: the PEFT config is built once. Everything below
the plan (the PEFT model, the TP sharding, the optimizer's groups, metrics.json, the resume check) reads it and
resolves nothing again.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from dataclasses import dataclass

from bdlora_train.recipe.methods import BD_METHODS, check_method_rank, method_config
from bdlora_train.trainer.optim import resolve_bd_lr_ratio


@dataclass(frozen=True)
class RunPlan:
    """What one run trains, each fact worked out once (module docstring). `nblocks` is the adapter's (1 for plain
    LoRA); `targets` {name: arch/targets.py Target} is None for plain LoRA outside TP (nothing needs them there);
    `tp_styles` {module: transformers' plan style} only under TP / EP; `peft_config` goes to get_peft_model as it is."""

    method: str
    nblocks: int
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]  # what the recipe asked for (resolved: `targets`)
    targets: Mapping | None
    tp_styles: Mapping | None
    matched_lora_rank: int | None
    matched_lora_params: int | None
    bd_lr_ratio: float | None  # None for plain LoRA
    loraplus_lr_ratio: float | None  # None for the block-diagonal methods
    peft_config: object

    @property
    def block_diagonal(self) -> bool:
        return self.method in BD_METHODS

    @property
    def roles(self) -> Mapping | None:
        """{module or expert parameter: bd_a | bd_b} of the resolved targets."""
        if self.targets is None:
            return None
        return types.MappingProxyType({name: t.role for name, t in self.targets.items()})

    @property
    def lr_ratios(self) -> tuple[float, float]:
        """(block-diagonal factor's, other lora_B's) learning-rate multipliers, 1 where the method has none."""
        return self.bd_lr_ratio or 1.0, self.loraplus_lr_ratio or 1.0

    def metrics(self) -> dict:
        """The adapter's fields of metrics.json, in its order."""
        return {
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "nblocks": self.nblocks,
            "bd_lr_ratio": self.bd_lr_ratio,
            "loraplus_lr_ratio": self.loraplus_lr_ratio,
            "target_modules": list(self.target_modules),
            "matched_lora_rank": self.matched_lora_rank,
            "matched_lora_params": self.matched_lora_params,
        }


def plan_run(recipe, model) -> RunPlan:
    """The plan of `recipe` (validated) on `model` (the loaded base, or under TP its meta-device twin); raises the
    one-line error of the first fact that does not work out."""
    from bdlora_train.budget import lora_params, matched_rank
    from bdlora_train.core.heads import choose_nblocks

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    method, tp, ep, asked_targets = recipe.method, recipe.tp_size, recipe.ep_size, recipe.targets
    block_diagonal = method in BD_METHODS
    if ep > 1:  # the experts first: they are what ep_size splits
        from bdlora_train.tp_runtime.preflight import check_ep_model

        check_ep_model(base, ep)
    if tp > 1:  # the TP degree first: nblocks defaults to it, and the user chose tp_size, not nblocks
        from bdlora_train.core.errors import RecipeError
        from bdlora_train.tp_runtime.preflight import check_tp_blocks, check_tp_model

        asked = recipe.nblocks if block_diagonal else None
        rank = recipe.lora_r if recipe.match_budget_of_lora_rank is None else None
        check_tp_model(base, tp, nblocks=asked, r=rank)
        check_tp_blocks(base, tp, asked, rank, error=RecipeError)  # then nblocks: a multiple of tp_size
        if asked and rank:  # then the rank: a multiple of nblocks (those divide tp_size and split the heads)
            from bdlora_train.core.degrees import check_rank

            check_rank(rank, asked, "recipe", key="lora_r", error=RecipeError)
    nblocks = choose_nblocks(base.config, recipe.nblocks, tp) if block_diagonal else 1
    r, matched_params, targets = recipe.lora_r, None, None
    if block_diagonal and recipe.match_budget_of_lora_rank is not None:
        probe = _resolve(base, asked_targets, nblocks, nblocks)  # the smallest rank: its counts scale with r
        r = matched_rank(probe, recipe.match_budget_of_lora_rank, nblocks, mode="below")
        # the same LoRA baseline `bdlora budget` counts: LoRA on exactly the modules BD-LoRA resolves
        matched_params = lora_params(probe, recipe.match_budget_of_lora_rank)
        targets = {name: dataclasses.replace(t, r=r) for name, t in probe.items()}
    elif block_diagonal:
        check_method_rank(method, r, nblocks)
        targets = _resolve(base, asked_targets, nblocks, r)
    elif tp > 1 or ep > 1:  # plain LoRA under TP / EP: the TP checks read its targets
        targets = _resolve(base, asked_targets, 1, r)
    alpha = recipe.lora_alpha_ratio * r if recipe.lora_alpha_ratio is not None else recipe.lora_alpha
    common = dict(
        r=r,
        lora_alpha=alpha,
        lora_dropout=recipe.lora_dropout,
        use_rslora=recipe.use_rslora,
        target_modules=list(asked_targets),
        task_type="CAUSAL_LM",
    )
    peft_config = method_config(method, base, common, nblocks, recipe.bd_a_init, targets)
    styles = None
    if tp > 1 or ep > 1:
        from bdlora_train.tp_runtime.preflight import check_tp_training

        data_parallel = recipe.fsdp_size * recipe.dp_replicate_size
        styles = types.MappingProxyType(check_tp_training(base, targets, tp, block_diagonal, ep, data_parallel))
    return RunPlan(
        method=method,
        nblocks=nblocks,
        r=r,
        lora_alpha=alpha,
        target_modules=tuple(asked_targets),
        targets=types.MappingProxyType(targets) if targets is not None else None,
        tp_styles=styles,
        matched_lora_rank=recipe.match_budget_of_lora_rank if block_diagonal else None,
        matched_lora_params=matched_params,
        # the learning-rate multipliers this run trains with (optim.py), "auto" resolved: recorded in metrics.json
        bd_lr_ratio=resolve_bd_lr_ratio(recipe.bd_lr_ratio, nblocks) if block_diagonal else None,
        loraplus_lr_ratio=None if block_diagonal else recipe.loraplus_lr_ratio,
        peft_config=peft_config,
    )


def check_model_parallel(recipe):
    """Everything TP training needs from the model, checked on its config before any weight loads (meta device): the
    run's plan (train/run_plan.py) made on the meta-device model, with {adapted module: transformers' plan style} in
    `tp_styles`, or one line naming the family, module and alternative. The run reuses the plan on the sharded model."""
    from bdlora_train.arch.scope import split_experts
    from bdlora_train.models import load_config, meta_model

    model = meta_model(load_config(recipe.model))
    if recipe.tp_size > 1 and recipe.ep_size == 1:
        split_experts(model)  # the plan the base loads with (launch/checks.py model_parallel_config)
    return plan_run(recipe, model)


def _resolve(model, target_modules: list[str], nblocks: int, r: int) -> dict:
    """The targets a recipe's request resolves to at (nblocks, r): the same request every method makes (the recipe's
    target_modules, no role overrides, TP-sharded experts)."""
    from peft import LoraConfig

    from bdlora_train.peft_integration.resolve import resolve

    return resolve(model, LoraConfig(r=r, target_modules=list(target_modules)), nblocks)
