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

import contextlib
import json
import warnings
from pathlib import Path

import torch

from bdlora_train.arch.targets import DENSE
from bdlora_train.core.blocks import factor_mask
from bdlora_train.core.errors import AdapterError
from bdlora_train.core.files import atomic_write_text
from bdlora_train.core.naming import unwrap

LAYOUT_NAME = "bdlora_layout.json"
FORMAT = "bdlora-layout/1"


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
        module = unwrap(model.get_submodule(owner))
        order = [p for p, _ in module.named_parameters(recurse=False) if p in params]
        for i, param in enumerate(order):
            keys[f"{owner}.{param}"] = owner + ".base_layer" * (len(order) - 1 - i)
    return keys


def layout_record(targets, nblocks: int, experts: str, keys: dict[str, str]) -> dict | None:
    """The `bdlora_layout.json` content for the dense-stored targets; None when every factor is PEFT-native.

    `use_bdlora_nblocks` is what the adapter_config.json saved with it says (None: no use_bdlora), so a copy next to
    another config (an export that re-blocked or densified the adapter) is recognised as stale.
    """
    dense = {name: t for name, t in targets.items() if t.storage == DENSE}
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


@contextlib.contextmanager
def quiet_peft_save():
    """PEFT warns "Could not find a config file in <base>" when the base is no Hub id or directory (the embedded GGUF,
    a Hub id under HF_HUB_OFFLINE=1), and "Unable to fetch remote file" when the Hub is out of reach without that
    variable; either only means PEFT cannot check for a resized vocabulary, which the toolkit's runs never resize: the
    toolkit's own saves (trainer/mixins.py) go without them, for any base. A save of a tiny model goes without it
    anywhere once bdlora_train is imported (core/chatter.py), a TRL script's included."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Could not find a config file")
        # the same lookup on a machine that cannot reach the Hub (HF_HUB_OFFLINE unset)
        warnings.filterwarnings("ignore", message="Unable to fetch remote file")
        yield
