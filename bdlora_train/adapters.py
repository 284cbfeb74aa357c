"""Saved adapters in PEFT's native BD-LoRA format: read, describe (`bdlora inspect`), load with the toolkit.

Works on any adapter directory PEFT writes (adapter_config.json + adapter_model.safetensors), whether it
came from BlockDiagLoraConfig or from a stock `LoraConfig(use_bdlora=...)`. Roles are read back exactly as
stock PEFT assigns them (substring patterns), so the toolkit never disagrees with PEFT about a file.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig

from bdlora_train.errors import AdapterError, BlockDiagLoraError, first_line
from bdlora_train.patterns import BD_A, BD_B, bdlora_nblocks, stock_roles
from bdlora_train.roles import alpha_for
from bdlora_train.storage import attach_layout, read_layout, verify_expert_shape

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
KEY_PREFIX = "base_model.model."  # PEFT's prefix of every tensor key in adapter_model.safetensors
FACTORS = ("lora_A", "lora_B")


def split_key(key: str) -> tuple[str, str] | None:
    """`base_model.model.<module>.lora_A.weight` -> (module, "lora_A"); None for any other tensor."""
    for factor in FACTORS:
        marker = f".{factor}.weight"
        if key.endswith(marker):
            return key[: -len(marker)].removeprefix(KEY_PREFIX), factor
    return None


@dataclass
class ModuleFactors:
    """One adapted module: its role and the factors as stored (block-diagonal ones packed)."""

    name: str
    role: str | None
    nblocks: int
    A: torch.Tensor  # lora_A.weight: (r, d_in), or packed (r, d_in/N) when role == bd_a
    B: torch.Tensor  # lora_B.weight: (d_out, r), or packed (d_out, r/N) when role == bd_b
    scaling: float
    # A block-diagonal factor stored densely (bdlora_layout.json entry: segment-aware blocks, expert factors). Stock
    # PEFT sees a plain LoRA module (role None); `bd_role` / `bd_nblocks` / `segments` say what it really is.
    structure: dict | None = None

    @property
    def experts(self) -> int:
        return int(self.structure.get("experts", 0)) if self.structure else 0

    @property
    def r(self) -> int:
        return self.A.shape[0] // max(self.experts, 1)

    @property
    def bd_role(self) -> str | None:
        return self.structure["role"] if self.structure else self.role

    @property
    def bd_nblocks(self) -> int:
        return int(self.structure["nblocks"]) if self.structure else self.nblocks

    @property
    def segments(self) -> tuple[int, ...]:
        if self.structure:
            return tuple(self.structure["segments"])
        return (self.d_out,) if self.role == BD_B else (self.d_in,)

    def expert_delta(self, transposed: bool) -> torch.Tensor:
        """scaling * B_e A_e for every expert, in the expert parameter's own layout (E, d1, d2): (E, d_out, d_in),
        or (E, d_in, d_out) for an experts module that stores its weights transposed (`is_transposed`)."""
        a, b = self.expert_factors()
        delta = self.scaling * torch.bmm(b.float(), a.float())
        return delta.transpose(1, 2) if transposed else delta

    def expert_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-expert dense factors of an expert parameter: A (E, r, d_in), B (E, d_out, r), as PEFT's ParamWrapper
        lays them out (expert e: rows e*r.. of lora_A, columns k*E + e of lora_B)."""
        experts = max(self.experts, 1)
        a = self.A.reshape(experts, -1, self.A.shape[-1])
        b = self.B.reshape(self.B.shape[0], -1, experts).permute(2, 0, 1)
        return a, b

    @property
    def d_in(self) -> int:
        return self.A.shape[1] * (self.nblocks if self.role == BD_A else 1)

    @property
    def d_out(self) -> int:
        return self.B.shape[0]

    def dense_A(self) -> torch.Tensor:
        return torch.block_diag(*self.A.chunk(self.nblocks, dim=0)) if self.role == BD_A else self.A

    def dense_B(self) -> torch.Tensor:
        return torch.block_diag(*self.B.chunk(self.nblocks, dim=0)) if self.role == BD_B else self.B

    def delta_weight(self) -> torch.Tensor:
        """scaling * B A, shaped like the base Linear weight (d_out, d_in)."""
        return self.scaling * (self.dense_B().float() @ self.dense_A().float())

    @property
    def params(self) -> int:
        return self.A.numel() + self.B.numel()


@dataclass
class Adapter:
    path: Path
    config: LoraConfig
    nblocks: int  # 1 for a plain LoRA adapter
    modules: dict[str, ModuleFactors] = field(default_factory=dict)
    extra_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. modules_to_save weights
    layout: dict | None = None  # bdlora_layout.json: densely stored block-diagonal factors (storage.py)

    @property
    def bd_nblocks(self) -> int:
        """The TP degree the blocks were trained for, also for an adapter PEFT sees as plain LoRA (experts)."""
        return int(self.layout["nblocks"]) if self.layout else self.nblocks

    @property
    def has_structure(self) -> bool:
        """BD-LoRA to the toolkit: PEFT's use_bdlora and/or a bdlora_layout.json."""
        return self.is_bdlora or self.layout is not None

    @property
    def is_bdlora(self) -> bool:
        return self.config.use_bdlora is not None

    @property
    def params(self) -> int:
        return sum(m.params for m in self.modules.values())

    def base_spec(self, override: str | None = None) -> str:
        """The --model spec of the base this adapter goes with: `override`, else its base_model_name_or_path."""
        from bdlora_train.models import base_spec

        spec = override or self.config.base_model_name_or_path
        if not spec:
            raise AdapterError(f"{self.path}: adapter_config.json names no base_model_name_or_path; pass --model BASE")
        return base_spec(spec)

    def tp_degrees(self) -> list[int]:
        """TP degrees whose shards line up with the blocks: the divisors of nblocks (a re-block below nblocks).
        An adapter with expert factors is a plain LoRA file to PEFT and `export --reblock`: its own nblocks only."""
        if self.is_bdlora:
            return [d for d in range(1, self.nblocks + 1) if self.nblocks % d == 0]
        return [self.bd_nblocks] if self.layout else [1]


def _scaling(config: LoraConfig, name: str, r: int) -> float:
    alpha = alpha_for(config, name)
    return alpha / math.sqrt(r) if config.use_rslora else alpha / r


def read_config(path) -> dict:
    """adapter_config.json of an adapter directory as a dict, or a one-line AdapterError naming the file."""
    path = Path(path)
    file = path / CONFIG_NAME
    if not file.is_file():
        raise AdapterError(f"{path}: no {CONFIG_NAME}; pass the directory save_pretrained wrote")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AdapterError(
            f"{file}: not valid JSON ({first_line(err)}); restore it from the run or re-export the adapter"
        ) from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{file}: top level is {type(raw).__name__}, not an object; restore the file")
    return raw


def read_tensors(path) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors of an adapter directory (never a pickle), or a one-line AdapterError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = Path(path) / WEIGHTS_NAME
    if not file.is_file():
        raise AdapterError(
            f"{path}: no {WEIGHTS_NAME} (only safetensors adapters are read; pickle .bin files are refused)"
        )
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as err:
        raise AdapterError(
            f"{file}: unreadable safetensors ({first_line(err)}); the file is corrupt or truncated, "
            "re-save or re-download the adapter"
        ) from None


def read_adapter(path) -> Adapter:
    """Parse an adapter directory; every inconsistency is a one-line error naming the file and tensor."""
    path = Path(path)
    raw = read_config(path)
    if raw.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type={raw.get('peft_type')!r}; only LoRA / BD-LoRA adapters are supported")
    try:
        config = LoraConfig.from_pretrained(str(path))
    except (TypeError, ValueError) as err:
        raise AdapterError(f"{path / CONFIG_NAME}: not a valid LoraConfig ({first_line(err)})") from None
    tensors = read_tensors(path)
    layout = read_layout(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    extra = {}
    for key, tensor in tensors.items():
        hit = split_key(key)
        if hit:
            pairs.setdefault(hit[0], {})[hit[1]] = tensor
        else:
            extra[key] = tensor
    if config.use_bdlora is not None:
        nblocks = bdlora_nblocks(config.use_bdlora)
        roles = stock_roles(pairs, config.use_bdlora)
    else:
        nblocks, roles = 1, dict.fromkeys(pairs)
    adapter = Adapter(path=path, config=config, nblocks=nblocks, extra_tensors=extra, layout=layout)
    for name, factors in sorted(pairs.items(), key=lambda kv: _natural_key(kv[0])):
        if set(factors) != set(FACTORS):
            raise AdapterError(f"{path}: {name} has {sorted(factors)} but needs both lora_A and lora_B")
        A, B = factors["lora_A"], factors["lora_B"]
        role = roles[name]
        r = A.shape[0]
        expected_b_cols = r // nblocks if role == BD_B else r
        if B.shape[1] != expected_b_cols or (role and r % nblocks):
            raise AdapterError(
                f"{path}: {name} ({role or 'lora'}) has lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)}, "
                f"inconsistent with r={r}, nblocks={nblocks}"
            )
        adapter.modules[name] = ModuleFactors(name, role, nblocks if role else 1, A, B, _scaling(config, name, r))
    if not adapter.modules:
        raise AdapterError(f"{path}: {WEIGHTS_NAME} holds no lora_A/lora_B tensors")
    saved_with = nblocks if config.use_bdlora is not None else None
    if layout is not None and layout.get("use_bdlora_nblocks", saved_with) != saved_with:
        # copied next to another config (e.g. `bdlora export --reblock` / `--to dense-lora`): it describes another
        # adapter; the densely stored factors are then plain LoRA, which is what stock PEFT computes anyway
        warnings.warn(f"{path}: bdlora_layout.json belongs to another adapter_config.json (nblocks changed); ignored")
        adapter.layout = layout = None
    if layout is not None:
        attach_layout(adapter, layout)
        for module in adapter.modules.values():
            if module.structure:  # per-expert rank, not r x experts
                module.scaling = _scaling(config, module.name, module.r)
    return adapter


def _natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def base_model_for(adapter: Adapter, override: str | None = None):
    """The adapter's base model on the meta device (shapes, no weights), from --model or base_model_name_or_path."""
    from bdlora_train.errors import ModelSpecError
    from bdlora_train.models import load_config, meta_model

    spec = adapter.base_spec(override)
    try:
        return meta_model(load_config(spec))
    except ModelSpecError as err:
        raise AdapterError(
            f"{adapter.path}: its base {spec} is needed to check the factor shapes, but {first_line(err)}; "
            "pass --model with a local copy or its config.json"
        ) from None


def verify_shapes(adapter: Adapter, model) -> None:
    """Every adapted module exists in `model` as a Linear with the adapter's (d_in, d_out); one line otherwise.

    This catches what the file alone cannot show, e.g. a block-diagonal A whose nblocks was edited in
    adapter_config.json: (r, d_in/N) then reads as another d_in.
    """
    for name, module in adapter.modules.items():
        if module.experts:
            verify_expert_shape(adapter, model, name, module)
            continue
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            raise AdapterError(
                f"{adapter.path}: module {name} does not exist in the base model; pass the base it was trained on"
            ) from None
        base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
        shape = (getattr(base, "in_features", None), getattr(base, "out_features", None))
        if shape != (module.d_in, module.d_out):
            raise AdapterError(
                f"{adapter.path}: {name} ({module.role or 'lora'}, nblocks={module.nblocks}) factors give "
                f"{module.d_in} -> {module.d_out}, the base Linear is {shape[0]} -> {shape[1]}; the file does not "
                "match this base (edited nblocks or r?) - pass the base it was trained on, or restore the adapter"
            )


def load_adapter(base_model, path, adapter_name: str = "default", is_trainable: bool = False):
    """`PeftModel.from_pretrained` with the toolkit's BD-LoRA layers, keeping exactly the roles in the file.

    Falls back to stock PEFT (with a warning) for adapters whose blocks do not pass the TP-alignment checks.
    """
    from peft import PeftModel

    from bdlora_train.config import BlockDiagLoraConfig, prepare_bdlora_config

    adapter = read_adapter(path)
    if not adapter.has_structure:
        return PeftModel.from_pretrained(base_model, str(path), adapter_name=adapter_name, is_trainable=is_trainable)
    roles = {name: module.bd_role for name, module in adapter.modules.items() if module.bd_role and not module.experts}
    # experts only when the file has expert factors (a bdlora_layout.json lists them): the names an experts=False
    # adapter targets (e.g. a shared expert's gate_proj/up_proj/down_proj) must not pull the experts back in
    has_experts = any(m.experts for m in adapter.modules.values())
    extra = dict(nblocks=adapter.bd_nblocks) if adapter.layout else {}
    extra["experts"] = adapter.layout.get("experts", "tp") if has_experts else False
    try:
        config = BlockDiagLoraConfig.from_lora_config(adapter.config, roles=roles, init_lora_weights=False, **extra)
        prepare_bdlora_config(base_model, config)
        _check_same_structure(adapter, config)
        return PeftModel.from_pretrained(
            base_model, str(path), adapter_name=adapter_name, is_trainable=is_trainable, config=config
        )
    except BlockDiagLoraError as err:
        warnings.warn(f"{path}: {err}; loading with stock PEFT layers instead", stacklevel=2)
        return PeftModel.from_pretrained(base_model, str(path), adapter_name=adapter_name, is_trainable=is_trainable)


def _check_same_structure(adapter: Adapter, config) -> None:
    """The model's layouts must be the file's: same targets, roles, blocks and segments."""
    if set(config.resolved) != set(adapter.modules):
        extra = sorted(set(config.resolved) ^ set(adapter.modules))[:3]
        raise BlockDiagLoraError(f"the base model resolves other targets than the adapter holds (e.g. {extra})")
    for name, module in adapter.modules.items():
        target = config.resolved.get(name)
        if target is None or (module.structure and tuple(target.layout.segments) != module.segments):
            raise BlockDiagLoraError(f"{name}: the base model's layout differs from the adapter's bdlora_layout.json")
        if target.role != module.bd_role or target.nblocks != module.bd_nblocks:
            raise BlockDiagLoraError(f"{name}: role/nblocks in the file differ from the base model's TP layout")


def describe(adapter: Adapter, per_module: bool = False) -> dict:
    """What `bdlora inspect` prints: per module (or per module kind) role, shapes and params; TP degrees."""
    rows = []
    groups: dict[tuple, dict] = {}
    for name, m in adapter.modules.items():
        row = dict(
            module=name,
            role=(
                f"{m.bd_role} (dense, {'experts ' if m.experts else ''}segments {list(m.segments)})"
                if m.structure
                else m.role or "lora"
            ),
            nblocks=m.bd_nblocks,
            r=m.r,
            A_packed=list(m.A.shape),
            B_packed=list(m.B.shape),
            A_dense=[m.r, m.d_in],
            B_dense=[m.d_out, m.r],
            params=m.params,
        )
        if per_module:
            rows.append(row)
            continue
        kind = ".".join(p for p in name.split(".") if not p.isdigit() and p not in ("model", "layers"))
        key = (kind, row["role"], row["r"], tuple(row["A_packed"]), tuple(row["B_packed"]))
        group = groups.setdefault(key, {**row, "module": kind, "count": 0})
        group["count"] += 1
    if not per_module:
        rows = list(groups.values())
    return dict(
        path=str(adapter.path),
        base_model=adapter.config.base_model_name_or_path,
        bdlora=adapter.has_structure,
        nblocks=adapter.bd_nblocks,
        total_params=adapter.params,
        dense_stored=sorted({name.rsplit(".", 1)[-1] for name, m in adapter.modules.items() if m.structure}),
        native_tp=adapter.bd_nblocks if adapter.has_structure else None,
        tp_degrees=adapter.tp_degrees(),
        modules=rows,
    )


def module_table(info: dict) -> list[str]:
    """Markdown rows of `describe(...)["modules"]`: what `bdlora inspect` prints and the model card shows."""
    lines = [
        "| module | count | role | r | A stored | A dense | B stored | B dense | params each |",
        "|---|---:|---|---:|---|---|---|---|---:|",
    ]
    for row in info["modules"]:
        lines.append(
            f"| {row['module']} | {row.get('count', 1)} | {row['role']} | {row['r']} | {tuple(row['A_packed'])} | "
            f"{tuple(row['A_dense'])} | {tuple(row['B_packed'])} | {tuple(row['B_dense'])} | {row['params']:,} |"
        )
    return lines


@contextlib.contextmanager
def quiet_peft_save():
    """PEFT warns "Could not find a config file in <base>" when the base is no Hub id or directory (tiny:llama, the
    embedded GGUF); it only means PEFT cannot check for a resized vocabulary, which a LoRA adapter never has."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Could not find a config file")
        yield
