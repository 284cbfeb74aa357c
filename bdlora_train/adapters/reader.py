"""Read an adapter directory (adapter_config.json, adapter_model.safetensors, bdlora_layout.json) into an `Adapter`
of `ModuleFactors`; every inconsistency is a one-line AdapterError naming the file and tensor. Never a pickle."""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig

from bdlora_train.arch.targets import DENSE, Target
from bdlora_train.core.blocks import dense_from_packed
from bdlora_train.core.degrees import divides, servable_degrees
from bdlora_train.core.errors import AdapterError, first_line
from bdlora_train.core.layout import Layout
from bdlora_train.core.roles import BD_A, BD_B, Role
from bdlora_train.kernels.experts import expert_delta
from bdlora_train.models import base_spec
from bdlora_train.peft_integration.patterns import bdlora_nblocks, stock_roles
from bdlora_train.peft_integration.resolve import alpha_for, rank_for
from bdlora_train.peft_integration.storage import peft_masks, read_layout

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
    role: Role | None
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
    def bd_role(self) -> Role | None:
        return Role(self.structure["role"]) if self.structure else self.role

    @property
    def bd_nblocks(self) -> int:
        return int(self.structure["nblocks"]) if self.structure else self.nblocks

    @property
    def segments(self) -> tuple[int, ...]:
        if self.structure:
            return tuple(self.structure["segments"])
        return (self.d_out,) if self.role == BD_B else (self.d_in,)

    def expert_delta(self, transposed: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """scaling * B_e A_e for every expert, in the expert parameter's own layout (E, d1, d2): (E, d_out, d_in),
        or (E, d_in, d_out) for an experts module that stores its weights transposed (`is_transposed`)."""
        return expert_delta(self.A, self.B, max(self.experts, 1), self.scaling, transposed, dtype)

    @property
    def d_in(self) -> int:
        return self.A.shape[1] * (self.nblocks if self.role == BD_A else 1)

    @property
    def d_out(self) -> int:
        return self.B.shape[0]

    def dense_A(self) -> torch.Tensor:
        return dense_from_packed(self.A, self.nblocks) if self.role == BD_A else self.A

    def dense_B(self) -> torch.Tensor:
        return dense_from_packed(self.B, self.nblocks) if self.role == BD_B else self.B

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
        spec = override or self.config.base_model_name_or_path
        if not spec:
            raise AdapterError(f"{self.path}: adapter_config.json names no base_model_name_or_path; pass --model BASE")
        return base_spec(spec)

    def tp_degrees(self) -> list[int]:
        """TP degrees whose shards line up with the blocks: the divisors of nblocks (a re-block below nblocks).
        An adapter with expert factors is a plain LoRA file to PEFT and `export --reblock`: its own nblocks only."""
        if self.is_bdlora:
            return servable_degrees(self.nblocks)
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
        if B.shape[1] != expected_b_cols or (role and not divides(nblocks, r)):
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
    check_ranks(adapter)
    return adapter


def check_ranks(adapter: Adapter) -> None:
    """Every module's tensors have the rank adapter_config.json gives it (`r` or `rank_pattern`): PEFT builds the
    layers from the config and then fails to load tensors of another rank, and the scaling alpha / r would be wrong.
    Expert parameters without a bdlora_layout.json stack r rows per expert, so a multiple of r is theirs."""
    stacked = bool(getattr(adapter.config, "target_parameters", None))
    for name, module in adapter.modules.items():
        expected = rank_for(adapter.config, name)
        if module.r == expected or (stacked and not module.structure and module.r % expected == 0):
            continue
        raise AdapterError(
            f"{adapter.path}: {CONFIG_NAME} gives {name} rank {expected}, but its tensors have rank {module.r} "
            f"(lora_A {tuple(module.A.shape)}); stock PEFT cannot load this adapter: restore the adapter_config.json "
            "saved with these weights"
        )


def _natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def attach_layout(adapter, layout: dict) -> None:
    """Give densely stored modules their structure, keyed by the target name, after checking that every entry
    outside the blocks is an explicit zero (else stock PEFT would compute something the blocks do not say)."""
    by_key = {}
    for name, entry in layout["targets"].items():
        module = adapter.modules.pop(entry.get("key", name), None)
        if module is None or module.role is not None:
            raise AdapterError(
                f"{adapter.path}: bdlora_layout.json names {name} (tensors {entry.get('key', name)}) but the adapter "
                "holds no plain LoRA factors there; restore the adapter directory as saved"
            )
        by_key[name] = (module, entry)
    for name, (module, entry) in by_key.items():
        lay = Layout(
            name=name,
            style="",
            role=Role(entry["role"]),
            segments=tuple(entry["segments"]),
            d_in=entry["d_in"],
            d_out=entry["d_out"],
            experts=entry.get("experts", 0),
        )
        if lay.parallel != entry["parallel"]:
            raise AdapterError(
                f"{adapter.path}: bdlora_layout.json gives {name} role {entry['role']} but parallel "
                f"{entry['parallel']} (role {entry['role']} is {lay.parallel}-parallel); restore the adapter "
                "directory as saved"
            )
        target = Target(lay, int(entry["nblocks"]), int(entry["r"]), DENSE)
        mask_a, mask_b = peft_masks(target)
        for label, mask, weight in (("lora_A", mask_a, module.A), ("lora_B", mask_b, module.B)):
            if mask is None:
                continue
            if tuple(mask.shape) != tuple(weight.shape):
                raise AdapterError(
                    f"{adapter.path}: {name}: {label} {tuple(weight.shape)} does not match bdlora_layout.json "
                    f"({tuple(mask.shape)}); restore the adapter directory as saved"
                )
            if weight[~mask].abs().max().item() if (~mask).any() else 0:
                raise AdapterError(
                    f"{adapter.path}: {name}: {label} has non-zero entries outside its blocks, so stock PEFT would "
                    "compute a different adapter than its bdlora_layout.json says; re-save it from the toolkit"
                )
        module.name, module.structure = name, entry
        adapter.modules[name] = module
