"""vLLM's CPU punica wrapper (`PunicaWrapperCPU.add_lora_linear`) computed per layer instead of per slice.

Every LoRA Linear's forward calls `add_lora_linear` (`vllm/lora/layers/base_linear.py`), which loops over the
layer's slices (q, k, v; gate, up; one for o and down), zeroes a float32 buffer per slice and calls a shrink and an
expand op per slice; each op works out again which rows use which adapter slot. Here the batch's rows are grouped by
slot once per forward step (`StepPlan`, kept on the wrapper until vLLM's next `update_metadata`): a slot's long runs
(a prefill's sequences) are computed in place, its short runs (a round-robin decode batch) on one gather of the
layer's input whose products the output takes in one add. Each slot's rows take one shrink for all the layer's
slices (A side by side) and one expand per slice. What a layer's weights give these (`LayerWeights`: the views, the
copies, whether the layer fits) is worked out once and kept until vLLM writes into its buffers, so a call does only
its products. A small batch whose every row has a slot (a decode step: at most `_SMALL_BATCH` rows, several slots)
takes one shrink against every slot it spans and one expand per slice instead (`_every_slot`), when the
multiply-adds that adds cost less than the GEMMs it saves (`_every_slot_cheaper`): at a few rows per slot a GEMM's
dispatch costs more than its arithmetic. vLLM's semantics
(cpu_grouped_ops.py's doc): the shrink in float32 (the buffer's dtype), `scale * product`; the expand in the
output's dtype, added into the output; rows of index -1 untouched, and no slot read for them; `no_lora` (every row
-1) leaves the output as it is.

Anything else (a `buffer` handed in, slices of unequal rank, a weight narrower than its output slice, a batch whose
rows are not the mapping's tokens) takes vLLM's own per-slice method, which runs the grouped ops.

`install` puts it in place only where `punica_cpu.py` is a file it was read against (`VERIFIED_PUNICA`, as
cpu_ops.VERIFIED_OPS for the ops; tests/vllm/test_vllm_contract.py checks each verified release's file);
tests/vllm/test_cpu_punica.py checks the results against vLLM's own method.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bdlora_train.vllm_plugin.cpu_grouped_ops import (
    _GATHER_BELOW,
    _SMALL_BATCH,
    _product,
    _segment_runs,
    _stacked,
    _token_runs,
)
from bdlora_train.vllm_plugin.cpu_ops import ops_fingerprint

# multiply-adds that cost about one small GEMM's dispatch: `_every_slot` may spend this many per GEMM it saves (the
# measured break-even, 3 of 4 slots, the TP 2 decode projections at ranks 16-64 and 12-32 tokens:
# `scripts/bench_cpu_lora_ops.py --crossover`, eval/bench/cpu_lora_every_slot_crossover.txt)
_MACS_PER_GEMM = 3 << 18

# sha256 of vllm/lora/punica_wrapper/punica_cpu.py in the releases whose `add_lora_linear` this reproduces (the same
# file in 0.32.0, 0.33.0 and 0.34.0)
VERIFIED_PUNICA = {
    "0.32.0": "d2ca28b31743f59a4a5a7c45449cf0f71d3019b842d551dee6cb7e7af53b02ee",
    "0.33.0": "d2ca28b31743f59a4a5a7c45449cf0f71d3019b842d551dee6cb7e7af53b02ee",
    "0.34.0": "d2ca28b31743f59a4a5a7c45449cf0f71d3019b842d551dee6cb7e7af53b02ee",
}


@dataclass(frozen=True)
class StepPlan:
    """The rows of one forward step grouped by adapter slot. `runs` (slot, start, end): runs of the batch's own rows,
    computed in place (a prefill's sequences); `spans` (slot, start, end): rows of `order`'s gather, every slot's short
    runs together (a round-robin decode batch), computed on the gathered copy and added back at once."""

    tokens: int
    runs: tuple[tuple[int, int, int], ...]
    spans: tuple[tuple[int, int, int], ...]
    order: torch.Tensor | None
    every: EverySlot | None = None


@dataclass(frozen=True)
class EverySlot:
    """A batch of at most `_SMALL_BATCH` rows, every one with a slot (a decode step), for `_every_slot`: the slots
    `first` .. `last` (the lowest and the highest the batch uses), how many of them it uses, and each row's slot."""

    first: int
    last: int
    present: int
    row_slots: torch.Tensor
    masks: dict = field(default_factory=dict, compare=False)  # scale -> (tokens, 1, slots, 1): scale at a row's slot

    def mask(self, scale: float) -> torch.Tensor:
        if scale not in self.masks:
            one_hot = torch.nn.functional.one_hot(self.row_slots - self.first, self.last - self.first + 1)
            self.masks[scale] = (one_hot.to(torch.float32) * scale).view(len(self.row_slots), 1, -1, 1)
        return self.masks[scale]


def plan_rows(runs: list[tuple[int, int, int]], tokens: int, device) -> StepPlan:
    """The plan of a batch from its runs of equal slots (rows of index -1 left out): a slot whose runs average
    fewer than `_GATHER_BELOW` rows is gathered (cpu_grouped_ops' rule), the others stay in place. A batch of at most
    `_SMALL_BATCH` rows, every one with a slot, may also take `_every_slot` (`EverySlot`)."""
    by_slot: dict[int, list[tuple[int, int]]] = {}
    for slot, start, end in runs:
        if slot != -1 and end > start:
            by_slot.setdefault(slot, []).append((start, end))
    in_place, order, spans = [], [], []
    for slot in sorted(by_slot):
        ranges = by_slot[slot]
        if len(ranges) == 1 or sum(hi - lo for lo, hi in ranges) >= _GATHER_BELOW * len(ranges):
            in_place.extend((slot, lo, hi) for lo, hi in ranges)
            continue
        start = len(order)
        for lo, hi in ranges:
            order.extend(range(lo, hi))
        spans.append((slot, start, len(order)))
    gather = torch.tensor(order, dtype=torch.long, device=device) if order else None
    every = None
    covered = sum(hi - lo for ranges in by_slot.values() for lo, hi in ranges)  # the rows with a slot (runs partition)
    if len(by_slot) > 1 and covered == tokens <= _SMALL_BATCH:
        row_slots = [0] * tokens
        for slot, ranges in by_slot.items():
            for lo, hi in ranges:
                row_slots[lo:hi] = [slot] * (hi - lo)
        every = EverySlot(min(by_slot), max(by_slot), len(by_slot),
                          torch.tensor(row_slots, dtype=torch.long, device=device))
    return StepPlan(tokens, tuple(in_place), tuple(spans), gather, every)


def step_plan(wrapper) -> StepPlan:
    """This step's plan (made on first use after vLLM's `update_metadata`): the prefill kernels' segments, or the
    decode kernels' per-token slots, exactly the rows vLLM's own ops would give each slot."""
    plan = getattr(wrapper, "_bdlora_plan", None)
    if plan is None:
        if wrapper.is_prefill:
            _, lengths, slots, *_ = wrapper.prefill_metadata
            runs, tokens = _segment_runs(lengths, slots)
        else:
            slots = wrapper.token_lora_indices.tolist()
            runs, tokens = _token_runs(slots), len(slots)
        plan = wrapper._bdlora_plan = plan_rows(runs, tokens, wrapper.device)
    return plan


def _by_version(tensors, name: str, make, *extra):
    """`make()`, kept on the first of `tensors` under `name` until vLLM writes into any of them (an adapter loaded into
    or removed from a slot), which torch's version counters tell (in-place writes through views bump them); `extra`:
    more of the key."""
    key = (*extra, *((id(t), t._version) for t in tensors))
    cached = tensors[0].__dict__.get(name)
    if cached is None or cached[0] != key:
        cached = tensors[0].__dict__[name] = (key, make())
    return cached[1]


class LayerWeights:
    """One LoRA layer's stacked buffers (vLLM's `lora_a_stacked`, `lora_b_stacked`: a (slots, 1, d_out, d_in) buffer
    per slice) as the fused computation reads them; made once and again only when vLLM writes into a buffer
    (`layer_weights`), so a call does none of this work:
    - `shrink`: each slot's A of every slice side by side, transposed for `x @ w`, (d_in, slices x r): one shrink for
      the whole layer (one slice: views of vLLM's buffer; several: views of one copy);
    - `expand`: per slice, each slot's B transposed, (r, size): views of vLLM's buffer;
    - `every_slot(first, last, dtype)`, for `_every_slot`: the A of slots first..last side by side in float32,
      (d_in, slots x slices x r), and per slice their B^T one above the other, (slots x r, size) in `dtype`: views of
      one copy of every slot (a view of vLLM's buffers for A where one slice in a float32 model), made at first use;
    - `per_slot`: the multiply-adds of one row through one slot (`_every_slot_cheaper`)."""

    def __init__(self, a_stacked: tuple, b_stacked: tuple):
        self.rank, self.slices = b_stacked[0].shape[-1], len(b_stacked)
        self.per_slot = sum(a[0].numel() for a in a_stacked) + sum(b[0].numel() for b in b_stacked)
        side = (_stacked(a_stacked[0], None) if len(a_stacked) == 1
                else torch.cat([_stacked(a, None) for a in a_stacked], dim=1))  # (slots, slices x r, d_in)
        self.side, self.shrink = side, [w.t() for w in side]
        self.b_stacked, self.expand = b_stacked, [[w.t() for w in _stacked(b, None)] for b in b_stacked]
        self.copies: dict = {}  # dtype -> every slot's A and B (every_slot)
        self.ranges: dict = {}  # (first, last, dtype) -> their views

    def every_slot(self, first: int, last: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if (first, last, dtype) not in self.ranges:
            if dtype not in self.copies:
                a_all = self.side.reshape(-1, self.side.shape[-1]).to(torch.float32).t()
                self.copies[dtype] = (a_all, [_stacked(b, None).transpose(1, 2).reshape(-1, b.shape[-2]).to(dtype)
                                              for b in self.b_stacked])
            a_all, b_all = self.copies[dtype]
            n, r = self.slices, self.rank
            self.ranges[(first, last, dtype)] = (a_all[:, first * n * r:(last + 1) * n * r],
                                                 [b[first * r:(last + 1) * r] for b in b_all])
        return self.ranges[(first, last, dtype)]


def layer_weights(y, a_stacked, b_stacked, output_slices) -> LayerWeights | None:
    """The layer's `LayerWeights` (kept on its first A buffer until vLLM writes into any of its buffers), or None
    where the fused computation does not apply (slices of unequal rank, a weight narrower than its output slice,
    slices wider than y: vLLM's method then)."""

    def make():
        rank = b_stacked[0].shape[-1]
        fits = (len(a_stacked) == len(b_stacked) == len(output_slices)
                and all(a.shape[-2] == rank and b.shape[-1] == rank for a, b in zip(a_stacked, b_stacked))
                and all(b.shape[-2] == size for b, size in zip(b_stacked, output_slices))
                and sum(output_slices) <= y.shape[1])
        return LayerWeights(a_stacked, b_stacked) if fits else None

    return _by_version((*a_stacked, *b_stacked), "_bdlora_layer", make, tuple(output_slices), y.shape[1])


def _cast(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return w if w.dtype == dtype else w.to(dtype)


def add_lora_linear(wrapper, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None,
                    vllm_method=None, **kwargs):
    """`PunicaWrapperCPU.add_lora_linear` (its arguments), with one grouping and one gather per layer."""
    if wrapper.no_lora and wrapper.is_prefill:  # vLLM's prefill ops return at once: nothing is added
        return None
    plan = step_plan(wrapper)
    layer = None
    if buffer is None and x.shape[0] == y.shape[0] == plan.tokens:  # the batch's rows are the mapping's tokens
        layer = layer_weights(y, lora_a_stacked, lora_b_stacked, output_slices)
    if layer is None:
        return vllm_method(wrapper, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer,
                           **kwargs)
    if not plan.runs and not plan.spans:  # every row -1
        return None
    every = plan.every
    if every is not None and _every_slot_cheaper(every, plan.tokens, layer):
        _every_slot(every, y, x, *layer.every_slot(every.first, every.last, y.dtype), output_slices, layer.rank,
                    scale)
        return None
    if plan.runs:
        _apply(plan.runs, x, y, layer, output_slices, scale, "add")
    if plan.spans:
        rows = x.index_select(0, plan.order)
        total = sum(output_slices)
        out = torch.empty(rows.shape[0], total, dtype=y.dtype, device=y.device)
        _apply(plan.spans, rows, out, layer, output_slices, scale, "set")
        y[:, :total].index_put_((plan.order,), out, accumulate=True)
    return None


def _apply(runs, x, out, layer: LayerWeights, output_slices, scale: float, mode: str) -> None:
    """For each (slot, start, end): out[start:end] = / += scale * x[start:end] A^T B^T, slice by slice (vLLM's
    dtypes: the shrink in float32, the expand in out's dtype)."""
    rank = layer.rank
    shrunk = torch.empty(x.shape[0], rank * layer.slices, dtype=torch.float32, device=x.device)
    for slot, start, end in runs:
        buf = shrunk[start:end]
        _product(x[start:end], _cast(layer.shrink[slot], torch.float32), "shrink", scale, buf)  # x cast to fp32
        offset = 0
        for i, (b, size) in enumerate(zip(layer.expand, output_slices)):
            target = out[start:end, offset:offset + size]
            _product(buf[:, i * rank:(i + 1) * rank], _cast(b[slot], out.dtype), mode, 1.0, target)
            offset += size


def every_slot_trade(every: EverySlot, tokens: int, layer: LayerWeights) -> tuple[int, int]:
    """What `_every_slot` costs and saves: its extra multiply-adds (each row against every slot from `first` to
    `last`, not only its own) and the GEMMs it saves (a shrink and an expand per slice for each slot used, less its
    own shrink and expands, and the gather's two copies)."""
    extra = tokens * (every.last - every.first) * layer.per_slot
    saved = (every.present - 1) * (1 + layer.slices) + 2
    return extra, saved


def _every_slot_cheaper(every: EverySlot, tokens: int, layer: LayerWeights) -> bool:
    """Whether `_every_slot`'s extra multiply-adds cost less than the GEMMs it saves (`every_slot_trade`), at
    `_MACS_PER_GEMM` a GEMM."""
    extra, saved = every_slot_trade(every, tokens, layer)
    return extra <= saved * _MACS_PER_GEMM


def _every_slot(every: EverySlot, y, x, a_all, b_all, output_slices, rank: int, scale: float) -> None:
    """y += scale * x A^T B^T, each row with its own slot's A and B, in one shrink against the A of every slice of
    every slot from `first` to `last` and one expand per slice against those slots' B: the mask multiplies the
    other slots' columns of the shrink by 0 (exact zeros for finite inputs), so each row's expand sums its own slot's
    products and zeros. vLLM's dtypes: the shrink in float32, `scale * product`; the expand in y's dtype."""
    slots, n, tokens = every.last - every.first + 1, len(output_slices), x.shape[0]
    shrunk = torch.mm(_cast(x, torch.float32), a_all)  # (tokens, slots x slices x r)
    by_slice = torch.empty(tokens, n, slots * rank, dtype=torch.float32, device=x.device)
    torch.mul(shrunk.view(tokens, slots, n, rank).transpose(1, 2), every.mask(scale),
              out=by_slice.view(tokens, n, slots, rank))
    offset = 0
    for i, (b, size) in enumerate(zip(b_all, output_slices)):
        _product(by_slice[:, i], b, "add", 1.0, y[:, offset:offset + size])
        offset += size


def add_lora_logits(wrapper, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, vllm_method=None,
                    **kwargs):
    """`PunicaWrapperCPU.add_lora_logits` (its arguments), which adds nothing when no row's slot holds lm_head
    weights: vLLM keeps a zero B in the slot of an adapter without lm_head (its reset_lora) and still computes every
    row's product, a (tokens, vocab) GEMM of zeros, each step. Anything else: vLLM's method."""
    if buffer is None and not _has_logits_weights(wrapper.sampler_indices, lora_b_stacked):
        return None
    return vllm_method(wrapper, y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)


def _has_logits_weights(indices: torch.Tensor, b_stacked: torch.Tensor) -> bool:
    """Whether a row's slot (index -1: none, nothing added) has a nonzero lm_head B (a zero B adds exact zeros for
    finite inputs). Which slots do is found again when vLLM writes into the buffer (its version counter)."""
    nonzero = _by_version((b_stacked,), "_bdlora_nonzero", lambda: b_stacked.flatten(1).any(dim=1).tolist())
    return any(nonzero[slot] for slot in set(indices.tolist()) if slot != -1)


def install(punica_cpu, source: str | None = None) -> bool:
    """Make `PunicaWrapperCPU.add_lora_linear` the fused one and `add_lora_logits` skip slots without lm_head weights
    (vLLM's methods kept for what they do not cover), and forget the step's plan at each `update_metadata`, if
    `punica_cpu`'s source (read from its file unless given) is a verified one. Idempotent; True when this call
    installed it."""
    cls = punica_cpu.PunicaWrapperCPU
    if hasattr(cls.add_lora_linear, "__bdlora_fused__"):
        return False
    if source is None:
        source = Path(punica_cpu.__file__).read_text()
    if ops_fingerprint(source) not in VERIFIED_PUNICA.values():
        return False
    vllm_add, vllm_logits, vllm_update = cls.add_lora_linear, cls.add_lora_logits, cls.update_metadata

    @functools.wraps(vllm_add)
    def fused(self, *args, **kwargs):
        return add_lora_linear(self, *args, vllm_method=vllm_add, **kwargs)

    @functools.wraps(vllm_logits)
    def logits(self, *args, **kwargs):
        return add_lora_logits(self, *args, vllm_method=vllm_logits, **kwargs)

    @functools.wraps(vllm_update)
    def update_metadata(self, *args, **kwargs):
        self._bdlora_plan = None  # the rows' slots change with the step
        return vllm_update(self, *args, **kwargs)

    fused.__bdlora_fused__ = vllm_add
    logits.__bdlora_fused__ = vllm_logits
    update_metadata.__bdlora_fused__ = vllm_update
    cls.add_lora_linear, cls.add_lora_logits, cls.update_metadata = fused, logits, update_metadata
    return True
