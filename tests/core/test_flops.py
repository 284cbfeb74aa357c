"""core/flops.py against counts made by hand for issue 29's layer (Llama 1024 -> 2816, r 16, 4 blocks)."""

import pytest

from bdlora_train.core.flops import projection_flops


def test_one_projection_by_hand():
    # gate_proj, column-parallel: the base 2 * 1024 * 2816 forward and again backward. BD-LoRA: x A^T is 16 x 1024
    # per token, B's 4 blocks 704 x 4 each (16 x 704 in all); each product 2 FLOPs per MAC, 3 times (fwd, 2 bwd).
    assert projection_flops(1024, 2816, 16, column=True, block_diagonal=True, nblocks=4) == (
        11_534_336,
        6 * (16 * 1024 + 16 * 704),
    )
    # down_proj, row-parallel: A is the block-diagonal one (4 blocks of 4 x 704), B dense 1024 x 16.
    _, down = projection_flops(2816, 1024, 16, column=False, block_diagonal=True, nblocks=4)
    assert down == 6 * (4 * 704 * 4 + 16 * 1024)
    # plain LoRA: both products dense
    assert projection_flops(1024, 2816, 16, column=True, block_diagonal=False)[1] == 6 * 16 * (1024 + 2816)


def test_under_tp_bd_lora_splits_everything_and_lora_repeats_one_product():
    base, bd = projection_flops(1024, 2816, 16, column=True, block_diagonal=True, nblocks=2, tp=2)
    assert base == 11_534_336 / 2
    # each rank: its 8 of A's 16 rank rows over all 1024 inputs (8 x 1024), B's diagonal block 1408 x 8
    assert bd == 6 * (8 * 1024 + 1408 * 8)
    _, lora = projection_flops(1024, 2816, 16, column=True, block_diagonal=False, tp=2)
    assert lora == 6 * 16 * (1024 + 1408)  # x A^T repeated on both ranks, h B^T on each rank's 1408 outputs
    _, lora_row = projection_flops(2816, 1024, 16, column=False, block_diagonal=False, tp=2)
    assert lora_row == pytest.approx(6 * 16 * (1408 + 1024))
