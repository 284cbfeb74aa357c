"""The two BD-LoRA roles, the paper's default targets and the one parameter formula (no torch).

Column-parallel layers (q, k, v, gate, up) get a block-diagonal B (`bd_b`), row-parallel ones (o, down) a
block-diagonal A (`bd_a`); with N blocks and rank r each TP rank then holds r/N of the rank (Wang et al.,
arXiv 2510.23346, section 3).
"""

from __future__ import annotations

# The rank rule lives with the other TP rules (core/degrees.py); re-exported for train/methods.py.

# The paper's setup: every attention and MLP projection of the decoder layers (q, k, v, o, gate, up, down).
DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BD_A = "bd_a"  # row-parallel layer: A is block-diagonal, B is sharded along the rank
BD_B = "bd_b"  # column-parallel layer: B is block-diagonal, A is sharded along the rank
ROLES = (BD_A, BD_B)
PLAIN = "plain"  # neither factor block-diagonal (plain LoRA)


def is_block_diagonal(role: str | None) -> bool:
    """Whether `role` makes one factor block-diagonal (bd_a or bd_b), not plain LoRA (PLAIN or None)."""
    return role in ROLES


def module_params(role: str | None, d_in: int, d_out: int, r: int, nblocks: int = 1) -> int:
    """Free adapter parameters of one module: LoRA r(d_in + d_out); block-diagonal B r(d_in + d_out/N);
    block-diagonal A r(d_in/N + d_out)."""
    if role == BD_B:
        return r * d_in + r * d_out // nblocks
    if role == BD_A:
        return r * d_in // nblocks + r * d_out
    return r * (d_in + d_out)
