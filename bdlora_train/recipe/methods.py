"""The PEFT config each recipe `method` asks for (`method_config`): the toolkit's `bdlora`, plain `lora`, and
stock PEFT's BD-LoRA (`method: peft-bdlora`). The run's plan (train/run_plan.py) works out r, alpha, nblocks and the
resolved targets once and calls it; nothing here resolves targets again.

`peft-bdlora` is what a user gets from PEFT alone: `LoraConfig(use_bdlora=BdLoraConfig(...))`, PEFT's own layer
(`peft/tuners/lora/variants.py: BdLoraLinearVariant`, einsum forward), PEFT's own init, no toolkit layer and no
`bd_a_init` choice. Only the roles come from the toolkit (the plan's resolved targets: the TP plan, every alignment
check), written as the compact substring patterns stock PEFT matches (`compact_patterns`), so both BD-LoRA methods
block the very same factors and `bdlora compare` measures what the toolkit's layer adds.
"""

from __future__ import annotations

import dataclasses

from bdlora_train.core.degrees import check_rank
from bdlora_train.core.errors import RecipeError
from bdlora_train.trainer.optim import resolve_bd_lr_ratio

BD_METHODS = ("bdlora", "peft-bdlora")  # methods with a block-diagonal factor (nblocks, budget matching apply)
BD_ONLY_KEYS = ("bd_a_init", "bd_lr_ratio")  # recipe keys that change nothing for plain LoRA
LORA_ONLY_KEYS = ("loraplus_lr_ratio",)  # LoRA+: refused for BD methods (optim.py says why)


def keys_not_read_by(method: str) -> tuple[str, ...]:
    """The recipe keys `method` does not read: a sweep leaves them at their defaults for it (and does not train it
    once per value of them), a recipe that sets them for it is refused (check_method_keys)."""
    return LORA_ONLY_KEYS if method in BD_METHODS else BD_ONLY_KEYS


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


def check_method_rank(method: str, r: int, nblocks: int) -> None:
    """A block-diagonal method's rank must split into nblocks: said before any target is resolved, in the words of
    the config the method builds."""
    if method == "bdlora":
        check_rank(r, nblocks, "BlockDiagLoraConfig")
    elif method == "peft-bdlora":
        check_rank(r, nblocks, "recipe: method=peft-bdlora", key="lora_r", error=RecipeError)


def method_config(method: str, model, common: dict, nblocks: int, bd_a_init: str, targets: dict | None):
    """The PEFT config of `method`: BlockDiagLoraConfig (bound to the resolved `targets`, ready for get_peft_model
    with prepared=True), stock PEFT's LoraConfig with `use_bdlora` patterns for the same roles, or a LoraConfig.
    `common` holds r, lora_alpha, lora_dropout, use_rslora, target_modules, task_type (the same for every method);
    `targets`: the plan's resolved targets (None for plain LoRA outside TP)."""
    from peft import LoraConfig

    if method == "lora":
        return LoraConfig(**common)
    if method == "bdlora":
        from bdlora_train.peft_integration.config import BlockDiagLoraConfig, prepare_bdlora_config

        config = BlockDiagLoraConfig(nblocks=nblocks, bd_a_init=bd_a_init, **common)
        return prepare_bdlora_config(model, config, targets=targets)
    from peft import BdLoraConfig

    from bdlora_train.core.roles import BD_A, BD_B
    from bdlora_train.peft_integration.patterns import compact_patterns

    patterns = compact_patterns({name: t.role for name, t in targets.items()})
    use_bdlora = BdLoraConfig(
        target_modules_bd_a=patterns[BD_A], target_modules_bd_b=patterns[BD_B], nblocks=nblocks, match_strict=True
    )
    return LoraConfig(use_bdlora=use_bdlora, **common)
