"""What one adapted projection computes per token, in FLOPs: the frozen base's and the adapter's, forward + backward.

Per token, a projection's base does 2 d_in d_out forward and as much again for its input gradient (the weight is
frozen: no weight gradient). Each of the adapter's two products (x A^T, h B^T) runs once forward and twice backward
(an input gradient and a weight gradient). BD-LoRA's block-diagonal factor does 1/nblocks of a dense one's work: B on
a column-parallel layer, A on a row-parallel one. Under TP degree `tp` the base splits over the ranks; so do all of
BD-LoRA's products, while plain LoRA in PEFT's layout repeats one product on every rank (x A^T on a column-parallel
layer, h B^T on a row-parallel one). These counts are the floor a step could reach: the adapter at the frozen
GEMMs' speed (`bdlora bench-tp --train` and scripts/bench_adapters.py report it).
"""

from __future__ import annotations


def projection_flops(
    d_in: int, d_out: int, r: int, *, column: bool, block_diagonal: bool, nblocks: int = 1, tp: int = 1
) -> tuple[float, float]:
    """(base, adapter) FLOPs per token per rank of one projection, forward + backward. `column`: the layer is
    column-parallel (its output split under TP); `block_diagonal`: BD-LoRA (`nblocks` blocks) rather than plain LoRA."""
    base = 2 * (2 * d_in * d_out / tp)
    if block_diagonal:
        if column:
            products = d_in / tp + d_out / (tp * nblocks)
        else:
            products = d_in / (tp * nblocks) + d_out / tp
    else:
        products = d_in + d_out / tp if column else d_in / tp + d_out
    return base, 3 * 2 * r * products
