"""The plugin's fused `add_lora_linear` (bdlora_train/vllm_plugin/cpu_punica.py) against vLLM's own method.

Reference: vLLM's `PunicaWrapperCPU.add_lora_linear` (the installed punica_cpu.py, executed in a module of its own so
the real class stays as it is) calling vLLM's own torch ops (lora_ops.py, executed on its own). vLLM 0.32.0's ops give
a row with index -1 the last slot (fixed in 0.33.0): the reference is therefore vLLM's method on the sequences that
have a slot, with vLLM's own metadata for them, and rows of index -1 must come back untouched.

Tolerance, per output element (test_cpu_grouped_ops.py derives the one-op bounds): both sides compute the same
products in the same dtypes (a float32 buffer `b = scale * x A^T`, then `y += b B^T` in y's dtype) and sum them in
another order. The buffer entries differ by at most d_b = 2 (k + 2) u |scale| M_A (k = d_in, M_A = sum |x_k A_jk|,
u = 2^-24), which reaches the output through B: sum_j |B_ij| d_b_j; the expand's own sums differ by at most
2 (r + 2) u (M_B + |y|) (M_B = sum_j |b_j B_ij|). In bf16 (a bf16 model: buffer cast to bf16 before the expand)
each side may round a buffer entry to a neighbouring bf16 value, u_b |b_j| (u_b = 2^-8), and rounds the product and
the sum once each: 4 u_b (M_B + |y|).
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch

from bdlora_train.vllm_plugin import cpu_punica

U32, U_BF16 = 2.0 ** -24, 2.0 ** -8
SLOTS = 5
OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")


def _vllm_file(relative: str) -> str:
    root = Path(next(iter(importlib.util.find_spec("vllm").submodule_search_locations)))
    return (root / relative).read_text()


def _module(name: str, source: str, filename: str, package: str | None = None) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__package__ = package
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - vLLM's own file
    return module


@pytest.fixture(scope="module")
def vllm_ops():
    return _module("vllm_lora_ops_reference", _vllm_file("lora/ops/torch_ops/lora_ops.py"), "lora_ops.py")


def _punica(vllm_ops, fused: bool):
    """A module executing vLLM's punica_cpu.py whose ops are vLLM's own (reference) and, when `fused`, with the
    plugin's method installed."""
    source = _vllm_file("lora/punica_wrapper/punica_cpu.py")
    module = _module("punica_cpu_copy", source, "punica_cpu.py", package="vllm.lora.punica_wrapper")
    for name in OPS:
        setattr(module, name, getattr(vllm_ops, name))
    if fused:
        assert cpu_punica.install(module, source=source)
        assert not cpu_punica.install(module, source=source)  # idempotent
    return module


def _wrapper(module, lengths, slots, prefill=True):
    """A wrapper whose metadata is vLLM's for these sequences (one slot per sequence, -1 = none)."""
    wrapper = module.PunicaWrapperCPU(4096, 256, "cpu")
    tokens = torch.tensor([s for s, n in zip(slots, lengths) for _ in range(n)], dtype=torch.long)
    wrapper._token_lora_indices[: tokens.numel()].copy_(tokens)
    wrapper.indices_len[:] = [tokens.numel()] * 4
    wrapper.is_prefill = prefill
    if prefill:
        wrapper._update_prefill_metadata(tokens)
    return wrapper


def _layer(d_in, outs, r, dtype, gen):
    a = tuple((torch.randn(SLOTS, 1, r, d_in, generator=gen) * 0.1).to(dtype) for _ in outs)
    b = tuple((torch.randn(SLOTS, 1, d, r, generator=gen) * 0.1).to(dtype) for d in outs)
    return a, b


def _bound(x, a, b, rows_slots, scale, y, out_dtype):
    """The tolerance of the module doc, per element of y (float64)."""
    slots = rows_slots.clamp(min=0)
    tol = torch.zeros(y.shape, dtype=torch.float64)
    offset = 0
    xs = x.float().double().abs()
    for a_i, b_i in zip(a, b):
        wa, wb = a_i.squeeze(1).float().double().abs(), b_i.squeeze(1).to(out_dtype).double().abs()
        m_a = torch.einsum("tk,tjk->tj", xs, wa[slots]) * abs(scale)  # |b_j| <= m_a
        d_b = 2 * (x.shape[1] + 2) * U32 * m_a
        if out_dtype == torch.bfloat16:
            d_b = d_b + U_BF16 * m_a
        m_b = torch.einsum("tj,tij->ti", m_a, wb[slots])
        prior = y[:, offset: offset + wb.shape[1]].double().abs()
        part = torch.einsum("tj,tij->ti", d_b, wb[slots]) + 2 * (wb.shape[2] + 2) * U32 * (m_b + prior)
        if out_dtype == torch.bfloat16:
            part = part + 4 * U_BF16 * (m_b + prior)
        tol[:, offset: offset + wb.shape[1]] = part
        offset += wb.shape[1]
    return tol + 1e-30


def _reference(reference_module, x, y, a, b, scale, outs, lengths, slots):
    """vLLM's method on the sequences that have a slot; rows of index -1 keep y's values."""
    want = y.clone()
    keep = [i for i, s in enumerate(slots) if s != -1]
    if keep:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        rows = torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in keep])
        wrapper = _wrapper(reference_module, [lengths[i] for i in keep], [slots[i] for i in keep])
        part = want[rows]
        wrapper.add_lora_linear(part, x[rows], a, b, scale, outs)
        want[rows] = part
    return want


BATCHES = [  # (name, sequence lengths, their slots, the plan's path for them)
    ("decode, every slot round-robin (one GEMM against every slot)", [1] * 15, [0, 1, 2, 3, 4] * 3, "every"),
    ("decode, slots 1-3 of 5 (one GEMM against slots 1-3)", [1] * 9, [3, 1, 2] * 3, "every"),
    ("decode, 40 rows round-robin (gathered)", [1] * 40, [0, 1, 2, 3, 4] * 8, "gathered"),
    ("prefill, short sequences, one per slot (one GEMM against every slot)", [5, 3, 7, 2], [2, 0, 4, 1], "every"),
    ("prefill, one sequence per slot (in place)", [9, 3, 17, 6], [2, 0, 4, 1], "in place"),
    ("prefill, a slot's short runs gathered beside a run in place", [6, 20, 9], [1, 3, 1], "gathered"),
    ("prefill, a slot's long runs in place", [20, 5, 30], [2, 0, 2], "in place"),
    ("with -1 rows", [1, 3, 1, 1, 2, 1], [0, -1, 2, 2, -1, 4], "in place"),
    ("one token", [1], [3], "in place"),
]
LAYERS = [("qkv", 48, (24, 8, 8)), ("o", 24, (48,)), ("gate_up", 48, (40, 40)), ("down", 40, (48,))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name, lengths, slots, path", BATCHES, ids=[b[0] for b in BATCHES])
def test_fused_add_lora_linear_equals_vllms(vllm_ops, dtype, name, lengths, slots, path):
    gen = torch.Generator().manual_seed(0)
    reference, fused = _punica(vllm_ops, fused=False), _punica(vllm_ops, fused=True)
    tokens = sum(lengths)
    row_slots = torch.tensor([s for s, n in zip(slots, lengths) for _ in range(n)])
    for prefill in (True, False):  # vLLM's V1 always runs the prefill ops; the decode ops' metadata gives the same rows
        wrapper = _wrapper(fused, lengths, slots, prefill=prefill)
        plan = cpu_punica.step_plan(wrapper)
        taken = "every" if plan.every else "gathered" if plan.spans else "in place"
        assert taken == path, f"{name}: the plan takes the {taken} path"
        for layer, d_in, outs in LAYERS:
            a, b = _layer(d_in, outs, 4, dtype, gen)
            if path == "every":  # at these sizes the extra multiply-adds always cost less than the GEMMs saved
                assert cpu_punica._every_slot_cheaper(plan.every, tokens, cpu_punica.LayerWeights(a, b)), (
                    f"{name}, {layer}: not taken")
            x = torch.randn(tokens, d_in, generator=gen).to(dtype)
            y = torch.randn(tokens, sum(outs) + 3, generator=gen).to(dtype)  # 3 columns past the slices
            want = _reference(reference, x, y, a, b, 0.5, outs, lengths, slots)
            got = y.clone()
            assert wrapper.add_lora_linear(got, x, a, b, 0.5, outs) is None
            what = f"{name}, {layer}, prefill={prefill}"
            tol = _bound(x, a, b, row_slots, 0.5, y, dtype)[:, : sum(outs)]
            diff = (got[:, : sum(outs)].double() - want[:, : sum(outs)].double()).abs()
            worst = (diff / tol).max()
            assert (diff <= tol).all(), f"{what}: max |diff| {diff.max():.3g}, worst diff/bound {worst:.3g}"
            assert torch.equal(got[:, sum(outs):], y[:, sum(outs):]), f"{what}: columns past the slices changed"
            assert torch.equal(got[row_slots == -1], y[row_slots == -1]), f"{what}: a row of index -1 changed"
            assert not torch.equal(got[row_slots != -1], y[row_slots != -1]), f"{what}: nothing was added"


def test_the_plan_follows_vllms_metadata_and_the_weights_their_loads(vllm_ops):
    """The step's grouping is forgotten at vLLM's `update_metadata` (real LoRAMapping, slots from vLLM's
    convert_mapping), and an adapter loaded in place into a slot (vLLM's set_lora / reset_lora: writes into the
    stacked buffers) is what the next call reads, the merged layer's side-by-side copy of A included."""
    from vllm.lora.layers import LoRAMapping

    gen = torch.Generator().manual_seed(1)
    reference, fused = _punica(vllm_ops, fused=False), _punica(vllm_ops, fused=True)
    wrapper = fused.PunicaWrapperCPU(4096, 256, "cpu")
    a, b = _layer(16, (6, 6), 4, torch.float32, gen)
    x = torch.randn(6, 16, generator=gen)
    lora_index_to_id = [10, 11, 12, 13, 14]  # slot k holds the adapter with id 10 + k
    checks = [([10, 10, 11, 11, 12, 12], None), ([14, 13, 14, 13, 0, 0], None), ([14, 13, 14, 13, 12, 12], None),
              ([14, 13, 14, 13, 0, 0], lambda: a[1][3].copy_(torch.randn(1, 4, 16, generator=gen))),  # set_lora
              ([14, 13, 14, 13, 12, 12], lambda: a[1][3].copy_(torch.randn(1, 4, 16, generator=gen))),
              ([14, 13, 14, 13, 0, 0], lambda: b[0][3].copy_(torch.randn(1, 6, 4, generator=gen))),
              ([14, 13, 14, 13, 12, 12], lambda: b[1][4].copy_(torch.randn(1, 6, 4, generator=gen))),
              ([14, 13, 14, 13, 0, 0], lambda: a[0].__setitem__(4, 0)),  # reset_lora of slot 4
              ([14, 13, 14, 13, 12, 12], lambda: b[0].__setitem__(3, 0))]
    paths = set()
    for ids, load in checks:
        if load is not None:
            load()
        wrapper.update_metadata(LoRAMapping(ids, ids, is_prefill=True), lora_index_to_id, SLOTS, 32)
        slots = [lora_index_to_id.index(i) if i else -1 for i in ids]
        want = _reference(reference, x, torch.zeros(6, 12), a, b, 1.0, (6, 6), [1] * 6, slots)
        got = torch.zeros(6, 12)
        wrapper.add_lora_linear(got, x, a, b, 1.0, (6, 6))
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"mapping {ids}: stale grouping or weights"
        paths.add(wrapper._bdlora_plan.every is not None)
    assert paths == {True, False}  # both the per-slot weights and every slot's copies are checked


def test_what_it_does_not_cover_takes_vllms_method(vllm_ops):
    """A `buffer` handed in goes to vLLM's own method (its ops), with its result; on a punica_cpu.py that is not a
    verified one nothing is installed; a step whose rows all have index -1 (no_lora) adds nothing."""
    gen = torch.Generator().manual_seed(2)
    reference, fused = _punica(vllm_ops, fused=False), _punica(vllm_ops, fused=True)
    a, b = _layer(8, (6, 6), 4, torch.float32, gen)
    x = torch.randn(4, 8, generator=gen)
    got, want = torch.zeros(4, 12), torch.zeros(4, 12)
    _wrapper(reference, [2, 2], [0, 1]).add_lora_linear(want, x, a, b, 1.0, (6, 6), buffer=(torch.zeros(4, 4),) * 2)
    _wrapper(fused, [2, 2], [0, 1]).add_lora_linear(got, x, a, b, 1.0, (6, 6), buffer=(torch.zeros(4, 4),) * 2)
    assert torch.equal(got, want) and got.abs().sum() > 0
    edited = _vllm_file("lora/punica_wrapper/punica_cpu.py") + "\n# a release we have not read\n"
    other = _module("punica_cpu_other", edited, "punica_cpu.py", package="vllm.lora.punica_wrapper")
    assert not cpu_punica.install(other, source=edited)
    assert not hasattr(other.PunicaWrapperCPU.add_lora_linear, "__bdlora_fused__")
    y = torch.randn(3, 12, generator=gen)
    before = y.clone()
    _wrapper(fused, [3], [-1]).add_lora_linear(y, torch.randn(3, 8, generator=gen), a, b, 1.0, (6, 6))
    assert torch.equal(y, before)


def test_logits_skip_only_the_slots_without_lm_head_weights(vllm_ops):
    """`add_lora_logits`: a batch whose slots hold a zero lm_head B (vLLM's reset_lora of an adapter without lm_head)
    keeps the logits as they are, which is what vLLM's own method gives there; a slot with lm_head weights, or one
    that vLLM writes them into in place (set_lora), gets vLLM's method."""
    from vllm.lora.layers import LoRAMapping

    gen = torch.Generator().manual_seed(3)
    reference, fused = _punica(vllm_ops, fused=False), _punica(vllm_ops, fused=True)
    a = torch.randn(SLOTS, 1, 4, 16, generator=gen) * 0.1
    b = torch.zeros(SLOTS, 1, 40, 4)
    b[4] = torch.randn(1, 40, 4, generator=gen)  # slot 4's adapter trains lm_head
    x, y = torch.randn(6, 16, generator=gen), torch.randn(6, 40, generator=gen)
    lora_index_to_id = [10, 11, 12, 13, 14]
    skipped = []
    checks = [([10, 11, 12, 10, 11, 12], None, True), ([10, 14, 11, 14, 12, 10], None, False),
              ([10, 11, 12, 10, 11, 12], lambda: b[1].copy_(torch.randn(1, 40, 4, generator=gen)), False),
              ([14, 12, 14, 12, 10, 10], lambda: (b[4].zero_(), b[1].zero_()), True)]
    for ids, load, zero in checks:
        if load is not None:
            load()
        results = []
        for module in (reference, fused):
            wrapper = module.PunicaWrapperCPU(4096, 256, "cpu")
            wrapper.update_metadata(LoRAMapping(ids, ids, is_prefill=True), lora_index_to_id, SLOTS, 40)
            got = y.clone()
            wrapper.add_lora_logits(got, x, a, b, 1.0)
            results.append(got)
        want, got = results
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"mapping {ids}: not vLLM's logits"
        assert torch.equal(want, y) == zero, f"mapping {ids}: vLLM's method {'changed' if zero else 'kept'} them"
        skipped.append(torch.equal(got, y))
    assert skipped == [True, False, False, True]
