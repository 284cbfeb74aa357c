"""BD-LoRA factors -> the local LoRA each tensor-parallel rank holds. Pure torch and the toolkit's core: no vLLM
import.

PEFT stores a BD-LoRA module with one block-diagonal factor packed (`peft/tuners/lora/variants.py`,
`BlockDiagonalLinear`): the weight is (out_features, in_features / nblocks) and the dense matrix is
`torch.block_diag(*w.chunk(nblocks, dim=0))`. So

  BD-B (column-parallel q, k, v, gate, up): lora_B.weight is (d_out, r/N), lora_A.weight is (r, d_in)
  BD-A (row-parallel o, down):              lora_A.weight is (r, d_in/N), lora_B.weight is (d_out, r)

Rank i of T (T divides N) owns rank-slice rs_i = [i·r/T, (i+1)·r/T) and, for its sharded dimension, the
matching N/T diagonal blocks (arXiv 2510.23346, Sec. 3):

  column-parallel: A_i = A[rs_i, :]               B_ii = B[out_i, rs_i]   (x·A_iᵀ·B_iiᵀ is its output shard)
  row-parallel:    A_ii = A[rs_i, in_i]           B_i = B[:, rs_i]        (x_i·A_iiᵀ·B_iᵀ is its partial sum)

`local_factors` returns these as a plain LoRA of rank r/T, laid out so that vLLM's own per-rank slicing
(`slice_lora_b` of column-parallel layers keeps rows out_i; `slice_lora_a` of row-parallel layers keeps
columns in_i) cuts exactly A_i/B_ii resp. A_ii/B_i out of it. Everything off the diagonal blocks is zero in
the dense factor, so nothing a rank needs lives elsewhere and no collective is added.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bdlora_train.core.blocks import dense_from_packed, rank_factors
from bdlora_train.core.errors import BlockDiagLoraError
from bdlora_train.core.naming import substring_role
from bdlora_train.core.roles import BD_A, BD_B


class BDLoraServeError(ValueError):
    """An adapter / engine combination the plugin cannot serve exactly. The message is one line."""


@dataclass(frozen=True)
class BDConfig:
    bd_a: tuple[str, ...]
    bd_b: tuple[str, ...]
    nblocks: int

    @classmethod
    def from_adapter_config(cls, config: dict) -> "BDConfig | None":
        """The `use_bdlora` entry of a PEFT adapter_config.json, or None for a plain LoRA adapter."""
        bd = config.get("use_bdlora")
        if not bd:
            return None
        if not isinstance(bd, dict):
            raise BDLoraServeError(f"adapter_config.json: use_bdlora={bd!r} is not a BdLoraConfig dict; "
                                   "fix: save it with PEFT's LoraConfig(use_bdlora=BdLoraConfig(...)).")
        nblocks = int(bd.get("nblocks") or 1)
        if nblocks < 1:
            raise BDLoraServeError(f"adapter_config.json: use_bdlora.nblocks={nblocks} must be >= 1.")
        return cls(tuple(bd.get("target_modules_bd_a") or ()), tuple(bd.get("target_modules_bd_b") or ()), nblocks)

    def role(self, module_name: str) -> str | None:
        """PEFT's rule (`BdLoraLinearVariant.init`): a pattern matches if it is a substring of the module name."""
        try:
            return substring_role(module_name, self.bd_a, self.bd_b)
        except BlockDiagLoraError as err:
            raise BDLoraServeError(f"module {err}") from None


def check_packed(module: str, role: str, lora_a: torch.Tensor, lora_b: torch.Tensor, nblocks: int) -> int:
    """Check the packed shapes against the role; return the module's rank r."""
    if role == BD_B:
        r = lora_a.shape[0]
        ok = lora_b.shape[1] * nblocks == r and lora_b.shape[0] % nblocks == 0
        want = f"lora_B (d_out, r/N) = (*, {r // nblocks if r % nblocks == 0 else '?'})"
    else:
        r = lora_b.shape[1]
        ok = lora_a.shape[0] == r and r % nblocks == 0
        want = f"lora_A (r, d_in/N) with r = {r}"
    if not ok:
        raise BDLoraServeError(
            f"module {module}: {role} factors of shapes A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)} are not "
            f"PEFT's packed BD-LoRA layout with nblocks={nblocks} ({want}); fix: check use_bdlora in "
            "adapter_config.json matches the saved tensors.")
    return r


def local_factors(role: str, lora_a: torch.Tensor, lora_b: torch.Tensor, nblocks: int, tp_size: int,
                  tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank-local LoRA (rank r/T) for one module, in the layout vLLM's default slicing expects.

    A BD-B module must sit on a column-parallel layer (vLLM keeps A whole and takes B's rows of this rank's
    output shard), a BD-A module on a row-parallel one (vLLM takes A's columns of this rank's input shard and
    keeps B whole); the caller checks that. With tp_size 1 this is the dense LoRA.
    """
    if nblocks % tp_size:
        raise ValueError(f"nblocks {nblocks} not divisible by tp_size {tp_size}")
    A = dense_from_packed(lora_a, nblocks) if role == BD_A else lora_a  # (r, d_in)
    B = dense_from_packed(lora_b, nblocks) if role == BD_B else lora_b  # (d_out, r)
    # BD-B on a column layer: A_i (whole input), B[:, rs] whose rows out_i are B_ii (its other rows are off-diagonal
    # zeros). BD-A on a row layer: A[rs] whose columns in_i are A_ii (other columns are zeros), B_i = B[:, rs].
    A_rank, B_rank = rank_factors(A, B, tp_rank, tp_size)
    return A_rank.contiguous(), B_rank.contiguous()
