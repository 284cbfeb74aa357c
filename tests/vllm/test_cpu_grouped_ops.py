"""The plugin's grouped CPU LoRA ops (bdlora_train/vllm_plugin/cpu_grouped_ops.py) against vLLM's own ops.

Reference: the installed vLLM's `lora_ops.py`, executed on its own (the file imports only torch; not the module the
plugin may have patched). vLLM 0.32.0's ops give a token with index -1 the last slot (the defect vLLM 0.33.0 fixed by
masking those rows); the reference is therefore vLLM's op applied to the rows that have a slot (for `sgmv_*`: to
the sequences that have one, with vLLM's own arguments), and the rows of index -1 must come back as 0.33.0 leaves
them: untouched by an expand, zero in a shrink's columns. Rows past the tokens (padding) stay untouched.

Tolerance, per output element: both implementations sum the same k products x_j w_j (in the output's dtype, after
vLLM's casts) in a different order (one GEMM per slot or per batch vs vLLM's batched einsum). Each fp32 sum is within
gamma_k * M of the exact one (M = sum_j |x_j w_j|, gamma_k ~ k u, u = 2^-24; with an FMA the products are not even
rounded apart), so the two differ by at most 2 k u M; the scaling product and the add into the prior output o
(add_inputs) round once more each: |new - vLLM| <= 2 (k + 2) u (|scaling| M + |o|). In a bf16 output (vLLM's expand
of a bf16 model) the products of bf16 values are exact in fp32 and both sides accumulate in fp32, then round the
product and the sum to bf16 (u_b = 2^-8): each adds at most u_b |value| per side, 4 u_b (M + |o|) in all.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from bdlora_train.vllm_plugin import cpu_grouped_ops as grouped
from bdlora_train.vllm_plugin import cpu_ops

U32, U_BF16 = 2.0 ** -24, 2.0 ** -8
SLOTS = 5
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]
DTYPE_IDS = ["fp32", "bf16-weights-fp32-out", "bf16"]


def _ops_source() -> str:
    root = Path(next(iter(importlib.util.find_spec("vllm").submodule_search_locations)))
    return (root / "lora/ops/torch_ops/lora_ops.py").read_text()


@pytest.fixture(scope="module")
def vllm_ops():
    module = types.ModuleType("vllm_lora_ops_reference")
    exec(compile(_ops_source(), "lora_ops.py", "exec"), module.__dict__)  # noqa: S102 - vLLM's own file
    return module


def _bound(x, w, slots, out_dtype, scaling=1.0, prior=None):
    """The tolerance above, per element: x (T, k) inputs, w (S, d_out, k) weights, slots (T,) with -1 = none."""
    xc, wc = x.to(out_dtype).double().abs(), w.to(out_dtype).double().abs()
    m = torch.einsum("tk,tok->to", xc, wc[slots.clamp(min=0)])
    o = torch.zeros_like(m) if prior is None else prior.double().abs()
    k = x.shape[1]
    tol = 2 * (k + 2) * U32 * (abs(scaling) * m + o)
    if out_dtype == torch.bfloat16:
        tol = tol + 4 * U_BF16 * (abs(scaling) * m + o)
    return tol + 1e-30


def _close(got, want, tol, what):
    diff = (got.double() - want.double()).abs()
    assert torch.isfinite(got).all(), what
    assert (diff <= tol).all(), f"{what}: max |diff| {diff.max():.3g}, worst diff/bound {(diff / tol).max():.3g}"


def _stack(d_out, d_in, dtype, gen, four_d=True):
    w = torch.randn(SLOTS, d_out, d_in, generator=gen).to(dtype)
    return w.unsqueeze(1) if four_d else w


def _slot_batches(gen):
    """(name, slots) decode batches: every slot used, index -1 rows, a single slot, sizes across the op's paths
    (one GEMM against every slot for small batches without -1, gathered short runs, runs in place)."""
    every = torch.arange(SLOTS).repeat(3)
    yield "every slot, round-robin", every
    yield "every slot and -1, shuffled", torch.cat([every, torch.full((4,), -1)])[torch.randperm(19, generator=gen)]
    yield "three slots round-robin, 8 tokens", torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    yield "3 tokens", torch.tensor([2, 0, 1])
    yield "one token", torch.tensor([3])
    yield "one token without adapter", torch.tensor([-1])
    yield "all -1", torch.full((6,), -1)
    yield "one slot", torch.full((7,), 4)
    yield "sorted runs", torch.tensor([0] * 20 + [-1] * 17 + [3] * 25 + [1] * 18)
    yield "random 60 with -1", torch.randint(-1, SLOTS, (60,), generator=gen)
    yield "random 200", torch.randint(0, SLOTS, (200,), generator=gen)


def _reference(op, x, w, out, slots, *args):
    """vLLM's bgmv op on the rows with a slot (0.33.0's masking of index -1); returns the expected output."""
    want = out.clone()
    rows = (slots != -1).nonzero().flatten()
    if rows.numel():
        part = want[rows]
        op(x[rows], w, part, slots[rows], *args)
        want[rows] = part
    return want


@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
def test_bgmv_shrink_equals_vllms(vllm_ops, dtypes):
    w_dtype, out_dtype = dtypes
    gen = torch.Generator().manual_seed(0)
    d_in, r = 96, 16
    w = _stack(r, d_in, w_dtype, gen)
    for name, slots in _slot_batches(gen):
        for scaling in (1.0, 0.5):
            t = slots.shape[0]
            x = torch.randn(t, d_in, generator=gen).to(w_dtype)
            out = torch.randn(t, r, generator=gen).to(out_dtype)
            want = _reference(vllm_ops.bgmv_shrink, x, w, out, slots, scaling)
            want[slots == -1] = 0  # 0.33.0 assigns the masked product
            got = out.clone()
            grouped.bgmv_shrink(x, w, got, slots, scaling)
            _close(got, want, _bound(x, w[:, 0], slots, out_dtype, scaling), f"shrink {name} x{scaling}")


@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("add_inputs", [True, False])
def test_bgmv_expand_and_slices_equal_vllms(vllm_ops, dtypes, add_inputs):
    w_dtype, out_dtype = dtypes
    gen = torch.Generator().manual_seed(1)
    r, d_out, width = 16, 48, 160
    w = _stack(d_out, r, w_dtype, gen)
    for name, slots in _slot_batches(gen):
        t = slots.shape[0]
        x = torch.randn(t, r, generator=gen).to(w_dtype)
        for offset in (0, 40, width - d_out):  # merged column layers: each slice at its offset
            out = torch.randn(t, width, generator=gen).to(out_dtype)
            want = _reference(vllm_ops.bgmv_expand_slice, x, w, out, slots, offset, d_out, add_inputs)
            got = out.clone()
            grouped.bgmv_expand_slice(x, w, got, slots, offset, d_out, add_inputs)
            prior = out[:, offset:offset + d_out] if add_inputs else None
            bound = torch.zeros(t, width, dtype=torch.float64)
            bound[:, offset:offset + d_out] = _bound(x, w[:, 0], slots, out_dtype, prior=prior)
            _close(got, want, bound + 1e-30, f"expand_slice {name} at {offset}")
            assert torch.equal(got[slots == -1], out[slots == -1]), f"{name}: rows without adapter changed"
        for out_width in (d_out + 24, d_out - 8):  # bgmv_expand's common_len: the narrower of the two
            out = torch.randn(t, out_width, generator=gen).to(out_dtype)
            want = _reference(vllm_ops.bgmv_expand, x, w, out, slots, add_inputs)
            got = out.clone()
            grouped.bgmv_expand(x, w, got, slots, add_inputs)
            common = min(d_out, out_width)
            bound = torch.zeros(t, out_width, dtype=torch.float64)
            bound[:, :common] = _bound(x, w[:, 0, :common], slots, out_dtype,
                                       prior=out[:, :common] if add_inputs else None)
            _close(got, want, bound + 1e-30, f"expand {name} into {out_width} columns")
            assert torch.equal(got[slots == -1], out[slots == -1]), f"{name}: rows without adapter changed"


def _sequences(gen):
    """(name, lengths, slots) prefill batches: several sequences of different lengths from row 0."""
    yield "every slot", [7, 33, 1, 64, 12], [0, 1, 2, 3, 4]
    yield "with -1 and repeats", [20, 5, 40, 17, 9, 30], [2, -1, 2, 2, 0, -1]
    yield "one sequence", [50], [3]
    yield "one token", [1], [1]
    yield "only -1", [8, 8], [-1, -1]
    yield "random", torch.randint(1, 80, (8,), generator=gen).tolist(), torch.randint(-1, SLOTS, (8,),
                                                                                       generator=gen).tolist()


def _sgmv_args(lengths, slots):
    seq_len = torch.tensor(lengths)
    return (torch.cumsum(seq_len, 0) - seq_len, seq_len, torch.tensor(slots), len(lengths), max(lengths),
            int(seq_len.sum()))


def _sgmv_reference(op, x, w, out, lengths, slots, *args):
    """vLLM's sgmv op on the sequences with a slot (their rows, vLLM's own metadata for them)."""
    want = out.clone()
    keep = [i for i, s in enumerate(slots) if s != -1]
    if keep:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        rows = torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in keep])
        part = want[rows]
        op(x[rows], w, part, *_sgmv_args([lengths[i] for i in keep], [slots[i] for i in keep]), *args)
        want[rows] = part
    return want


@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
def test_sgmv_ops_equal_vllms(vllm_ops, dtypes):
    w_dtype, out_dtype = dtypes
    gen = torch.Generator().manual_seed(2)
    d_in, r, d_out, width = 80, 8, 40, 120
    a, b = _stack(r, d_in, w_dtype, gen), _stack(d_out, r, w_dtype, gen)
    for name, lengths, slots in _sequences(gen):
        t = sum(lengths)
        token_slots = torch.repeat_interleave(torch.tensor(slots), torch.tensor(lengths))
        args = _sgmv_args(lengths, slots)
        x = torch.randn(t, d_in, generator=gen).to(w_dtype)
        out = torch.randn(t, r, generator=gen).to(out_dtype)
        want = _sgmv_reference(vllm_ops.sgmv_shrink, x, a, out, lengths, slots, 2.0)
        want[token_slots == -1] = 0
        got = out.clone()
        grouped.sgmv_shrink(x, a, got, *args, 2.0)
        _close(got, want, _bound(x, a[:, 0], token_slots, out_dtype, 2.0), f"sgmv_shrink {name}")
        h = torch.randn(t, r, generator=gen).to(w_dtype)
        for add_inputs in (True, False):
            for offset in (0, width - d_out):
                out = torch.randn(t, width, generator=gen).to(out_dtype)
                want = _sgmv_reference(vllm_ops.sgmv_expand_slice, h, b, out, lengths, slots, offset, d_out,
                                       add_inputs)
                got = out.clone()
                grouped.sgmv_expand_slice(h, b, got, *args, offset, d_out, add_inputs)
                bound = torch.zeros(t, width, dtype=torch.float64)
                bound[:, offset:offset + d_out] = _bound(h, b[:, 0], token_slots, out_dtype,
                                                         prior=out[:, offset:offset + d_out] if add_inputs else None)
                _close(got, want, bound + 1e-30, f"sgmv_expand_slice {name} at {offset}")
                assert torch.equal(got[token_slots == -1], out[token_slots == -1])
            out = torch.randn(t, d_out, generator=gen).to(out_dtype)
            want = _sgmv_reference(vllm_ops.sgmv_expand, h, b, out, lengths, slots, add_inputs)
            got = out.clone()
            grouped.sgmv_expand(h, b, got, *args, add_inputs)
            _close(got, want, _bound(h, b[:, 0], token_slots, out_dtype, prior=out if add_inputs else None),
                   f"sgmv_expand {name}")


def test_padding_rows_untouched_and_one_token_broadcast_as_vllm(vllm_ops):
    """Output buffers with more rows than tokens: only the tokens' rows change. vLLM's one-token case broadcasts that
    token's row over every output row (its `limit = 1` / broadcasting): the grouped ops do the same."""
    gen = torch.Generator().manual_seed(3)
    a, b = _stack(8, 32, torch.float32, gen), _stack(24, 8, torch.float32, gen)
    for slots in (torch.tensor([1, 0, 4, 1]), torch.tensor([2, -1, 2]), torch.arange(SLOTS).repeat(8)):
        t = slots.shape[0]
        x, h = torch.randn(t, 32, generator=gen), torch.randn(t, 8, generator=gen)
        for call, args in ((grouped.bgmv_shrink, (x, a)), (grouped.bgmv_expand, (h, b))):
            out = torch.randn(t + 5, 8 if call is grouped.bgmv_shrink else 24, generator=gen)
            got = out.clone()
            call(*args, got, slots)
            assert torch.equal(got[t:], out[t:]), f"{call.__name__}: padding rows changed"
            ref = out[:t].clone()
            getattr(grouped, call.__name__)(*args, ref, slots)
            assert torch.equal(got[:t], ref), call.__name__
        lengths = [t - 1, 1]
        out = torch.randn(t + 5, 8, generator=gen)
        got = out.clone()
        grouped.sgmv_shrink(x, a, got, *_sgmv_args(lengths, [0, 3]), 1.0)
        assert torch.equal(got[t:], out[t:]), "sgmv_shrink: padding rows changed"
    x, h = torch.randn(1, 32, generator=gen), torch.randn(1, 8, generator=gen)
    for slot in (2, -1):
        for add_inputs in (True, False):
            out = torch.randn(4, 24, generator=gen)
            want, got = out.clone(), out.clone()
            if slot != -1:
                vllm_ops.bgmv_expand(h, b, want, torch.tensor([slot]), add_inputs)
            grouped.bgmv_expand(h, b, got, torch.tensor([slot]), add_inputs)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        out = torch.randn(4, 8, generator=gen)
        want, got = (out.clone(), out.clone()) if slot != -1 else (torch.zeros(4, 8), out.clone())
        if slot != -1:
            vllm_ops.bgmv_shrink(x, a, want, torch.tensor([slot]), 1.0)
        grouped.bgmv_shrink(x, a, got, torch.tensor([slot]), 1.0)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_three_dimensional_weights(vllm_ops):
    """Weights stacked (slots, d_out, d_in), without vLLM's size-1 dim 1, give the same."""
    gen = torch.Generator().manual_seed(4)
    a = _stack(16, 64, torch.float32, gen, four_d=False)
    slots = torch.tensor([1, 1, 1, -1, 3, 3])
    x = torch.randn(6, 64, generator=gen)
    want, got = torch.zeros(6, 16), torch.zeros(6, 16)
    want = _reference(vllm_ops.bgmv_shrink, x, a, want, slots, 1.0)
    grouped.bgmv_shrink(x, a, got, slots, 1.0)
    _close(got, want, _bound(x, a, slots, torch.float32), "3-d weights")


def test_install_replaces_verified_ops_and_guards_others():
    """install() on a module executing the installed (verified) ops file: the six functions become the grouped ones,
    in the module and in a module that imported them by name; a second call changes nothing; on a source that is not
    a verified one (the same file, one comment added) the ops stay vLLM's, with the slot -1 guard."""
    source = _ops_source()
    assert cpu_ops.ops_fingerprint(source) in cpu_ops.VERIFIED_OPS.values()
    ops = types.ModuleType("ops_verified")
    exec(compile(source, "lora_ops.py", "exec"), ops.__dict__)  # noqa: S102
    importer = types.SimpleNamespace(**{name: getattr(ops, name) for name in grouped.OPS})
    assert cpu_ops.install(ops, importer, source=source) == "grouped"
    for name in grouped.OPS:
        assert getattr(ops, name).__bdlora_grouped__ is not None and getattr(importer, name) is getattr(ops, name)
    assert not cpu_ops.has_slot_defect(ops)
    assert cpu_ops.install(ops, importer, source=source) is None
    edited = source + "\n# a release we have not read\n"
    other = types.ModuleType("ops_unverified")
    exec(compile(edited, "lora_ops.py", "exec"), other.__dict__)  # noqa: S102
    defect = cpu_ops.has_slot_defect(other)
    assert cpu_ops.install(other, source=edited) == ("guarded" if defect else None)
    assert not hasattr(other.bgmv_shrink, "__bdlora_grouped__") and not cpu_ops.has_slot_defect(other)


def test_plugin_patch_installs_the_grouped_ops():
    """In a fresh interpreter: after the plugin's register() on the installed vLLM (0.32.0, engine-tested), vLLM's
    six CPU ops, where vLLM's modules hold them (lora_ops, torch_ops, punica_cpu), are the grouped ones, and the CPU
    wrapper's add_lora_linear the fused one (cpu_punica.py)."""
    code = """
import bdlora_train.vllm_plugin as plugin
from bdlora_train.vllm_plugin import cpu_grouped_ops, cpu_ops
plugin.register()
from vllm.lora.ops import torch_ops
from vllm.lora.ops.torch_ops import lora_ops
from vllm.lora.punica_wrapper import punica_cpu
for name in cpu_grouped_ops.OPS:
    op = getattr(lora_ops, name)
    assert op.__bdlora_grouped__ is not None and op.__wrapped__ is cpu_grouped_ops.OPS[name], name
    assert getattr(torch_ops, name) is op, name
    assert getattr(punica_cpu, name) is op, name
assert not cpu_ops.has_slot_defect(lora_ops)
assert punica_cpu.PunicaWrapperCPU.add_lora_linear.__bdlora_fused__ is not None
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
