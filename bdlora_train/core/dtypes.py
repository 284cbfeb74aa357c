"""Torch dtypes by the names recipes and side files use."""

from __future__ import annotations

DTYPES = ("float32", "bfloat16", "float16", "float64")


def dtype_of(name: str):
    """torch dtype of a `torch_dtype` value (one of DTYPES); KeyError for any other name."""
    import torch

    if name not in DTYPES:
        raise KeyError(name)
    return getattr(torch, name)
