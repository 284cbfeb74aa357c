"""How a base is quantized: the recipe keys load_in_4bit, load_in_8bit, torchao_int8 and the bnb_4bit_* options,
checked without a model (and without importing torch, so `bdlora train --help` stays fast)."""

from __future__ import annotations

import dataclasses

from bdlora_train.core.dtypes import DTYPES
from bdlora_train.core.errors import RecipeError

BNB_4BIT = "bitsandbytes-4bit"
BNB_8BIT = "bitsandbytes-8bit"
TORCHAO_INT8 = "torchao-int8"
SWITCHES = {"load_in_4bit": BNB_4BIT, "load_in_8bit": BNB_8BIT, "torchao_int8": TORCHAO_INT8}
QUANT_TYPES = ("nf4", "fp4")


@dataclasses.dataclass(frozen=True)
class QuantKeys:
    """How the base is quantized (the recipe keys of the same names); all off: a float base."""

    load_in_4bit: bool = False
    load_in_8bit: bool = False
    torchao_int8: bool = False
    bnb_4bit_quant_type: str = "nf4"
    bnb_4bit_compute_dtype: str | None = None
    bnb_4bit_use_double_quant: bool = False
    torch_dtype: str = "float32"

    @property
    def kind(self) -> str | None:
        """BNB_4BIT, BNB_8BIT, TORCHAO_INT8, or None for a float base."""
        return next((kind for key, kind in SWITCHES.items() if getattr(self, key)), None)

    @property
    def switches_on(self) -> list[str]:
        return [key for key in SWITCHES if getattr(self, key)]

    def check(self) -> "QuantKeys":
        """The keys' own checks (no model needed)."""
        on = self.switches_on
        if len(on) > 1:
            raise RecipeError(f"recipe: {' and '.join(k + '=true' for k in on)}; a base is quantized one way, pick one")
        if self.bnb_4bit_quant_type not in QUANT_TYPES:
            raise RecipeError(f"recipe: bnb_4bit_quant_type={self.bnb_4bit_quant_type!r}; use one of {QUANT_TYPES}")
        if self.torch_dtype not in DTYPES:
            raise RecipeError(f"recipe: torch_dtype={self.torch_dtype!r}; use one of {', '.join(DTYPES)}")
        if self.bnb_4bit_compute_dtype not in (None, *DTYPES):
            raise RecipeError(
                f"recipe: bnb_4bit_compute_dtype={self.bnb_4bit_compute_dtype!r}; use float32, bfloat16, float16 or "
                "null (= torch_dtype)"
            )
        four_bit_only = (
            self.bnb_4bit_use_double_quant or self.bnb_4bit_compute_dtype or self.bnb_4bit_quant_type != "nf4"
        )
        if four_bit_only and not self.load_in_4bit:
            raise RecipeError("recipe: bnb_4bit_* keys apply to load_in_4bit=true only; set it or drop them")
        return self
