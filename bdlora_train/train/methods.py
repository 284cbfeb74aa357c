"""The PEFT config each recipe `method` asks for (`build_peft_config`): the toolkit's `bdlora`, plain `lora`, and
stock PEFT's BD-LoRA (`method: peft-bdlora`).

`peft-bdlora` is what a user gets from PEFT alone: `LoraConfig(use_bdlora=BdLoraConfig(...))`, PEFT's own layer
(`peft/tuners/lora/variants.py: BdLoraLinearVariant`, einsum forward), PEFT's own init, no toolkit layer and no
`bd_a_init` choice. Only the roles come from the toolkit (the TP plan via `peft_seam.resolve.resolve_roles`, every
alignment check), written as the compact substring patterns stock PEFT matches (`compact_patterns`), so both
BD-LoRA methods block the very same factors and `bdlora compare` measures what the toolkit's layer adds.
"""

from __future__ import annotations

import dataclasses

from bdlora_train.core.errors import RecipeError
from bdlora_train.core.roles import check_rank
from bdlora_train.train.optim import resolve_bd_lr_ratio

BD_METHODS = ("bdlora", "peft-bdlora")  # methods with a block-diagonal factor (nblocks, budget matching apply)
BD_ONLY_KEYS = ("bd_a_init", "bd_lr_ratio")  # recipe keys that change nothing for plain LoRA
LORA_ONLY_KEYS = ("loraplus_lr_ratio",)  # LoRA+: refused for BD methods (optim.py says why)


def keys_not_read_by(method: str) -> tuple[str, ...]:
    """The recipe keys `method` does not read: a sweep leaves them at their defaults for it (and does not train it
    once per value of them), a recipe that sets them for it is refused (check_method_keys)."""
    return LORA_ONLY_KEYS if method in BD_METHODS else BD_ONLY_KEYS


def peft_bdlora_config(model, nblocks: int, common: dict):
    """A stock `peft.LoraConfig` with `use_bdlora` for `model` at `nblocks` blocks; `common` holds r, lora_alpha,
    lora_dropout, use_rslora, target_modules, task_type (the same as every other method gets)."""
    from peft import BdLoraConfig, LoraConfig

    from bdlora_train.core.roles import BD_A, BD_B
    from bdlora_train.peft_seam.patterns import compact_patterns
    from bdlora_train.peft_seam.resolve import resolve_roles

    check_rank(common["r"], nblocks, "recipe: method=peft-bdlora", key="lora_r", error=RecipeError)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    roles = resolve_roles(base, LoraConfig(**common), nblocks)
    patterns = compact_patterns(roles)
    use_bdlora = BdLoraConfig(
        target_modules_bd_a=patterns[BD_A], target_modules_bd_b=patterns[BD_B], nblocks=nblocks, match_strict=True
    )
    return LoraConfig(use_bdlora=use_bdlora, **common)


def check_method_keys(recipe) -> None:
    """Keys that only a block-diagonal method reads are refused for plain LoRA instead of silently ignored, LoRA+ for
    a block-diagonal method (it would multiply with bd_lr_ratio on the block-diagonal B), and `bd_a_init` (a
    toolkit-layer option) for stock PEFT's layer."""
    resolve_bd_lr_ratio(recipe.bd_lr_ratio, 1)  # "auto" or a number; anything else fails here
    default = next(f.default for f in dataclasses.fields(recipe) if f.name == "bd_lr_ratio")
    if recipe.method not in BD_METHODS and recipe.bd_lr_ratio not in (default, 1.0):
        raise RecipeError(
            f"recipe: bd_lr_ratio={recipe.bd_lr_ratio} applies to block-diagonal methods {BD_METHODS}, not "
            f"method={recipe.method}; drop it (LoRA's own factor ratio is loraplus_lr_ratio)"
        )
    if recipe.method in BD_METHODS and recipe.loraplus_lr_ratio != 1.0:
        raise RecipeError(
            f"recipe: loraplus_lr_ratio={recipe.loraplus_lr_ratio:g} is LoRA+ for method=lora; on method="
            f"{recipe.method} the lora_B of column-parallel layers (bd_b) is the block-diagonal factor bd_lr_ratio "
            f"already scales (bd_lr_ratio={recipe.bd_lr_ratio}), so the two would multiply; tune bd_lr_ratio instead"
        )
    if recipe.method == "peft-bdlora" and recipe.bd_a_init != "peft":
        raise RecipeError(
            f"recipe: bd_a_init={recipe.bd_a_init} needs the toolkit's layer (method=bdlora); method=peft-bdlora "
            "is stock PEFT's layer and init"
        )


def build_peft_config(recipe, model):
    """(PEFT config, info): BlockDiagLoraConfig or LoraConfig with the same targets/alpha/dropout/rslora."""
    from peft import LoraConfig

    from bdlora_train.budget import count_adapter_params, lora_baseline, match_budget
    from bdlora_train.core.heads import default_nblocks
    from bdlora_train.peft_seam.config import BlockDiagLoraConfig

    targets = recipe.targets
    r = recipe.lora_r
    # under TP every rank holds whole blocks: nblocks defaults to the TP degree
    nblocks = recipe.nblocks or (recipe.tp_size if recipe.tp_size > 1 else default_nblocks(model.config))
    info: dict = {"matched_lora_rank": None, "matched_lora_params": None}
    if recipe.method in BD_METHODS and recipe.match_budget_of_lora_rank is not None:
        r = match_budget(model, recipe.match_budget_of_lora_rank, nblocks, mode="below", target_modules=targets)
        info["matched_lora_rank"] = recipe.match_budget_of_lora_rank
        # the same LoRA baseline `bdlora budget` counts: LoRA on exactly the modules BD-LoRA resolves
        baseline = lora_baseline(model, recipe.match_budget_of_lora_rank, nblocks, targets)
        info["matched_lora_params"] = count_adapter_params(model, baseline)
    alpha = recipe.lora_alpha_ratio * r if recipe.lora_alpha_ratio is not None else recipe.lora_alpha
    common = dict(
        r=r,
        lora_alpha=alpha,
        lora_dropout=recipe.lora_dropout,
        use_rslora=recipe.use_rslora,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    if recipe.method == "bdlora":
        config = BlockDiagLoraConfig(nblocks=nblocks, bd_a_init=recipe.bd_a_init, **common)
    elif recipe.method == "peft-bdlora":
        config = peft_bdlora_config(model, nblocks, common)
    else:
        config = LoraConfig(**common)
    bd = recipe.method in BD_METHODS
    info.update(r=r, lora_alpha=alpha, nblocks=nblocks if bd else 1, target_modules=targets)
    # the learning-rate multipliers this run trains with (optim.py), "auto" resolved: recorded in metrics.json
    info.update(
        bd_lr_ratio=resolve_bd_lr_ratio(recipe.bd_lr_ratio, nblocks) if bd else None,
        loraplus_lr_ratio=None if bd else recipe.loraplus_lr_ratio,
    )
    return config, info
