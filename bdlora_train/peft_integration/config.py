"""`BlockDiagLoraConfig`: a `peft.LoraConfig` whose only BD-LoRA knob is `nblocks`, and the one call that binds it.

The seam with PEFT is explicit: PEFT hands a config nothing of the model before it builds the layers, so roles
are resolved by `prepare_bdlora_config(model, config)` (PEFT's own idiom for model-dependent configs, like
`preprocess_corda`), and `bdlora_train.get_peft_model` is stock `get_peft_model` after that call. Nothing in
PEFT is patched. What gets saved is a plain `LoraConfig` with `use_bdlora` patterns that stock PEFT (>= 0.20)
reads back into exactly the resolved roles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from peft import BdLoraConfig, LoraConfig

from bdlora_train.arch.targets import DENSE, PACKED, expert_mode
from bdlora_train.core.degrees import check_rank
from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.core.naming import canonical, unwrap
from bdlora_train.core.roles import BD_A, BD_B, DEFAULT_TARGET_MODULES
from bdlora_train.peft_integration.experts import ParamWrapper
from bdlora_train.peft_integration.layers import BlockDiagLoraLinear
from bdlora_train.peft_integration.masked import uniform_
from bdlora_train.peft_integration.patterns import bdlora_nblocks, compact_names, compact_patterns
from bdlora_train.peft_integration.quant_layers import custom_modules as quantized_layers
from bdlora_train.peft_integration.resolve import resolve
from bdlora_train.peft_integration.storage import layout_record, wrapper_keys, write_layout

# Inits that decompose the base weight into A and B assume both factors are dense.
_DENSE_ONLY_INITS = ("pissa", "olora", "loftq", "corda", "eva", "orthogonal", "lora_ga")
BD_A_INITS = ("peft", "lora")
_TOOLKIT_FIELDS = ("nblocks", "roles", "bd_a_init", "experts")


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
        experts: MoE expert parameters: "tp" (default; TP-sharded experts, block-diagonal per expert), "ep"
            (expert parallelism: whole experts per rank, so dense per-expert factors, nblocks 1), or False
            (leave the experts out; the only way a default-target run on a MoE model adapts no experts).
    """

    nblocks: Optional[int] = field(default=None, metadata={"help": "Number of diagonal blocks (= TP degree)."})
    roles: Optional[dict] = field(default=None, metadata={"help": "Role overrides: {module: 'bd_a'|'bd_b'}."})
    bd_a_init: str = field(default="peft", metadata={"help": "Init of a block-diagonal A: 'peft' or 'lora'."})
    experts: object = field(default="tp", metadata={"help": "MoE experts: 'tp', 'ep' (nblocks 1) or False."})

    def __post_init__(self):
        if self.target_modules is None:
            self.target_modules = list(DEFAULT_TARGET_MODULES)
        if not isinstance(self.nblocks, int) or isinstance(self.nblocks, bool) or self.nblocks < 1:
            raise BlockDiagLoraConfigError(
                f"BlockDiagLoraConfig: nblocks={self.nblocks!r} must be a positive int (the TP degree, e.g. 8)"
            )
        check_rank(self.r, self.nblocks, "BlockDiagLoraConfig")
        self.experts = expert_mode(self.experts)
        if self.bd_a_init not in BD_A_INITS:
            raise BlockDiagLoraConfigError(
                f"BlockDiagLoraConfig: bd_a_init={self.bd_a_init!r}; use one of {BD_A_INITS}"
            )
        init = self.init_lora_weights
        if isinstance(init, str) and init.lower().startswith(_DENSE_ONLY_INITS):
            raise BlockDiagLoraConfigError(
                f"BlockDiagLoraConfig: init_lora_weights={init!r} assumes dense A and B; use True (default) or "
                "'gaussian'"
            )
        if self.use_dora or self.lora_bias:
            raise BlockDiagLoraConfigError(
                "BlockDiagLoraConfig: use_dora / lora_bias are not supported with block-diagonal factors"
            )
        if self.use_bdlora is None:
            # Empty patterns with match_strict: until `prepare_bdlora_config` fills them in, stock PEFT refuses
            # every target instead of silently building dense LoRA.
            self.use_bdlora = BdLoraConfig(
                target_modules_bd_a=[], target_modules_bd_b=[], nblocks=self.nblocks, match_strict=True
            )
        super().__post_init__()
        self.resolved_roles: dict[str, str] = {}
        self.resolved: dict = {}  # name -> targets.Target, after prepare_bdlora_config
        self.layout_record: dict | None = None  # what save_pretrained writes to bdlora_layout.json
        # The fused fast path is the layer for every nn.Linear; bitsandbytes / torchao bases first: they are nn.Linear
        # subclasses, and PEFT takes the first isinstance match.
        self._register_custom_module({**quantized_layers(), torch.nn.Linear: BlockDiagLoraLinear})

    @property
    def is_prepared(self) -> bool:
        """prepare_bdlora_config has bound this config to a model's resolved targets."""
        return bool(self.resolved_roles)

    @property
    def stores_dense(self) -> bool:
        """True when the adapter holds expert factors: saved as a plain LoRA adapter (see
        peft_integration/storage.py)."""
        return any(t.kind == "expert" for t in self.resolved.values())

    def lora_a_init_(self, weight: torch.Tensor, in_features: int) -> None:
        """`bd_a_init="lora"`: redraw a block-diagonal A like vanilla LoRA's A, U(-1/sqrt(d_in), 1/sqrt(d_in))."""
        if self.bd_a_init != "lora" or self.init_lora_weights is False:
            return
        uniform_(weight, 1.0 / math.sqrt(in_features))

    def to_dict(self):
        """A stock `LoraConfig` dict: PEFT without bdlora_train loads it (no use_bdlora when experts are adapted:
        PEFT cannot build expert factors under it, see storage.py)."""
        d = super().to_dict()
        for key in (*_TOOLKIT_FIELDS, "resolved_roles", "resolved", "layout_record"):
            d.pop(key, None)
        if self.stores_dense:
            d["use_bdlora"] = None
        return d

    def save_pretrained(self, save_directory, **kwargs):
        """PEFT's adapter_config.json, plus bdlora_layout.json when some factor is stored densely."""
        super().save_pretrained(save_directory, **kwargs)
        write_layout(save_directory, self.layout_record)

    @classmethod
    def from_lora_config(cls, config: LoraConfig, **overrides) -> "BlockDiagLoraConfig":
        """Lift a stock BD-LoRA `LoraConfig` (e.g. read from adapter_config.json) into this class."""
        fields = {k: v for k, v in config.to_dict().items() if k in cls.__dataclass_fields__ and k != "peft_type"}
        if config.use_bdlora is None and "nblocks" not in overrides:
            raise BlockDiagLoraConfigError(
                "from_lora_config: the LoraConfig has no use_bdlora; it is a plain LoRA adapter"
            )
        nblocks = overrides.pop("nblocks", None) or bdlora_nblocks(config.use_bdlora)
        fields.update(nblocks=nblocks, use_bdlora=None, **overrides)
        return cls(**fields)


def prepare_bdlora_config(model: torch.nn.Module, config: BlockDiagLoraConfig, targets=None) -> BlockDiagLoraConfig:
    """Resolve and check every target `config` asks for in `model`; write the PEFT fields that build exactly them.

    Call it before any PEFT entry point that takes a config (`get_peft_model`, `PeftModel.add_adapter`,
    `PeftModel.from_pretrained(config=...)`); `bdlora_train.get_peft_model` does it for you. Returns `config`.
    Sets `target_modules` / `target_parameters` to name exactly the resolved targets, `use_bdlora` to patterns
    that give exactly the packed roles, and verifies that PEFT's transformers-v5 MoE conversion leaves them alone.
    `targets`: what `resolve(model, config, ...)` returned for this request already (a run's plan, train/run_plan.py);
    bound as given, not resolved again.
    """
    if not isinstance(config, BlockDiagLoraConfig):
        raise BlockDiagLoraConfigError(
            f"prepare_bdlora_config: got {type(config).__name__}; pass a BlockDiagLoraConfig"
        )
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if targets is None:
        targets = resolve(base, config, config.nblocks, config.roles, config.experts)
    elif any(t.r != config.r for t in targets.values()) and not config.rank_pattern:
        raise BlockDiagLoraConfigError(
            f"prepare_bdlora_config: the targets were resolved at r={sorted({t.r for t in targets.values()})}, the "
            f"config has r={config.r}; resolve them for this config"
        )
    config.resolved = targets
    config.resolved_roles = {name: t.role for name, t in targets.items()}
    linears = [n for n, t in targets.items() if t.kind == "linear"]
    params = [n for n, t in targets.items() if t.kind == "expert"]
    universe = {canonical(n) for n, _ in base.named_modules() if n and ".lora_" not in n}
    config.target_modules = compact_names(linears, universe) if linears else []
    config.target_parameters = compact_names(params, [n for n in _param_names(base)]) if params else None
    packed = {n: t.role for n, t in targets.items() if t.kind == "linear" and t.storage == PACKED}
    dense = [n for n, t in targets.items() if t.kind == "linear" and t.storage == DENSE]
    patterns = compact_patterns(packed, dense)
    config.use_bdlora = BdLoraConfig(
        target_modules_bd_a=patterns[BD_A],
        target_modules_bd_b=patterns[BD_B],
        nblocks=config.nblocks,
        match_strict=not dense,
    )
    for name in params:
        owner = unwrap(base.get_submodule(name.rpartition(".")[0]))
        config._register_custom_module({type(owner): ParamWrapper})
    config.layout_record = layout_record(targets, config.nblocks, config.experts, wrapper_keys(base, targets))
    return config


def _param_names(model) -> list[str]:
    return sorted(
        {canonical(f"{m}.{p}") for m, mod in model.named_modules() for p, _ in mod.named_parameters(recurse=False)}
    )


def get_peft_model(model: torch.nn.Module, peft_config: LoraConfig, prepared: bool = False, **kwargs):
    """`peft.get_peft_model`, with a `BlockDiagLoraConfig` prepared for `model` first (any other config passes
    through). `prepared=True`: the config was prepared already, for this model or its meta-device twin (a run's
    plan, train/run_plan.py), and is used as it is."""
    import peft

    if prepared and isinstance(peft_config, BlockDiagLoraConfig) and not peft_config.is_prepared:
        raise BlockDiagLoraConfigError(
            "get_peft_model: prepared=True but the config was never prepared; drop prepared=True"
        )
    if isinstance(peft_config, BlockDiagLoraConfig) and not prepared:
        prepare_bdlora_config(model, peft_config)
    return peft.get_peft_model(model, peft_config, **kwargs)
