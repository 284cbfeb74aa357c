"""The TP runtime's pieces that need no process group: the TP layer classes a sharded layer becomes, the expert
deltas' hooks, the optimizer state of rank-local pieces, the mesh sizes a base was loaded with; and one spawn of two
ranks in which the runtime's sharded layer, tp-check's and the vLLM plugin's rank-local factors agree. Whole-model
sharded training and its exactness against one process run under torchrun in tests/tp_runtime/test_tp_training.py."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from bdlora_train import BlockDiagLoraConfig, build_tiny_model, get_peft_model
from bdlora_train.core.errors import TPError
from bdlora_train.core.layout import COLUMN
from bdlora_train.peft_integration.layers import BlockDiagLoraLinear
from bdlora_train.tp_runtime.dispatch import adapted_layers
from bdlora_train.tp_runtime.experts import ExpertDeltas
from bdlora_train.tp_runtime.layers import ReplicatedLora, ShardedLora, TPLoraLayer, become
from bdlora_train.tp_runtime.mesh import ep_size, mesh_sizes
from bdlora_train.tp_runtime.pieces import factor_pieces
from bdlora_train.tp_runtime.state import _map_piece_state
from bdlora_train.tp_runtime.styles import AdapterShard


def _adapted():
    model = get_peft_model(build_tiny_model("llama", seed=0), BlockDiagLoraConfig(r=4, nblocks=2))
    return model, adapted_layers(model)


def test_a_sharded_layer_becomes_its_tp_class_and_keeps_its_parameters():
    model, layers = _adapted()
    attention = "base_model.model.model.layers.0.self_attn"
    q, k = layers[f"{attention}.q_proj"], layers[f"{attention}.k_proj"]
    keys = list(q.state_dict())
    assert not any(isinstance(m, TPLoraLayer) for m in model.modules())
    shard = AdapterShard(COLUMN, "bd_b", 2, mesh=None)
    assert become(q, ShardedLora, shard) is shard and q.tp_shard is shard
    assert isinstance(q, ShardedLora) and isinstance(q, BlockDiagLoraLinear)  # PEFT's layer still, with the TP forward
    assert type(q).forward is ShardedLora.forward and list(q.state_dict()) == keys
    assert [n for n, m in model.named_modules() if isinstance(m, TPLoraLayer)] == [f"{attention}.q_proj"]
    become(k, ShardedLora, shard)
    assert type(k) is type(q)  # one class per (TP class, layer class)
    with pytest.raises(TPError, match="rank-local already"):
        become(q, ReplicatedLora, shard)


def test_a_sharded_adapter_names_the_pieces_it_holds_and_counts_them_whole():
    """ShardedAdapter.of finds each shard's pieces by PEFT's parameter name, counts a piece as its whole tensor (what
    PEFT saves), and marks the factors of expert-parallel shards."""
    from bdlora_train.tp_runtime.adapter import ShardedAdapter
    from bdlora_train.tp_runtime.styles import EXPERT_PARALLEL

    model, layers = _adapted()
    q, o = (f"base_model.model.model.layers.0.self_attn.{p}" for p in ("q_proj", "o_proj"))
    a = layers[q].lora_A["default"].weight  # (r 4, 64)
    _, piece_b = factor_pieces((4, 64), (64, 4), (64,), r=4, world=2, experts=0, factor="B", block_diagonal=True)
    shards = {
        q: AdapterShard(COLUMN, "bd_b", 2, mesh=None, dense=True, pieces=(None, piece_b)),
        o: AdapterShard(EXPERT_PARALLEL, "bd_a", 2, mesh=None),
    }
    sharded = ShardedAdapter.of(model, shards)
    assert sharded.pieces == {f"{q}.lora_B.default.weight": piece_b}
    assert sharded.numel(f"{q}.lora_B.default.weight", torch.zeros(1, 32, 2)) == 64 * 4  # the piece's whole tensor
    assert sharded.numel(f"{q}.lora_A.default.weight", a) == 4 * 64
    assert sharded.expert_parallel == {f"{o}.lora_A.default.weight", f"{o}.lora_B.default.weight"}
    assert sharded.deltas == []  # no experts module adapted


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 3, 4), requires_grad=False)

    def forward(self, x):
        return torch.einsum("ti,eoi->teo", x, self.w)


def test_expert_deltas_add_the_staged_delta_while_the_experts_run_then_put_the_parameter_back():
    experts = _Experts()
    original = experts.w
    x, delta = torch.randn(5, 4), torch.randn(2, 3, 4)
    deltas = ExpertDeltas(experts)
    deltas.staged["w"] = delta
    torch.testing.assert_close(experts(x), torch.einsum("ti,eoi->teo", x, original + delta))
    assert experts._parameters["w"] is original  # restored after the forward
    deltas.staged["w"] = torch.randn(2, 4, 3)
    with pytest.raises(TPError, match="does not fit"):
        experts(x)
    assert experts._parameters["w"] is original
    deltas.remove()
    torch.testing.assert_close(experts(x), torch.einsum("ti,eoi->teo", x, original))  # the hooks are off


def test_the_optimizer_state_of_a_piece_is_saved_in_peft_layout_and_read_back():
    """A checkpoint's optimizer state holds PEFT's 2-D tensor (zeros where no rank holds an entry) whatever the TP
    degree; at resume each rank's (N, a, b) pieces come back exactly."""
    _, piece_b = factor_pieces((8, 16), (12, 8), (6, 6), r=8, world=2, experts=0, factor="B", block_diagonal=True)
    pieces = {"w": piece_b}
    full = torch.randn(piece_b.shape) * piece_b.unpack(piece_b.pack(torch.ones(piece_b.shape)))  # on-block entries
    packed = piece_b.pack(full)
    state = _map_piece_state(pieces, {"state": {"w": {"exp_avg": packed.clone(), "step": torch.tensor(3.0)}}}, True)
    assert torch.equal(state["state"]["w"]["exp_avg"], full) and state["state"]["w"]["step"] == 3
    back = _map_piece_state(pieces, state, to_peft=False)
    assert torch.equal(back["state"]["w"]["exp_avg"], packed)


def test_the_mesh_sizes_are_the_distributed_config_the_base_was_loaded_with():
    model = SimpleNamespace(config=SimpleNamespace(distributed_config=SimpleNamespace(tp_size=2, fsdp_size=None)))
    assert mesh_sizes(model) == (1, 1, 2) and ep_size(model) == 1
    model.config.distributed_config = SimpleNamespace(tp_size=2, fsdp_size=2, dp_replicate_size=1, ep_size=4)
    assert mesh_sizes(model) == (1, 2, 2) and ep_size(model) == 4


# --------------------------------------------------------------------------------------------------------------------
# One sharded math: the training runtime's TP layer (tp_runtime/layers.py `ShardedLora`), which tp-check's BD-LoRA
# forward runs (tp_diagnostics/shard_model.py `runtime_model`), and the vLLM plugin's rank-local factors
# (vllm_plugin/sharding.py `local_factors`, then vLLM's own slicing: B's rows of the output shard, A's columns of the
# input shard) compute each rank's share of the same BD-LoRA layer. Float64: they agree to 1e-12, and sum
# (row-parallel) or concatenate (column-parallel) to the unsharded PEFT layer.

PROJECTIONS = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj")  # bd_b column, bd_a row


def _runtime_and_plugin(job, mesh):
    """One rank: q_proj and o_proj of a tiny Llama's saved BD-LoRA adapter, as tp-check shards it with the runtime and
    as the plugin holds it; the largest difference between them and against the unsharded layer."""
    import copy
    import tempfile

    from bdlora_train.adapters.load import load_adapter
    from bdlora_train.adapters.reader import read_adapter
    from bdlora_train.core.blocks import rank_slice
    from bdlora_train.tp_diagnostics.shard_model import runtime_model
    from bdlora_train.vllm_plugin.sharding import local_factors

    rank, world = mesh.get_local_rank(), mesh.size()
    base_model = build_tiny_model("llama", seed=0, num_key_value_heads=4).double()  # 4 KV heads: nblocks 4 fits
    model = get_peft_model(copy.deepcopy(base_model), BlockDiagLoraConfig(r=8, nblocks=job["nblocks"]))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype))
    worst = {"runtime_vs_plugin": 0.0, "runtime_vs_unsharded": 0.0}
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        factors = read_adapter(tmp).modules
        unsharded = load_adapter(copy.deepcopy(base_model), tmp)
        sharded = runtime_model(copy.deepcopy(base_model), mesh, tmp)
    for name in PROJECTIONS:
        layer = sharded.get_submodule(f"base_model.model.{name}")
        full = unsharded.get_submodule(f"base_model.model.{name}")
        base = full.get_base_layer()
        column = factors[name].role == "bd_b"
        ins, outs = rank_slice(64, rank, world), rank_slice(base.out_features, rank, world)
        x_local = x if column else x[..., ins]
        with torch.no_grad():
            runtime = layer(x_local)  # column: this rank's output shard; row: the all-reduced output
            want = full(x)[..., outs] if column else full(x)
            a, b = local_factors(factors[name].role, factors[name].A, factors[name].B, job["nblocks"], world, rank)
            if column:  # vLLM keeps A whole and B's rows of the rank's output shard
                plugin = base(x)[..., outs] + factors[name].scaling * (x @ a.T) @ b[outs].T
            else:  # A's columns of the rank's input shard; the partial sums are the base all-reduce's
                plugin = x_local @ base.weight[:, ins].T + factors[name].scaling * (x_local @ a[:, ins].T) @ b.T
                torch.distributed.all_reduce(plugin)
        for key, other in (("runtime_vs_plugin", plugin), ("runtime_vs_unsharded", want)):
            worst[key] = max(worst[key], float((runtime - other).abs().max() / want.abs().max()))
    return dict(world_size=world, **worst)


def test_tp_checks_runtime_layers_and_the_plugin_compute_the_same_sharded_layer():
    """nblocks = TP (one block a rank) and nblocks = 2 TP (two), at TP 2."""
    from bdlora_train.tp_diagnostics.ranks import launch

    for results in launch(_runtime_and_plugin, [dict(nblocks=2), dict(nblocks=4)], 2):
        for result in results:
            assert max(result[k] for k in result if k != "world_size") < 1e-12, result
