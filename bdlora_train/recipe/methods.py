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
from dataclasses import dataclass

from bdlora_train.core.degrees import check_rank
from bdlora_train.core.errors import RecipeError
from bdlora_train.core.keys import check_fields, key
from bdlora_train.core.roles import DEFAULT_TARGET_MODULES
from bdlora_train.trainer.optim import resolve_bd_lr_ratio

METHODS = ("bdlora", "lora", "peft-bdlora")
BD_METHODS = ("bdlora", "peft-bdlora")  # methods with a block-diagonal factor (nblocks, budget matching apply)
BD_ONLY_KEYS = ("bd_a_init", "bd_lr_ratio")  # recipe keys that change nothing for plain LoRA
LORA_ONLY_KEYS = ("loraplus_lr_ratio",)  # LoRA+: refused for BD methods (optim.py says why)


@dataclass
class AdapterKeys:
    """The recipe's adapter section: the method, its rank and scaling, where it attaches, its block structure and
    its factors' learning-rate ratios."""

    method: str = key(
        "bdlora", "bdlora | lora | peft-bdlora (stock PEFT's BD-LoRA layer and init, same roles)", choices=METHODS
    )
    lora_r: int | None = key(
        24, "LoRA rank r (for bdlora: a multiple of nblocks); null with match_budget_of_lora_rank, which sets it", low=1
    )
    lora_alpha: float | None = key(
        16,
        "LoRA alpha; scaling = alpha / r (alpha / sqrt(r) with use_rslora); > 0; with lora_alpha_ratio it is "
        "ratio * r (null until budget matching gives r)",
        low=1e-12,
    )
    lora_alpha_ratio: float | None = key(
        None, "if set, lora_alpha = ratio * r (after budget matching), e.g. 2 for alpha = 2r", low=1e-12
    )
    lora_dropout: float = key(0.0, "dropout on the adapter input, in [0, 1)", low=0, high=1, high_open=True)
    use_rslora: bool = key(False, "rank-stabilized scaling alpha / sqrt(r)")
    lora_target_modules: list[str] | None = key(None, "default: q,k,v,o,gate,up,down projections")
    nblocks: int | None = key(
        None,
        "BD-LoRA blocks = the TP degree the adapter is served at; null: the largest of 8, 6, 4, 3, 2, 1 that "
        "divides the heads and KV heads",
    )
    match_budget_of_lora_rank: int | None = key(
        None, "BD-LoRA rank = largest with <= the params of LoRA at this rank", low=1
    )
    bd_a_init: str = key("peft", "init of block-diagonal A factors", choices=("peft", "lora"))
    bd_lr_ratio: float | str = key(
        "auto",
        "learning-rate multiplier for the block-diagonal factor; auto: nblocks (its fan-in is 1/nblocks of the dense "
        "factor's); 1: stock PEFT's single rate; BD methods only (LoRA ignores auto); docs/compare.md",
        low=1e-12,
    )
    loraplus_lr_ratio: float = key(
        1.0, "LoRA+: lora_B's learning rate = ratio x learning_rate (Hayou et al. 2024); method=lora only", low=1e-12
    )

    def __post_init__(self):
        """Keys other keys decide hold the value the run uses, so --print-recipe and recipe.yaml show it: with
        match_budget_of_lora_rank the rank comes from the budget (lora_r null), with lora_alpha_ratio alpha is
        ratio * r (null while r waits for budget matching). `load_recipe` refuses a recipe that gives both."""
        if self.match_budget_of_lora_rank is not None:
            self.lora_r = None
        if self.lora_alpha_ratio is not None:
            self.lora_alpha = self.lora_alpha_ratio * self.lora_r if self.lora_r is not None else None

    def check(self) -> None:
        if self.lora_r is None and self.match_budget_of_lora_rank is None:
            raise RecipeError("recipe: lora_r is null; give a rank (or match_budget_of_lora_rank=R to match LoRA r=R)")
        if self.lora_alpha is None and self.lora_alpha_ratio is None:
            raise RecipeError("recipe: lora_alpha is null; give a number > 0 (or lora_alpha_ratio, e.g. 2 for 2r)")
        check_fields(self)
        if self.nblocks is not None and self.nblocks < 1:
            raise RecipeError(f"recipe: nblocks={self.nblocks} must be >= 1 or null (auto)")
        if self.match_budget_of_lora_rank is not None and self.method not in BD_METHODS:
            raise RecipeError(
                "recipe: match_budget_of_lora_rank applies to method=bdlora only; drop it or set method=bdlora"
            )
        check_method_keys(self)

    @property
    def targets(self) -> list[str]:
        return list(self.lora_target_modules or DEFAULT_TARGET_MODULES)


def keys_not_read_by(method: str) -> tuple[str, ...]:
    """The recipe keys `method` does not read: a sweep leaves them at their defaults for it (and does not train it
    once per value of them), a recipe that sets them for it is refused (check_method_keys)."""
    return LORA_ONLY_KEYS if method in BD_METHODS else BD_ONLY_KEYS


def check_method_keys(recipe: AdapterKeys) -> None:
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
