"""BD-LoRA factors -> the local LoRA each tensor-parallel rank holds. Pure torch and the toolkit's core: no vLLM
import.

PEFT stores a BD-LoRA module with one block-diagonal factor packed (`peft/tuners/lora/variants.py`,
`BlockDiagonalLinear`): the weight is (out_features, in_features / nblocks) and the dense matrix is
`torch.block_diag(*w.chunk(nblocks, dim=0))`. So

  BD-B (column-parallel q, k, v, gate, up): lora_B.weight is (d_out, r/N), lora_A.weight is (r, d_in)
  BD-A (row-parallel o, down):              lora_A.weight is (r, d_in/N), lora_B.weight is (d_out, r)

A block-diagonal factor PEFT cannot express (segment-aware blocks over a fused projection such as Phi-3's
[q | k | v] `qkv_proj` or [gate | up] `gate_up_proj`) is stored densely as a plain LoRA entry with explicit zeros,
and `bdlora_layout.json` records its role, nblocks and segments (bdlora_train/peft_integration/storage.py): rank i owns
the
i-th 1/N of every segment.

Rank i of T (T divides N) owns rank-slice rs_i = [i·r/T, (i+1)·r/T) and, for its sharded dimension, the
matching N/T diagonal blocks (arXiv 2510.23346, Sec. 3):

  column-parallel: A_i = A[rs_i, :]               B_ii = B[out_i, rs_i]   (x·A_iᵀ·B_iiᵀ is its output shard)
  row-parallel:    A_ii = A[rs_i, in_i]           B_i = B[:, rs_i]        (x_i·A_iiᵀ·B_iᵀ is its partial sum)

`local_factors` returns these as a plain LoRA of rank r/T, laid out so that vLLM's own per-rank slicing
(`slice_lora_b` of column-parallel layers keeps rows out_i, per segment for fused layers; `slice_lora_a` of
row-parallel layers keeps columns in_i) cuts exactly A_i/B_ii resp. A_ii/B_i out of it. Everything off the diagonal
blocks is zero in the dense factor, so nothing a rank needs lives elsewhere and no collective is added.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from bdlora_train.core.blocks import dense_from_packed, factor_mask, rank_factors
from bdlora_train.core.degrees import check_divides, divides
from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.core.layout import factor_of
from bdlora_train.core.naming import substring_role
from bdlora_train.core.roles import BD_A, BD_B, Role
from bdlora_train.serving.rules import (
    fused_rows_refusal,
    layout_shape_refusal,
    nblocks_value_refusal,
    off_block_refusal,
    packed_refusal,
    segments_refusal,
    use_bdlora_refusal,
)


class BlockDiagLoraServeError(ValueError):
    """An adapter / engine combination the plugin cannot serve exactly. The message is one line."""


@dataclass(frozen=True)
class DenseTarget:
    """A block-diagonal factor stored densely (one `bdlora_layout.json` target of kind "linear")."""

    name: str
    role: Role
    nblocks: int
    r: int
    segments: tuple[int, ...]

    def parts(self, names: tuple[str, ...], sizes: tuple[int, ...], dense_fix: str) -> dict[str, DenseTarget]:
        """The target split into the parts of a fused projection vLLM loads separately (GLM-4's gate_up_proj ->
        gate_proj, up_proj): each part is one of the segments, its blocks the i-th 1/N of it. `dense_fix`:
        serve_dense's text for the adapter."""
        if tuple(sizes) != self.segments:
            refusal = segments_refusal(self.name, list(self.segments), list(sizes), dense_fix)
            raise BlockDiagLoraServeError(refusal)
        parent = self.name.rpartition(".")[0]
        return {f"{parent}.{part}": replace(self, name=f"{parent}.{part}", segments=(size,))
                for part, size in zip(names, sizes)}


@dataclass(frozen=True)
class BDConfig:
    """What makes an adapter BD-LoRA to the plugin: PEFT's `use_bdlora` (packed factors, `nblocks`, the role
    patterns) and/or `bdlora_layout.json` (densely stored block-diagonal factors, `dense`; expert factors,
    `experts`)."""

    bd_a: tuple[str, ...] = ()
    bd_b: tuple[str, ...] = ()
    nblocks: int = 1
    native: bool = False
    dense: dict[str, DenseTarget] = field(default_factory=dict)
    experts: tuple[str, ...] = ()

    @classmethod
    def from_adapter(cls, config: dict, layout: dict | None = None) -> "BDConfig | None":
        """From adapter_config.json and bdlora_layout.json (read_layout's dict, or None); None for a plain LoRA."""
        bd = config.get("use_bdlora")
        if bd and not isinstance(bd, dict):
            raise BlockDiagLoraServeError(use_bdlora_refusal(bd))
        nblocks = int(bd.get("nblocks") or 1) if bd else None
        if nblocks is not None and nblocks < 1:
            raise BlockDiagLoraServeError(nblocks_value_refusal(nblocks))
        # The layout describes the adapter_config.json it was saved with; a copy next to another config (an export
        # that re-blocked or densified the adapter) is stale, and its dense factors are then plain LoRA (the rule of
        # bdlora_train/adapters/reader.py).
        if layout is not None and layout.get("use_bdlora_nblocks", nblocks) != nblocks:
            layout = None
        if not bd and layout is None:
            return None
        dense, experts = {}, []
        for name, entry in (layout or {}).get("targets", {}).items():
            if entry.get("kind") == "expert" or entry.get("experts"):
                experts.append(name)
            else:
                dense[entry.get("key", name)] = DenseTarget(entry.get("key", name), Role(entry["role"]),
                                                           int(entry["nblocks"]), int(entry["r"]),
                                                           tuple(entry["segments"]))
        layout_nblocks = int(layout["nblocks"]) if layout else 1
        return cls(tuple(bd.get("target_modules_bd_a") or ()) if bd else (),
                   tuple(bd.get("target_modules_bd_b") or ()) if bd else (),
                   nblocks or layout_nblocks, bool(bd), dense, tuple(sorted(experts)))

    def role(self, module_name: str) -> Role | None:
        """PEFT's rule (`BdLoraLinearVariant.init`): a pattern matches if it is a substring of the module name."""
        if not self.native:
            return None
        try:
            return substring_role(module_name, self.bd_a, self.bd_b)
        except BlockDiagLoraConfigError as err:
            raise BlockDiagLoraServeError(str(err)) from None


def check_packed(module: str, role: Role, lora_a: torch.Tensor, lora_b: torch.Tensor, nblocks: int) -> int:
    """Check the packed shapes against the role; return the module's rank r."""
    if role == BD_B:
        r = lora_a.shape[0]
        ok = lora_b.shape[1] * nblocks == r and divides(nblocks, lora_b.shape[0])
    else:
        r = lora_b.shape[1]
        ok = lora_a.shape[0] == r and divides(nblocks, r)
    if not ok:
        shapes = tuple(lora_a.shape), tuple(lora_b.shape)
        raise BlockDiagLoraServeError(packed_refusal(module, role, *shapes, nblocks, r))
    return r


def local_factors(role: Role, lora_a: torch.Tensor, lora_b: torch.Tensor, nblocks: int, tp_size: int,
                  tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank-local LoRA (rank r/T) for one PEFT-packed module, in the layout vLLM's default slicing expects.

    A BD-B module must sit on a column-parallel layer (vLLM keeps A whole and takes B's rows of this rank's
    output shard), a BD-A module on a row-parallel one (vLLM takes A's columns of this rank's input shard and
    keeps B whole); the caller checks that. With tp_size 1 this is the dense LoRA.
    """
    check_divides(tp_size, nblocks, "local_factors", key="tp_size", error=BlockDiagLoraServeError)
    A = dense_from_packed(lora_a, nblocks) if role == BD_A else lora_a  # (r, d_in)
    B = dense_from_packed(lora_b, nblocks) if role == BD_B else lora_b  # (d_out, r)
    # BD-B on a column layer: A_i (whole input), B[:, rs] whose rows out_i are B_ii (its other rows are off-diagonal
    # zeros). BD-A on a row layer: A[rs] whose columns in_i are A_ii (other columns are zeros), B_i = B[:, rs].
    A_rank, B_rank = rank_factors(A, B, tp_rank, tp_size)
    return A_rank.contiguous(), B_rank.contiguous()


def dense_local_factors(target: DenseTarget, lora_a: torch.Tensor, lora_b: torch.Tensor, tp_size: int,
                        tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank-local LoRA (rank r/T) for one densely stored block-diagonal module, after checking that every entry
    outside its blocks is zero (else PEFT computes a different adapter than the layout says, and the rank-local form
    would drop those entries). Rank i's blocks per segment are exactly the rows vLLM's slicing of a fused layer
    keeps (QKV: the i-th q, k and v shard; merged gate_up: the i-th half of each), so `rank_factors` applies."""
    label = factor_of(target.role)
    factor = lora_b if label == "B" else lora_a
    mask = factor_mask(target.segments, target.r, target.nblocks)  # (split, r)
    mask = mask if label == "B" else mask.t()
    if tuple(mask.shape) != tuple(factor.shape):
        raise BlockDiagLoraServeError(layout_shape_refusal(target.name, label, tuple(factor.shape), tuple(mask.shape)))
    if (~mask).any() and factor[~mask].abs().max().item() != 0:
        raise BlockDiagLoraServeError(off_block_refusal(target.name, label))
    check_divides(tp_size, target.nblocks, f"module {target.name}", key="tp_size", error=BlockDiagLoraServeError)
    A_rank, B_rank = rank_factors(lora_a, lora_b, tp_rank, tp_size)
    return A_rank.contiguous(), B_rank.contiguous()


def split_fused(tensors: dict[str, torch.Tensor], module: str, parts: tuple[str, ...],
                sizes: tuple[int, ...]) -> None:
    """Split one fused module's LoRA (PEFT keys `<module>.lora_A.weight` / `.lora_B.weight`) in place into the parts
    vLLM loads separately: each part keeps A and takes its rows of B, so x·Aᵀ·B_partᵀ is exactly that part's slice
    of the fused output."""
    parent = module.rpartition(".")[0]
    a, b = tensors.pop(f"{module}.lora_A.weight"), tensors.pop(f"{module}.lora_B.weight")
    if b.shape[0] != sum(sizes):
        raise BlockDiagLoraServeError(fused_rows_refusal(module, b.shape[0], list(sizes)))
    for part, rows in zip(parts, b.split(list(sizes), dim=0)):
        tensors[f"{parent}.{part}.lora_A.weight"] = a.clone()
        tensors[f"{parent}.{part}.lora_B.weight"] = rows.contiguous()
