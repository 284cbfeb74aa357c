"""A TP adapter's state: gathered into PEFT's format for a save, sliced back at resume; the optimizer state likewise."""

from __future__ import annotations

import torch
from torch import nn

from bdlora_train.core.errors import TPError


def gather_adapter_state(model: nn.Module, pieces: dict) -> dict[str, torch.Tensor]:
    """{state-dict key: full tensor, in PEFT's layout} of every adapter parameter; `pieces`: {parameter name: Piece}
    of the factors held as rank-local pieces (collective: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in model.state_dict().items():
        if ".lora_" not in key:
            continue
        full = (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
        out[key] = (pieces[key].unpack(full) if key in pieces else full).contiguous()
    return out


def load_adapter_state(model: nn.Module, pieces: dict, state: dict[str, torch.Tensor]) -> None:
    """Copy full adapter tensors (keyed as `gather_adapter_state` returns them) into the rank-local parameters: each
    rank keeps its own slice (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = dict(model.named_parameters())
    missing = [key for key in params if ".lora_" in key and key not in state]
    if missing:
        raise TPError(f"tp: the checkpoint has no tensor for {missing[0]}; resume with the adapter it was trained with")
    with torch.no_grad():
        for key, full in state.items():
            param = params.get(key)
            if param is None:
                continue
            shape = pieces[key].shape if key in pieces else tuple(param.shape)
            if tuple(full.shape) != tuple(shape):
                raise TPError(f"tp: checkpoint tensor {key} is {tuple(full.shape)}, the adapter's is {tuple(shape)}")
            if key in pieces:
                full = pieces[key].pack(full)
            if isinstance(param, DTensor):
                param.copy_(
                    distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
                )
            else:
                param.copy_(full)


def _saved_key(state_key: str, adapter: str = "default") -> str:
    """A state-dict key of the adapter -> the key PEFT saves it under (the adapter name dropped)."""
    return state_key.replace(f".lora_A.{adapter}.", ".lora_A.").replace(f".lora_B.{adapter}.", ".lora_B.")


def load_checkpoint_adapter(model: nn.Module, pieces: dict, checkpoint) -> None:
    """Resume: the adapter saved in a checkpoint (PEFT's adapter_model.safetensors, gathered) back into the
    rank-local parameters."""
    from pathlib import Path

    from safetensors.torch import load_file

    saved = load_file(str(Path(checkpoint) / "adapter_model.safetensors"))
    state = {key: saved[_saved_key(key)] for key in model.state_dict() if ".lora_" in key and _saved_key(key) in saved}
    load_adapter_state(model, pieces, state)


def _state_dict_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def _map_piece_state(pieces: dict, state: dict, to_peft: bool) -> dict:
    """The optimizer state with every state tensor of a rank-local piece converted to PEFT's layout (`to_peft`, for
    the checkpoint) or back to the pieces (at resume), so a checkpoint holds it whatever the TP degree."""
    for key, entry in state.get("state", {}).items():
        piece = pieces.get(key)
        for name, value in entry.items() if piece is not None else ():
            if isinstance(value, torch.Tensor) and to_peft and value.dim() == 3:
                entry[name] = piece.unpack(value)
            elif isinstance(value, torch.Tensor) and not to_peft and tuple(value.shape) == piece.shape:
                entry[name] = piece.pack(value)
    return state


def save_optimizer(model: nn.Module, pieces: dict, optimizer, output_dir, write: bool) -> None:
    """The optimizer state with every rank-local tensor gathered (collective), written by the writing rank as
    optimizer.pt: a checkpoint holds the full adapter and its full optimizer state, whatever the TP degree."""
    from pathlib import Path

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
    state = get_optimizer_state_dict(model, inner, options=_state_dict_options(cpu_offload=True))
    if write:
        state = _map_piece_state(pieces, state, to_peft=True)
        torch.save(state, Path(output_dir) / "optimizer.pt")


def load_optimizer(model: nn.Module, pieces: dict, optimizer, checkpoint) -> None:
    """Resume: the full optimizer state of a checkpoint, each rank keeping its own slice of every tensor."""
    from pathlib import Path

    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)
    state = torch.load(Path(checkpoint) / "optimizer.pt", map_location="cpu", weights_only=True)
    state = _map_piece_state(pieces, state, to_peft=False)
    set_optimizer_state_dict(model, inner, state, options=_state_dict_options())
