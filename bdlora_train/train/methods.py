"""Adapter methods beyond the toolkit's own `bdlora`: stock PEFT's BD-LoRA (`method: peft-bdlora`).

`peft-bdlora` is what a user gets from PEFT alone: `LoraConfig(use_bdlora=BdLoraConfig(...))`, PEFT's own layer
(`peft/tuners/lora/variants.py: BdLoraLinearVariant`, einsum forward), PEFT's own init, no toolkit layer and no
`bd_a_init` choice. Only the roles come from the toolkit (the TP plan via `roles.resolve_roles`, every alignment
check), written as the compact substring patterns stock PEFT matches (`patterns.compact_patterns`), so both
BD-LoRA methods block the very same factors and `bdlora compare` measures what the toolkit's layer adds.
"""

from __future__ import annotations

from bdlora_train.errors import RecipeError

BD_METHODS = ("bdlora", "peft-bdlora")  # methods with a block-diagonal factor (nblocks, budget matching apply)
BD_ONLY_KEYS = ("bd_a_init", "bd_lr_ratio")  # recipe keys that change nothing for plain LoRA


def peft_bdlora_config(model, nblocks: int, common: dict):
    """A stock `peft.LoraConfig` with `use_bdlora` for `model` at `nblocks` blocks; `common` holds r, lora_alpha,
    lora_dropout, use_rslora, target_modules, task_type (the same as every other method gets)."""
    from peft import BdLoraConfig, LoraConfig

    from bdlora_train.patterns import BD_A, BD_B, compact_patterns
    from bdlora_train.roles import resolve_roles

    if common["r"] % nblocks:
        raise RecipeError(
            f"recipe: method=peft-bdlora lora_r={common['r']} is not a multiple of nblocks={nblocks}; "
            f"use lora_r={common['r'] + nblocks - common['r'] % nblocks}"
        )
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    roles = resolve_roles(base, LoraConfig(**common), nblocks)
    patterns = compact_patterns(roles)
    use_bdlora = BdLoraConfig(
        target_modules_bd_a=patterns[BD_A], target_modules_bd_b=patterns[BD_B], nblocks=nblocks, match_strict=True
    )
    return LoraConfig(use_bdlora=use_bdlora, **common)


def check_method_keys(recipe) -> None:
    """Keys that only a block-diagonal method reads are refused for plain LoRA instead of silently ignored, and
    `bd_a_init` (a toolkit-layer option) for stock PEFT's layer."""
    if recipe.method not in BD_METHODS and recipe.bd_lr_ratio != 1.0:
        raise RecipeError(
            f"recipe: bd_lr_ratio={recipe.bd_lr_ratio} applies to block-diagonal methods {BD_METHODS}, not "
            f"method={recipe.method}; drop it"
        )
    if recipe.method == "peft-bdlora" and recipe.bd_a_init != "peft":
        raise RecipeError(
            f"recipe: bd_a_init={recipe.bd_a_init} needs the toolkit's layer (method=bdlora); method=peft-bdlora "
            "is stock PEFT's layer and init"
        )
