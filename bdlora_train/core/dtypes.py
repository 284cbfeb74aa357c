"""Torch dtypes by the names recipes and side files use."""

from __future__ import annotations

DTYPES = ("float32", "bfloat16", "float16")


def dtype_of(name: str):
    """torch dtype of a `torch_dtype` value ("float32", "bfloat16", "float16")."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
