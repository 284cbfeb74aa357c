"""How a block-diagonal factor PEFT's `use_bdlora` cannot express is stored: densely, with explicit zeros.

PEFT's `use_bdlora` packs contiguous blocks only, and PEFT 0.21.2 cannot combine it with `target_parameters` at
all (`ParamWrapper.update_layer` asks `resolve_lora_variant`, and any config with `use_bdlora` requests the
('use_bdlora',) variant, which ParamWrapper does not have: "Invalid or unsupported variant combination"). So:

* a **segment-aware** factor (Phi-3 `qkv_proj`, `gate_up_proj`) is a plain LoRA entry of the same adapter
  (matched by no `use_bdlora` pattern, `match_strict` off), its zeros written out;
* an adapter with **expert** factors is a plain LoRA adapter (`target_modules` + `target_parameters`, no
  `use_bdlora`) in which every block-diagonal factor is written densely with its zeros.

Stock PEFT loads either and computes exactly what was trained (zeros are zeros). `bdlora_layout.json` next to
the weights tells the toolkit (and serving) the structure: per dense-stored target its role, nblocks, segments,
experts and tensor key; readers verify the zeros against it and refuse a file whose off-block entries are not.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bdlora_train.errors import AdapterError
from bdlora_train.families import shard_rows

LAYOUT_NAME = "bdlora_layout.json"
FORMAT = "bdlora-layout/1"


def factor_mask(segments, r: int, nblocks: int) -> torch.Tensor:
    """(split, r) boolean mask of a block-diagonal factor along a split dimension laid out in `segments`:
    index j belongs to rank i iff it lies in the i-th 1/N slice of its segment; rank i owns rank columns
    [i*r/N, (i+1)*r/N)."""
    split = sum(segments)
    mask = torch.zeros(split, r, dtype=torch.bool)
    k = r // nblocks
    for rank in range(nblocks):
        rows = shard_rows(tuple(segments), nblocks, rank)
        mask[rows, rank * k : (rank + 1) * k] = True
    return mask


def peft_masks(target) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Masks shaped like PEFT's `lora_A.weight` / `lora_B.weight` of a dense-stored target (None: no mask).

    Linear: A (r, d_in), B (d_out, r). Experts (ParamWrapper): A (r*E, d_in), expert e's rows e*r..(e+1)*r;
    B (d_out, r*E), expert e's rank column k at k*E + e (peft/tuners/lora/layer.py, ParamWrapper.get_delta_weight).
    """
    lay, r, n = target.layout, target.r, target.nblocks
    if n == 1:
        return None, None
    single = factor_mask(lay.segments, r, n)  # (split, r)
    experts = max(lay.experts, 1)
    if lay.factor == "A":
        mask = single.t()  # (r, d_in)
        return (mask.repeat(experts, 1) if lay.experts else mask), None
    if lay.experts:
        return None, single.unsqueeze(-1).expand(-1, -1, experts).reshape(single.shape[0], r * experts)
    return None, single


def wrapper_keys(model, targets) -> dict[str, str]:
    """Expert parameter -> the module path PEFT saves its factors under.

    PEFT wraps the targeted parameters of one module in the order the module registered them, each new wrapper
    around the previous one, so the first is deepest: `experts.base_layer.lora_A` (gate_up_proj), `experts.lora_A`
    (down_proj) for Mixtral (peft/tuners/tuners_utils.py, `_inject_parameters`).
    """
    by_owner: dict[str, list[str]] = {}
    for name, target in targets.items():
        if target.kind == "expert":
            by_owner.setdefault(name.rpartition(".")[0], []).append(name.rpartition(".")[2])
    keys = {}
    for owner, params in by_owner.items():
        module = model.get_submodule(owner)
        while hasattr(module, "get_base_layer"):
            module = module.get_base_layer()
        order = [p for p, _ in module.named_parameters(recurse=False) if p in params]
        for i, param in enumerate(order):
            keys[f"{owner}.{param}"] = owner + ".base_layer" * (len(order) - 1 - i)
    return keys


def layout_record(targets, nblocks: int, experts: str, keys: dict[str, str]) -> dict | None:
    """The `bdlora_layout.json` content for the dense-stored targets; None when every factor is PEFT-native.

    `use_bdlora_nblocks` is what the adapter_config.json saved with it says (None: no use_bdlora), so a copy next to
    another config (an export that re-blocked or densified the adapter) is recognised as stale.
    """
    dense = {name: t for name, t in targets.items() if t.storage == "dense"}
    if not dense:
        return None
    with_experts = any(t.kind == "expert" for t in targets.values())
    return dict(
        format=FORMAT,
        nblocks=nblocks,
        use_bdlora_nblocks=None if with_experts else nblocks,
        experts=experts,
        targets={
            name: dict(
                kind=t.kind,
                role=t.role,
                nblocks=t.nblocks,
                r=t.r,
                parallel=t.layout.parallel,
                segments=list(t.layout.segments),
                experts=t.layout.experts,
                d_in=t.layout.d_in,
                d_out=t.layout.d_out,
                key=keys.get(name, name),
            )
            for name, t in sorted(dense.items())
        },
    )


def write_layout(directory, record: dict | None) -> None:
    from bdlora_train.files import atomic_write_text

    if record is not None:
        atomic_write_text(Path(directory) / LAYOUT_NAME, json.dumps(record, indent=2, sort_keys=True) + "\n")


def read_layout(directory) -> dict | None:
    """`bdlora_layout.json` of an adapter directory (None when absent), or a one-line AdapterError."""
    file = Path(directory) / LAYOUT_NAME
    if not file.is_file():
        return None
    try:
        record = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AdapterError(f"{file}: not valid JSON ({err.msg}); restore it from the run") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("targets"), dict):
        raise AdapterError(f"{file}: not a {FORMAT} record; restore it from the run that saved the adapter")
    return record


def attach_layout(adapter, layout: dict) -> None:
    """Give densely stored modules their structure, keyed by the target name, after checking that every entry
    outside the blocks is an explicit zero (else stock PEFT would compute something the blocks do not say)."""
    from bdlora_train.families import Layout
    from bdlora_train.patterns import BD_B
    from bdlora_train.targets import Target

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
            parallel=entry["parallel"],
            factor="B" if entry["role"] == BD_B else "A",
            segments=tuple(entry["segments"]),
            d_in=entry["d_in"],
            d_out=entry["d_out"],
            experts=entry.get("experts", 0),
        )
        target = Target(lay, entry["role"], int(entry["nblocks"]), int(entry["r"]), "dense")
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


def expert_parameter(model, name: str):
    """(3-D expert parameter `name` of `model`, whether its module stores it transposed); (None, False) if absent."""
    owner_name, _, pname = name.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        return None, False
    while hasattr(owner, "get_base_layer"):
        owner = owner.get_base_layer()
    param = getattr(owner, pname, None)
    return (param, bool(getattr(owner, "is_transposed", False))) if isinstance(param, torch.Tensor) else (None, False)


def verify_expert_shape(adapter, model, name: str, module) -> None:
    """An expert parameter (E, d1, d2) must give PEFT's ParamWrapper the adapter's experts, d_in and d_out."""
    param, transposed = expert_parameter(model, name)
    if param is None or param.ndim != 3:
        raise AdapterError(
            f"{adapter.path}: expert parameter {name} does not exist in the base model; pass the base it was trained on"
        )
    experts, d1, d2 = param.shape
    d_in, d_out = (d1, d2) if transposed else (d2, d1)
    if (experts, d_in, d_out) != (module.experts, module.d_in, module.d_out):
        raise AdapterError(
            f"{adapter.path}: {name} factors give {module.experts} experts {module.d_in} -> {module.d_out}, the base "
            f"parameter is {tuple(param.shape)}; pass the base it was trained on, or restore the adapter"
        )
