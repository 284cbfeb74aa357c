"""`BlockDiagLoraConfig`: a `peft.LoraConfig` whose only BD-LoRA knob is `nblocks`.

Roles are read from the model's TP plan when PEFT injects the adapter; what gets saved is a plain
`LoraConfig` with `use_bdlora` patterns that stock PEFT (>= 0.20) reads back into exactly those roles.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from peft import BdLoraConfig, LoraConfig

from bdlora_train.roles import (
    BD_A,
    DEFAULT_TARGET_MODULES,
    BlockDiagLoraError,
    compact_patterns,
    resolve_roles,
)

# Inits that decompose the base weight into A and B assume both factors are dense.
_DENSE_ONLY_INITS = ("pissa", "olora", "loftq", "corda", "eva", "orthogonal", "lora_ga")
BD_A_INITS = ("peft", "lora")
_TOOLKIT_FIELDS = ("nblocks", "roles", "bd_a_init")


@dataclass
class BlockDiagLoraConfig(LoraConfig):
    """LoRA with one block-diagonal factor per layer, aligned with the model's tensor-parallel shards.

    Args:
        nblocks: number of diagonal blocks = the TP degree the adapter is served at. Must divide `r`,
            the attention and KV heads, and the block-diagonal factor's features.
        roles: optional overrides, {module name or dotted suffix: "bd_a" | "bd_b"}, for modules the TP plan
            does not cover. Everything else comes from the architecture.
        bd_a_init: "peft" keeps PEFT's kaiming-uniform(a=0) init of a block-diagonal A (about 3.5x the
            vanilla LoRA A scale at nblocks 2); "lora" draws it like vanilla LoRA's A, U(-1/sqrt(d_in), 1/sqrt(d_in)).
    """

    nblocks: Optional[int] = field(default=None, metadata={"help": "Number of diagonal blocks (= TP degree)."})
    roles: Optional[dict] = field(default=None, metadata={"help": "Role overrides: {module: 'bd_a'|'bd_b'}."})
    bd_a_init: str = field(default="peft", metadata={"help": "Init of a block-diagonal A: 'peft' or 'lora'."})

    def __post_init__(self):
        if self.target_modules is None:
            self.target_modules = list(DEFAULT_TARGET_MODULES)
        if not isinstance(self.nblocks, int) or isinstance(self.nblocks, bool) or self.nblocks < 1:
            raise BlockDiagLoraError(f"BlockDiagLoraConfig: nblocks={self.nblocks!r} must be a positive int (the TP degree, e.g. 8)")
        if self.r % self.nblocks:
            raise BlockDiagLoraError(
                f"BlockDiagLoraConfig: r={self.r} is not a multiple of nblocks={self.nblocks}; "
                f"use r={self.r + self.nblocks - self.r % self.nblocks}"
            )
        if self.bd_a_init not in BD_A_INITS:
            raise BlockDiagLoraError(f"BlockDiagLoraConfig: bd_a_init={self.bd_a_init!r}; use one of {BD_A_INITS}")
        init = self.init_lora_weights
        if isinstance(init, str) and init.lower().startswith(_DENSE_ONLY_INITS):
            raise BlockDiagLoraError(
                f"BlockDiagLoraConfig: init_lora_weights={init!r} assumes dense A and B; use True (default) or 'gaussian'"
            )
        if self.use_dora or self.lora_bias:
            raise BlockDiagLoraError("BlockDiagLoraConfig: use_dora / lora_bias are not supported with block-diagonal factors")
        if self.use_bdlora is None:
            # Patterns are filled in by `bind` once the model is known.
            self.use_bdlora = BdLoraConfig(target_modules_bd_a=[], target_modules_bd_b=[], nblocks=self.nblocks, match_strict=True)
        super().__post_init__()
        self.resolved_roles: dict[str, str] = {}

    def bind(self, model: torch.nn.Module) -> dict[str, str]:
        """Resolve and check the role of every targeted module; write PEFT's `use_bdlora` patterns."""
        self.resolved_roles = resolve_roles(model, self, self.nblocks, self.roles)
        patterns = compact_patterns(self.resolved_roles)
        self.use_bdlora = BdLoraConfig(
            target_modules_bd_a=patterns[BD_A],
            target_modules_bd_b=patterns["bd_b"],
            nblocks=self.nblocks,
            match_strict=True,
        )
        from bdlora_train.layers import BdLoraLinear  # the fused fast path (layers.py) is the default layer

        self._register_custom_module({torch.nn.Linear: BdLoraLinear})
        return self.resolved_roles

    def initialize(self, lora_model, adapter_name: str) -> None:
        """Apply `bd_a_init` after PEFT created the layers."""
        if self.bd_a_init != "lora" or self.init_lora_weights is False:
            return
        for name, role in self.resolved_roles.items():
            if role != BD_A:
                continue
            layer = lora_model.model.get_submodule(name)
            weight = layer.lora_A[adapter_name].weight
            bound = 1.0 / math.sqrt(layer.in_features)
            with torch.no_grad():
                weight.uniform_(-bound, bound)

    def to_dict(self):
        """A stock `LoraConfig` dict: PEFT without bdlora_train loads it."""
        d = super().to_dict()
        for key in _TOOLKIT_FIELDS:
            d.pop(key, None)
        d.pop("resolved_roles", None)
        return d

    @classmethod
    def from_lora_config(cls, config: LoraConfig, **overrides) -> "BlockDiagLoraConfig":
        """Lift a stock BD-LoRA `LoraConfig` (e.g. read from adapter_config.json) into this class."""
        fields = {k: v for k, v in config.to_dict().items() if k in cls.__dataclass_fields__ and k != "peft_type"}
        bd = config.use_bdlora
        if bd is None:
            raise BlockDiagLoraError("from_lora_config: the LoraConfig has no use_bdlora; it is a plain LoRA adapter")
        nblocks = bd["nblocks"] if isinstance(bd, dict) else bd.nblocks
        fields.update(nblocks=nblocks, use_bdlora=None, **overrides)
        return cls(**fields)


def _install_peft_hook() -> None:
    """Resolve roles when PEFT injects a BlockDiagLoraConfig.

    PEFT hands a config nothing of the model before it builds the layers; `LoraModel.inject_adapter` is the
    one place that sees both (used by `get_peft_model`, `add_adapter` and `PeftModel.from_pretrained`). The
    wrapper touches nothing but BlockDiagLoraConfig.
    """
    from peft.tuners.lora.model import LoraModel

    original = LoraModel.inject_adapter
    if getattr(original, "_bdlora_hook", False):
        return

    @functools.wraps(original)
    def inject_adapter(self, model, adapter_name, *args, **kwargs):
        config = self.peft_config[adapter_name]
        if isinstance(config, BlockDiagLoraConfig):
            config.bind(model)
        result = original(self, model, adapter_name, *args, **kwargs)
        if isinstance(config, BlockDiagLoraConfig):
            config.initialize(self, adapter_name)
        return result

    inject_adapter._bdlora_hook = True
    LoraModel.inject_adapter = inject_adapter


_install_peft_hook()
