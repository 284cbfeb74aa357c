"""vLLM's six CPU LoRA ops (`vllm/lora/ops/torch_ops/lora_ops.py`), computed per adapter slot instead of per token.

vLLM's ops select every token's adapter with `lora_weights[lora_indices_tensor]`, a copy of a (d_out, r) matrix
per token, and contract the copies with an `einsum`. These functions take the same arguments and give the same
results (the same products, summed in another order) with one GEMM per slot in the batch:
- the rows of a slot are its runs of consecutive tokens: a prefill's sequences (`sgmv_*`: vLLM's segments, equal
  neighbours merged), a decode batch's tokens with that slot (`bgmv_*`). Long runs are multiplied in place through
  views; a slot's short runs (a round-robin decode batch) are gathered, multiplied, and scattered back at once;
- a small decode batch without index -1 takes one GEMM of its tokens against every slot's weights and a per-token
  pick, when the slots absent from the batch add little to read (`_all_slots_cheaper`): a GEMM per slot present
  costs more to dispatch there than the whole product.
vLLM's semantics kept: inputs and weights cast to the output's dtype and multiplied in it; a shrink assigns
`scaling * product` to `output[:, :r]`; an expand assigns or adds (`add_inputs`) to `output[:, :common_len]`
(`bgmv_expand`/`sgmv_expand`: the narrower of the adapter's and the output's widths) or to the columns
`slice_offset:slice_offset + slice_size` (`*_expand_slice`); `sgmv_*` repeat each sequence's slot over its length
from row 0 (as vLLM, which does not read `b_seq_start_loc`); one token's row is broadcast over every output row
(vLLM's broadcasting), otherwise the first min(tokens, output rows) rows are written and no other. Index -1 = no
adapter, as vLLM 0.33.0 fixed it (and its GPU kernels do): an expand leaves those rows as they were, a shrink writes
zeros there (vLLM 0.33.0 assigns the masked product; its buffers start at zero, so the GPU kernels' "untouched" is
the same); no slot is ever read for them (vLLM 0.32.0 read the last slot: cpu_ops.has_slot_defect).
"""

from __future__ import annotations

import torch

_GATHER_BELOW = 16  # a slot whose runs average fewer rows is gathered into one GEMM; longer runs are GEMMs in place
_SMALL_BATCH = 32  # decode batches up to this many tokens may take one GEMM against every slot (_all_slots_cheaper)
_ABSENT_BUDGET = 1 << 15  # weight elements of absent slots worth reading per slot present (~10 us of dispatch)


def _token_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(slot, start, end) of the maximal runs of equal slots."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][0] == slot:
            runs[-1] = (slot, runs[-1][1], i + 1)
        else:
            runs.append((slot, i, i + 1))
    return runs


def _segment_runs(seq_len_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor) -> tuple[list, int]:
    """The runs of `sgmv_*`'s sequences (each sequence's slot repeated over its length, from row 0), equal
    neighbours merged, and the number of tokens they cover."""
    lengths, slots = seq_len_tensor.tolist(), lora_indices_tensor.tolist()
    if len(lengths) != len(slots):
        raise ValueError(f"{len(slots)} lora indices for {len(lengths)} sequence lengths")
    runs: list[tuple[int, int, int]] = []
    start = 0
    for slot, length in zip(slots, lengths):
        if length > 0:
            if runs and runs[-1][0] == slot:
                runs[-1] = (slot, runs[-1][1], start + length)
            else:
                runs.append((slot, start, start + length))
        start += length
    return runs, start


def _stacked(lora_weights: torch.Tensor, w_rows: int | None) -> torch.Tensor:
    """(slots, d_out, d_in): vLLM squeezes dim 1 of its (slots, 1, d_out, d_in) buffers; the first w_rows rows."""
    weights = lora_weights.squeeze(1) if lora_weights.dim() == 4 else lora_weights
    return weights if w_rows is None or w_rows == weights.shape[1] else weights[:, :w_rows]


def _product(x, w, mode: str, scaling: float, out) -> None:
    """out = / += x @ w in out's dtype (vLLM casts inputs and weights to it, multiplies, then assigns or adds);
    shrink: `scaling *`; w None: zeros (the rows of index -1 in a shrink)."""
    if w is None:
        out.zero_()
    elif mode == "add":
        if out.dtype == torch.float32:
            out.addmm_(x.to(out.dtype), w)  # BLAS: the same fp32 terms and out, summed in another order
        else:
            out.add_(x.to(out.dtype) @ w)  # the product rounded to out's dtype, then the sum rounded, as vLLM
    else:
        torch.mm(x.to(out.dtype), w, out=out)
        if mode == "shrink" and scaling != 1.0:  # vLLM: scaling * product (1.0 * p is p exactly)
            out.mul_(scaling)


def _grouped(inputs, weights, target, runs, tokens: int, mode: str, scaling: float) -> None:
    """target's rows (the output's column view) = / += their tokens' products, one GEMM per slot (module doc).
    mode: "shrink" (scaled assignment; index -1 rows zero), "set" or "add" (index -1 rows untouched)."""
    rows = target.shape[0]
    if tokens == 1 and rows != 1:  # vLLM's broadcast of one token over every output row
        runs = [(runs[0][0], 0, rows)]
        inputs = inputs[:1].expand(rows, -1)
    elif tokens > rows:
        runs = [(slot, start, min(end, rows)) for slot, start, end in runs if start < rows]
    by_slot: dict[int, list[tuple[int, int]]] = {}
    for slot, start, end in runs:
        if slot != -1 or mode == "shrink":  # an expand leaves the rows of index -1 as they are
            by_slot.setdefault(slot, []).append((start, end))
    gathered: list[tuple[torch.Tensor | None, int, int]] = []  # (weight, start, end) in the gathered copy
    order: list[int] = []
    for slot, spans in by_slot.items():
        w = None if slot == -1 else weights[slot].to(target.dtype).t()
        size = sum(end - start for start, end in spans)
        if len(spans) > 1 and size < _GATHER_BELOW * len(spans):
            gathered.append((w, len(order), len(order) + size))
            for start, end in spans:
                order.extend(range(start, end))
        else:
            for start, end in spans:
                _product(inputs[start:end], w, mode, scaling, target[start:end])
    if order:
        index = torch.tensor(order, device=inputs.device)
        picked = inputs.index_select(0, index)
        result = torch.empty(len(order), target.shape[1], dtype=target.dtype, device=target.device)
        for w, start, end in gathered:
            _product(picked[start:end], w, "set" if mode == "add" else mode, scaling, result[start:end])
        target.index_put_((index,), result, accumulate=mode == "add")  # (faster than index_add_ on a view)


def _all_slots_cheaper(slots: list[int], weights: torch.Tensor) -> bool:
    """One GEMM against every slot (and a pick per token) for a decode batch of at most _SMALL_BATCH tokens without
    index -1, when the absent slots' weights are at most _ABSENT_BUDGET elements per slot present."""
    if len(slots) > _SMALL_BATCH or -1 in slots:
        return False
    present = len(set(slots))
    return (weights.shape[0] - present) * weights.shape[1] * weights.shape[2] <= present * _ABSENT_BUDGET


def _all_slots(x, weights, target, indices, mode: str, scaling: float) -> None:
    """target = / += each token's product with its own slot's weights, picked from x @ (every slot's W).T."""
    slots, d_out = weights.shape[0], weights.shape[1]
    every = x.to(target.dtype) @ weights.reshape(slots * d_out, -1).to(target.dtype).t()
    picked = every.view(x.shape[0], slots, d_out)[torch.arange(x.shape[0], device=x.device), indices]
    if mode == "add":
        target.add_(picked)
    else:
        target.copy_(picked)
        if mode == "shrink" and scaling != 1.0:
            target.mul_(scaling)


def _bgmv(inputs, lora_weights, target, indices, mode: str, scaling: float = 1.0, w_rows=None) -> None:
    slots = indices.tolist()
    n, rows = len(slots), target.shape[0]
    weights = _stacked(lora_weights, w_rows)
    if (n == rows or 1 < n < rows) and _all_slots_cheaper(slots, weights):
        if n != rows:
            target = target[:n]
        _all_slots(inputs if inputs.shape[0] == n else inputs[:n], weights, target, indices, mode, scaling)
    else:
        _grouped(inputs, weights, target, _token_runs(slots), n, mode, scaling)


def _mode(add_inputs: bool) -> str:
    return "add" if add_inputs else "set"


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    _bgmv(inputs, lora_b_weights, output_tensor[:, : lora_b_weights.shape[-2]], lora_indices_tensor, "shrink",
          scaling)


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    common_len = min(lora_b_weights.shape[-2], output_tensor.shape[1])  # vLLM: adapter and model may pad differently
    _bgmv(inputs, lora_b_weights, output_tensor[:, :common_len], lora_indices_tensor, _mode(add_inputs),
          w_rows=common_len)


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    _bgmv(inputs, lora_b_weights, output_tensor[:, slice_offset: slice_offset + slice_size], lora_indices_tensor,
          _mode(add_inputs))


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches: int, max_seq_length: int, token_nums: int, scaling: float):
    _grouped(inputs, _stacked(lora_a_weights, None), output_tensor[:, : lora_a_weights.shape[-2]],
             *_segment_runs(seq_len_tensor, lora_indices_tensor), "shrink", scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches: int, max_seq_length: int, token_nums: int, add_inputs: bool = False):
    common_len = min(lora_b_weights.shape[-2], output_tensor.shape[1])
    _grouped(inputs, _stacked(lora_b_weights, common_len), output_tensor[:, :common_len],
             *_segment_runs(seq_len_tensor, lora_indices_tensor), _mode(add_inputs), 1.0)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches: int, max_seq_length: int, token_nums: int, slice_offset: int, slice_size: int,
                      add_inputs: bool = False):
    _grouped(inputs, _stacked(lora_b_weights, None), output_tensor[:, slice_offset: slice_offset + slice_size],
             *_segment_runs(seq_len_tensor, lora_indices_tensor), _mode(add_inputs), 1.0)


OPS = {f.__name__: f for f in (bgmv_shrink, bgmv_expand, bgmv_expand_slice, sgmv_shrink, sgmv_expand,
                               sgmv_expand_slice)}
