"""An adapter against its base model: the base on the meta device, and every factor shape checked against it.

This catches what the adapter files alone cannot show, e.g. a block-diagonal A whose nblocks was edited in
adapter_config.json: (r, d_in/N) then reads as another d_in.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bdlora_train.adapters.reader import Adapter
from bdlora_train.core.errors import AdapterError, ModelSpecError, first_line
from bdlora_train.core.layout import expert_dims, is_transposed
from bdlora_train.core.naming import unwrap
from bdlora_train.models import base_spec, load_config, meta_model


def base_model_for(adapter: Adapter, override: str | None = None):
    """The adapter's base model on the meta device (shapes, no weights), from --model or base_model_name_or_path."""
    spec = adapter.base_spec(override)
    try:
        return meta_model(load_config(spec))
    except ModelSpecError as err:
        raise AdapterError(
            f"{adapter.path}: its base {spec} is needed to check the factor shapes, but {first_line(err)}; "
            "pass --model with a local copy or its config.json"
        ) from None


def base_identity(adapter: Adapter, spec: str) -> tuple[str, str]:
    """(verdict, message): is `spec` the base the adapter was trained on? "same" (its spec, or a local copy whose
    config.json names it), "unknown" (a local directory that does not say: shapes can be checked, weights cannot),
    or "other" (another model: the adapter computes something else on it even when every shape matches)."""
    trained_on = adapter.config.base_model_name_or_path
    if not trained_on or base_spec(spec) == base_spec(trained_on):
        return "same", f"{spec} is the base the adapter was trained on"
    config_file = Path(spec) / "config.json"
    if config_file.is_file():
        try:
            named = json.loads(config_file.read_text()).get("_name_or_path")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            named = None
        if named == trained_on:
            return "same", f"{spec} is a local copy of {trained_on}, the base the adapter was trained on"
        return "unknown", (
            f"{spec} is a local directory, the adapter was trained on {trained_on}: make sure it is a copy of that "
            "model (the shapes are checked, the weights cannot be)"
        )
    return "other", (
        f"{spec} is not the base the adapter was trained on ({trained_on}); an adapter on another base computes "
        f"something else even when the shapes match"
    )


def verify_shapes(adapter: Adapter, model, given: str | None = None) -> None:
    """Every adapted module exists in `model` as a Linear with the adapter's (d_in, d_out); one line otherwise.

    This catches what the file alone cannot show, e.g. a block-diagonal A whose nblocks was edited in
    adapter_config.json: (r, d_in/N) then reads as another d_in. `given`: the --model spec `model` came from; when it
    is not the base the adapter was trained on, the line blames that base, not the adapter.
    """
    for name, module in adapter.modules.items():
        if module.experts:
            verify_expert_shape(adapter, model, name, module, given)
            continue
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            raise AdapterError(
                _mismatch(
                    adapter, given, f"module {name} does not exist in the base model", "pass the base it was trained on"
                )
            ) from None
        base = unwrap(layer)
        shape = (getattr(base, "in_features", None), getattr(base, "out_features", None))
        if shape != (module.d_in, module.d_out):
            detail = (
                f"{name} ({module.role or 'lora'}, nblocks={module.nblocks}) factors give {module.d_in} -> "
                f"{module.d_out}, the base Linear is {shape[0]} -> {shape[1]}"
            )
            raise AdapterError(
                _mismatch(
                    adapter,
                    given,
                    detail,
                    "the file does not match this base (edited nblocks or r?) - pass "
                    "the base it was trained on, or restore the adapter",
                )
            )


def _mismatch(adapter: Adapter, given: str | None, detail: str, fix: str) -> str:
    """The line for a factor that does not fit the base: a --model that is not the adapter's base is the cause."""
    trained_on = adapter.config.base_model_name_or_path
    if given and trained_on and base_identity(adapter, given)[0] != "same":
        return (
            f"{adapter.path}: the base does not match: the adapter was trained on {base_spec(trained_on)}, --model "
            f"gives {given} ({detail}); pass --model {base_spec(trained_on)} (or a local copy of it), or leave "
            "--model out"
        )
    return f"{adapter.path}: {detail}; {fix}"


def expert_parameter(model, name: str):
    """(3-D expert parameter `name` of `model`, whether its module stores it transposed); (None, False) if absent."""
    owner_name, _, pname = name.rpartition(".")
    try:
        owner = unwrap(model.get_submodule(owner_name))
    except AttributeError:
        return None, False
    param = getattr(owner, pname, None)
    return (param, is_transposed(owner)) if isinstance(param, torch.Tensor) else (None, False)


def verify_expert_shape(adapter, model, name: str, module, given: str | None = None) -> None:
    """An expert parameter (E, d1, d2) must give PEFT's ParamWrapper the adapter's experts, d_in and d_out."""
    param, transposed = expert_parameter(model, name)
    if param is None or param.ndim != 3:
        raise AdapterError(
            _mismatch(
                adapter,
                given,
                f"expert parameter {name} does not exist in the base model",
                "pass the base it was trained on",
            )
        )
    experts, d_in, d_out = expert_dims(param.shape, transposed)
    if (experts, d_in, d_out) != (module.experts, module.d_in, module.d_out):
        detail = (
            f"{name} factors give {module.experts} experts {module.d_in} -> {module.d_out}, the base parameter is "
            f"{tuple(param.shape)}"
        )
        raise AdapterError(_mismatch(adapter, given, detail, "pass the base it was trained on, or restore the adapter"))
