"""The two BD-LoRA roles, the paper's default targets and the one parameter formula (no torch).

Column-parallel layers (q, k, v, gate, up) get a block-diagonal B (`bd_b`), row-parallel ones (o, down) a
block-diagonal A (`bd_a`); with N blocks and rank r each TP rank then holds r/N of the rank (Wang et al.,
arXiv 2510.23346, section 3).
"""

from __future__ import annotations

from enum import Enum

# The paper's setup: every attention and MLP projection of the decoder layers (q, k, v, o, gate, up, down).
DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Role(str, Enum):
    """A module's adapter role. A `str` (core/layout.py `Side`'s form, which Python 3.10 has; `enum.StrEnum` is 3.11):
    each member equals, hashes, prints and serialises (json, adapter_config.json, bdlora_layout.json) as its value,
    so saved files and user overrides ("bd_a") compare equal to it. Strings read from files or given by users become
    members at the boundary (`Role(value)`)."""

    BD_A = "bd_a"  # row-parallel layer: A is block-diagonal, B is sharded along the rank
    BD_B = "bd_b"  # column-parallel layer: B is block-diagonal, A is sharded along the rank
    PLAIN = "plain"  # neither factor block-diagonal (plain LoRA)

    def __str__(self) -> str:
        return self.value


BD_A, BD_B, PLAIN = Role.BD_A, Role.BD_B, Role.PLAIN
ROLES = (BD_A, BD_B)


def is_block_diagonal(role: Role | None) -> bool:
    """Whether `role` makes one factor block-diagonal (bd_a or bd_b), not plain LoRA (PLAIN or None)."""
    return role in ROLES


def module_params(role: Role | None, d_in: int, d_out: int, r: int, nblocks: int = 1) -> int:
    """Free adapter parameters of one module: LoRA r(d_in + d_out); block-diagonal B r(d_in + d_out/N);
    block-diagonal A r(d_in/N + d_out)."""
    if role == BD_B:
        return r * d_in + r * d_out // nblocks
    if role == BD_A:
        return r * d_in // nblocks + r * d_out
    return r * (d_in + d_out)
