"""What bdlora-train relies on in PEFT, transformers and torch, in one file: run it first after upgrading any.

Every assertion here is a fact some toolkit module depends on (named in each test). When one fails, fix that
module, then move the upper bound in pyproject.toml (`peft<…`, `transformers<…`) to the version that passes.
`PRIVATE` lists every private (underscore or internal-module) name of another library the package uses, and
`test_every_private_name_the_package_uses_is_listed` fails when code starts using one that is not listed here.
"""

import ast
import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]

# Private names of other libraries the package uses: name -> (library object it belongs to, the module that uses it).
# Each is checked by a test in this file, except vLLM's, which tests/vllm checks on the engine it patches.
PRIVATE = {
    "_register_custom_module": ("peft LoraConfig (experimental custom-module API)", "peft_integration/config.py"),
    "_get_bdlora_delta_weight": ("peft BdLoraLinearVariant", "peft_integration/layers.py"),
    "_get_weight_from_module_maybe_blockdiagonal": ("peft BdLoraLinearVariant", "peft_integration/quant_layers.py"),
    "_did_swap_in_out_features": ("peft ParamWrapper", "peft_integration/experts.py, tp_runtime/experts.py"),
    "_active_adapter": ("peft LoraLayer (set by its bitsandbytes __init__)", "peft_integration/quant_layers.py"),
    "_save_checkpoint": ("transformers Trainer", "trainer/mixins.py"),
    "_get_output_dir": ("transformers Trainer", "trainer/mixins.py"),
    "_load_from_checkpoint": (
        "transformers Trainer (TP runs: the adapter back into rank-local shards)",
        "trainer/mixins.py",
    ),
    "_save_optimizer_and_scheduler": ("transformers Trainer (TP runs: gathered optimizer state)", "trainer/mixins.py"),
    "_load_optimizer_and_scheduler": ("transformers Trainer (TP runs)", "trainer/mixins.py"),
    "_save_rng_state": ("transformers Trainer (TP runs save with save_only_model)", "trainer/mixins.py"),
    "_track_num_input_tokens": ("transformers Trainer (TP runs: a TP group's batch counted once)", "trainer/mixins.py"),
    "_tp_plan": ("transformers DistributedMixin (the plan PEFT's TP hooks read)", "tp_runtime/dispatch.py"),
    "_parameters": (
        "torch nn.Module",
        "tp_runtime/dispatch.py, tp_runtime/experts.py, tp_diagnostics/sharded_lora.py",
    ),
    "_spec": (
        "torch DTensor (its DTensorSpec, handed to the internal `DTensor(local, spec, requires_grad=)` constructor)",
        "tp_runtime/node.py",
    ),
    "_forward_hooks": ("torch nn.Module (a hooked base layer keeps PEFT's forward)", "peft_integration/layers.py"),
    "_forward_pre_hooks": ("torch nn.Module (a hooked base layer keeps PEFT's forward)", "peft_integration/layers.py"),
    "_ops": ("torch (torch._ops.HigherOrderOperator)", "tp_diagnostics/ranks.py"),
    "_overloadpacket": ("torch OpOverload", "tp_diagnostics/ranks.py"),
    "_comm_mode": ("torch.distributed.tensor.debug._comm_mode (CommDebugMode's op tables)", "tp_diagnostics/ranks.py"),
    "_python_dispatch": ("torch.utils._python_dispatch.TorchDispatchMode", "tp_diagnostics/ranks.py"),
    "_get_help_string": ("argparse HelpFormatter (ArgumentDefaultsHelpFormatter's hook)", "core/helptext.py"),
    "_exit": ("os (documented: exit without cleanup, a rank whose launcher died)", "launch/checks.py"),
    "_instances": ("tqdm tqdm (its open bars: a one-line error starts a line of its own)", "core/boundary.py"),
    "_tokenize_prompts": ("trl GRPOTrainer (the prompt token ids its own generation feeds)", "objectives/grpo.py"),
    "_metrics": ("trl GRPOTrainer (its per-logging-step metric lists)", "rl/rollouts.py"),
    "_get_train_sampler": ("trl GRPOTrainer (its RepeatSampler, re-sized for a TP group)", "objectives/grpo.py"),
    "_generate_and_score_completions": (
        "trl GRPOTrainer (its batch: the importance-sampling ratios' statistics read from it)",
        "objectives/grpo.py",
    ),
    "_last_loaded_step": ("trl GRPOTrainer (its vLLM weight-sync tag, set where it set no vLLM)", "objectives/grpo.py"),
    "_version": (
        "torch Tensor (its version counter: test_in_place_writes_bump_the_version)",
        "vllm_plugin/cpu_punica.py",
    ),
    "_load_adapter": ("vllm WorkerLoRAManager (tests/vllm)", "vllm_plugin/patch.py"),
    "_adapter_manager": ("vllm WorkerLoRAManager (tests/vllm)", "vllm_plugin/patch.py"),
}
# The package's own private attribute names (attributes of its classes, set and read by its own code).
OURS = {
    "_add",
    "_ratio_stats",  # objectives/grpo.py ServerSampled
    "_prompts",  # rl/lookahead.py PromptStream
    "_realign",
    "_unload",  # rl/rollouts.py ServerRollouts
    "_local_output",  # tp_runtime/layers.py: the base plus the adapters, shared by the TP layer classes
    "_transposed",  # peft_integration/experts.py: whether PEFT stored an expert's factors transposed
    "_samples",
    "_bdlora_tp",
    "_check_objective_keys",
    "_sampling",
    "_bd_target_name",
    "_bdlora",
    "_bdlora_name",
    "_bdlora_dp_group",
    # rl/diagnostics.py: GrpoDiagnostics' state on TRL's trainer, LearningGuard's two tests
    "_bdlora_guard",
    "_bdlora_kl",
    "_bdlora_logs_after_this_step",
    "_bdlora_norms",
    "_collapse",
    "_drift",
    "_mean",
    "_no_signal",
    "_bdlora_copied_output",
    "_bdlora_plan",
    "_held_out",
    "_model",
    "_restore",
    "_set_splits",
    "_slora",
    "_staging",
    "_test",
    "_train",
    "_validation",
}
# Internal (non-top-level) modules of other libraries whose public names the package imports, and where.
INTERNAL_MODULES = {
    "peft.utils.transformers_weight_conversion": "peft_integration/patterns.py (convert_peft_config_for_transformers)",
    "transformers.modeling_gguf_pytorch_utils": "models/embedded.py (its module-level `tqdm`, given disable=True)",
}


def _package_private_names() -> dict[str, set[str]]:
    """Every underscore name the package uses as an attribute, a method it defines in a class, or in an import path
    of another library -> the files using it; module-level names the package defines itself are left out."""
    own, used = set(), {}
    for path in (ROOT / "bdlora_train").rglob("*.py"):
        tree = ast.parse(path.read_text())
        own |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        own |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.ClassDef):
                names = [item.name for item in node.body if isinstance(item, ast.FunctionDef)]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("bdlora_train"):
                names = [*node.module.split("."), *(alias.name for alias in node.names)]
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    used.setdefault(name, set()).add(str(path.relative_to(ROOT / "bdlora_train")))
    return {name: files for name, files in used.items() if name not in own}


def test_every_private_name_the_package_uses_is_listed():
    known = set(PRIVATE) | OURS
    unlisted = {name: sorted(files) for name, files in _package_private_names().items() if name not in known}
    assert not unlisted, f"private names used but not in PRIVATE (with a check) or OURS: {unlisted}"
    stale = sorted(set(PRIVATE) - set(_package_private_names()))
    assert not stale, f"PRIVATE lists names the package no longer uses: {stale}"


def test_internal_modules_of_other_libraries_are_listed_and_peft_internals_stay_in_the_seam():
    """Only peft_integration/ imports from PEFT's submodules (the seam); other internal modules are listed above."""
    for path in (ROOT / "bdlora_train").rglob("*.py"):
        rel = str(path.relative_to(ROOT / "bdlora_train"))
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            for module in modules:
                if module.startswith("peft."):
                    assert rel.startswith("peft_integration/"), f"{rel} imports PEFT internals ({module})"
                if module in INTERNAL_MODULES:
                    assert rel in INTERNAL_MODULES[module], f"{rel} imports {module}, listed for another module"


def test_private_torch_and_peft_names_exist_as_used():
    """tp_diagnostics/ranks.py counts collectives with CommDebugMode's op tables and a TorchDispatchMode;
    tp_diagnostics/sharded_lora.py (ReplicatedExperts) swaps an experts module's `_parameters`; peft_integration reads
    ParamWrapper's `_did_swap_in_out_features` and the BD variant's private delta / weight helpers; the bitsandbytes
    layers set LoraLayer's `_active_adapter`."""
    import torch
    from peft.tuners.lora.layer import ParamWrapper
    from peft.tuners.lora.variants import BdLoraLinearVariant
    from peft.tuners.tuners_utils import BaseTunerLayer
    from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops
    from torch.utils._python_dispatch import TorchDispatchMode

    # ranks.py `comm_counter`: a TorchDispatchMode subclass, entered as a context manager, sees every aten op (on
    # CPU too) as an OpOverload whose `_overloadpacket` is what CommDebugMode's op tables hold for the collectives
    seen = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func._overloadpacket)
            return func(*args, **(kwargs or {}))

    a, b = torch.ones(2, 3), torch.ones(3, 2)
    with Recorder():
        product = a @ b
    assert torch.ops.aten.mm in seen and torch.equal(product, torch.full((2, 2), 3.0))
    assert torch.ops.aten.mm.default._overloadpacket is torch.ops.aten.mm
    collectives = set(NATIVE_TO_PY_MAPPING) | set(NATIVE_TO_PY_MAPPING.values()) | set(c10d_collective_ops)
    assert all(isinstance(op, torch._ops.OpOverloadPacket) for op in collectives)
    assert NATIVE_TO_PY_MAPPING[torch.ops._c10d_functional.all_reduce] == torch.ops.c10d_functional.all_reduce
    assert torch.ops.c10d.allreduce_ in c10d_collective_ops and not collectives & set(seen)
    assert isinstance(torch.ops.higher_order.cond, torch._ops.HigherOrderOperator)  # passed through uncounted
    # sharded_lora.py (ReplicatedExperts) swaps a parameter by assigning into `_parameters`: attribute access and
    # named_parameters follow
    layer = nn.Linear(2, 2)
    swapped = nn.Parameter(torch.zeros(2, 2), requires_grad=False)
    layer._parameters["weight"] = swapped
    assert layer.weight is swapped and dict(layer.named_parameters())["weight"] is swapped
    assert "_did_swap_in_out_features" in inspect.getsource(ParamWrapper)
    # its value is checked by test_block_diagonal_factor_is_packed_along_dim_0
    assert callable(BdLoraLinearVariant._get_bdlora_delta_weight)
    # peft_integration/quant_layers.py `dense_delta_weight`: the dense matrix of a packed factor, a plain Linear's
    # weight as is
    from peft.tuners.lora.variants import BlockDiagonalLinear

    packed = BlockDiagonalLinear(64, 4, nblocks=2, init_zero=False, dtype=torch.float32, device="cpu")
    assert tuple(packed.weight.shape) == (4, 32)
    dense = BdLoraLinearVariant._get_weight_from_module_maybe_blockdiagonal(packed)
    assert tuple(dense.shape) == (4, 64)
    assert torch.equal(dense[:2, :32], packed.weight[:2]) and torch.equal(dense[2:, 32:], packed.weight[2:])
    assert torch.all(dense[:2, 32:] == 0) and torch.all(dense[2:, :32] == 0)
    plain = nn.Linear(3, 2, bias=False)
    assert torch.equal(BdLoraLinearVariant._get_weight_from_module_maybe_blockdiagonal(plain), plain.weight)
    assert "_active_adapter" in BaseTunerLayer.__annotations__


def test_stdlib_private_names_exist_as_used():
    """core/helptext.py overrides argparse's `_get_help_string` (ArgumentDefaultsHelpFormatter's own hook); a rank
    whose launcher died leaves with `os._exit` (no atexit handlers, no flush of a process group that is gone)."""
    import argparse
    import os

    class Probe(argparse.HelpFormatter):
        def _get_help_string(self, action):
            return "probe-help"

    parser = argparse.ArgumentParser(formatter_class=Probe)
    parser.add_argument("--x", help="original")
    assert "probe-help" in parser.format_help()  # the hook is what argparse calls for every option's help
    assert callable(os._exit)


def test_tqdm_keeps_its_open_bars_where_own_line_reads_them():
    """core/boundary.py `own_line` reads tqdm's open bars from `tqdm._instances`: a bar is there while open and gone
    once closed, and the line starts after a newline only meanwhile."""
    import io

    from tqdm import tqdm

    from bdlora_train.core.boundary import own_line

    bar = tqdm(total=3, file=io.StringIO())
    assert bar in tqdm._instances and own_line("bdlora x: error: y") == "\nbdlora x: error: y"
    bar.close()
    assert bar not in tqdm._instances and own_line("bdlora x: error: y") == "bdlora x: error: y"
    quiet = tqdm(total=3, disable=True)  # a bar switched off (--quiet) draws nothing: no newline for it
    assert own_line("bdlora x: error: y") == "bdlora x: error: y"
    quiet.close()


def test_comm_counter_counts_no_collective_in_a_local_matmul():
    """ranks.py `comm_counter` (the mode tp-check and bench-tp count collectives with) runs ops through unchanged
    and counts only collectives."""
    from bdlora_train.tp_diagnostics.ranks import comm_counter

    with comm_counter() as comm:
        out = torch.ones(4, 8) @ torch.ones(8, 2)
    assert torch.equal(out, torch.full((4, 2), 8.0))
    assert comm.get_total_counts() == 0 and comm.get_comm_counts() == {} and comm.comm_bytes == 0


def test_peft_recognises_a_wrapped_experts_module_by_the_class_name_param_wrapper():
    """peft_integration/experts.py names its subclass `ParamWrapper` because PEFT nests a second parameter's wrapper
    only
    around a module whose class is *named* ParamWrapper (peft/tuners/tuners_utils.py)."""
    from peft.tuners.tuners_utils import BaseTuner

    from bdlora_train.peft_integration.experts import ParamWrapper

    assert '__class__.__name__ == "ParamWrapper"' in inspect.getsource(BaseTuner)
    assert ParamWrapper.__name__ == "ParamWrapper"


def test_peft_transformers_v5_conversion_the_toolkit_runs_before_injection():
    """peft_integration/patterns.py runs `convert_peft_config_for_transformers(config, model, None)` to refuse names
    PEFT
    would rewrite into expert target_parameters."""
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    assert list(inspect.signature(convert_peft_config_for_transformers).parameters)[:3] == [
        "peft_config",
        "model",
        "conversions",
    ]


def test_peft_bitsandbytes_layer_init_the_toolkit_repeats():
    """peft_integration/quant_layers.py repeats PEFT's bitsandbytes LoRA `__init__` except that it passes the module
    name
    on to `update_layer` (PEFT's drops it, and the BD variant assigns roles by it): the statements it repeats."""
    pytest.importorskip("bitsandbytes")
    from peft.tuners.lora import bnb

    for cls in (bnb.Linear8bitLt, bnb.Linear4bit):
        source = inspect.getsource(cls.__init__)
        for line in (
            "LoraLayer.__init__(self, base_layer)",
            "self.fan_in_fan_out = False",
            "self._active_adapter = adapter_name",
            "self.update_layer(",
        ):
            assert line in source, f"PEFT's {cls.__name__}.__init__ changed ({line!r}); update quant_layers.py"
        assert "target_name" not in source, f"PEFT's {cls.__name__} now passes target_name: drop our copy"


def test_transformers_quantizer_tag_the_toolkit_drops():
    """quant/quantized.py `drop_quantizer_tag`: transformers marks a model it loaded quantized with `is_quantized` and
    `hf_quantizer`, and Trainer's model check reads exactly those two (so a dequantized model must lose both)."""
    from transformers import trainer_utils

    source = inspect.getsource(trainer_utils)
    assert 'getattr(model, "is_quantized", False)' in source and 'getattr(model, "hf_quantizer", None)' in source


def test_lora_config_carries_use_bdlora_through_save_and_load(tmp_path):
    """peft_integration/config.py, peft_integration/patterns.py: PEFT stores roles as `use_bdlora` and reads them back
    (as a dict
    from JSON)."""
    from peft import BdLoraConfig, LoraConfig

    cfg = LoraConfig(
        r=4,
        target_modules=["q_proj"],
        use_bdlora=BdLoraConfig(target_modules_bd_a=["o"], target_modules_bd_b=["q"], nblocks=2, match_strict=True),
    )
    cfg.save_pretrained(str(tmp_path))
    back = LoraConfig.from_pretrained(str(tmp_path))
    bd = back.use_bdlora
    fields = bd if isinstance(bd, dict) else vars(bd)
    assert {k: fields[k] for k in ("target_modules_bd_a", "target_modules_bd_b", "nblocks", "match_strict")} == {
        "target_modules_bd_a": ["o"],
        "target_modules_bd_b": ["q"],
        "nblocks": 2,
        "match_strict": True,
    }


def _tiny():
    from bdlora_train.models import build_tiny_model

    return build_tiny_model("llama")


def _stock(bd_a, bd_b, nblocks=2, r=4, strict=True):
    from peft import BdLoraConfig, LoraConfig

    return LoraConfig(
        r=r,
        target_modules=["q_proj", "o_proj", "gate_proj", "up_proj"],
        use_bdlora=BdLoraConfig(
            target_modules_bd_a=bd_a, target_modules_bd_b=bd_b, nblocks=nblocks, match_strict=strict
        ),
    )


def test_block_diagonal_factor_is_packed_along_dim_0():
    """adapters/reader.py, peft_integration/layers.py, core/blocks.py: BD-B lora_B.weight is (d_out, r/N), BD-A
    lora_A.weight
    is (r, d_in/N),
    dense = block_diag(*weight.chunk(N, dim=0)); PEFT's delta weight is scaling * B_dense @ A_dense."""
    import peft
    from peft.tuners.lora.variants import BdLoraLinearVariant, BlockDiagonalLinear

    model = peft.get_peft_model(_tiny(), _stock(["o_proj"], ["q_proj", "gate_proj", "up_proj"]))
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    o = model.base_model.model.model.layers[0].self_attn.o_proj
    assert isinstance(q.lora_B["default"], BlockDiagonalLinear) and q.lora_B["default"].nblocks == 2
    assert tuple(q.lora_B["default"].weight.shape) == (q.out_features, 4 // 2)
    assert isinstance(o.lora_A["default"], BlockDiagonalLinear)
    assert tuple(o.lora_A["default"].weight.shape) == (4, o.in_features // 2)
    with torch.no_grad():
        q.lora_B["default"].weight.normal_()
    dense_b = torch.block_diag(*q.lora_B["default"].weight.chunk(2, dim=0))
    expected = q.scaling["default"] * dense_b @ q.lora_A["default"].weight
    assert torch.allclose(BdLoraLinearVariant._get_bdlora_delta_weight(q, "default"), expected, atol=1e-6)


def test_use_bdlora_patterns_match_as_substrings():
    """core/naming.py (`substring_role`): PEFT assigns roles by `pattern in module_name`, so "up_proj" also claims
    "gate_up_proj"."""
    import peft
    from peft.tuners.lora.variants import BlockDiagonalLinear

    model = peft.get_peft_model(_tiny(), _stock(["o_"], ["q", "gate", "up"]))  # fragments, not names or suffixes
    mlp = model.base_model.model.model.layers[0].mlp
    assert isinstance(mlp.gate_proj.lora_B["default"], BlockDiagonalLinear)
    with pytest.raises(ValueError, match="matches neither"):  # gate_proj matched by no pattern + match_strict
        peft.get_peft_model(_tiny(), _stock(["o_proj"], ["q_proj"]))


def test_custom_module_mapping_builds_our_layer_with_config_and_full_target_name():
    """peft_integration/config.py, peft_integration/layers.py: `LoraConfig._register_custom_module` (experimental API)
    dispatches
    nn.Linear to our
    class, and the variant's init receives the config and the *full* module name as `target_name`."""
    import peft
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    seen = []

    class Recording(PeftLoraLinear):
        def update_layer(self, adapter_name, *args, **kwargs):
            seen.append((kwargs.get("target_name"), type(kwargs.get("config")).__name__))
            return super().update_layer(adapter_name, *args, **kwargs)

    cfg = _stock(["o_proj"], ["q_proj", "gate_proj", "up_proj"])
    cfg._register_custom_module({nn.Linear: Recording})
    model = peft.get_peft_model(_tiny(), cfg)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is Recording
    assert ("model.layers.0.self_attn.q_proj", "LoraConfig") in seen
    # BlockDiagLoraLinear overrides it
    assert isinstance(inspect.getattr_static(PeftLoraLinear, "lora_variants"), property)
    assert ("use_bdlora",) in q_proj.lora_variants


def test_peft_helpers_the_toolkit_imports():
    """peft_integration/resolve.py: PEFT's own target matcher and pattern lookup."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    cfg = LoraConfig(target_modules=["q_proj"])
    assert check_target_module_exists(cfg, "model.layers.0.self_attn.q_proj")
    assert not check_target_module_exists(cfg, "model.layers.0.self_attn.qq_proj")
    assert get_pattern_key(["q_proj"], "model.layers.0.self_attn.q_proj") == "q_proj"
    params = inspect.signature(__import__("peft").PeftModel.from_pretrained).parameters
    assert "config" in params  # adapters.load_adapter passes a prepared BlockDiagLoraConfig


def test_what_tp_training_relies_on_in_transformers_trainer_and_peft():
    """trainer/mixins.py and tp_runtime/mesh.py, for a base loaded with `DistributedConfig`: Trainer hands accelerate a
    ParallelismConfig when the model says tp_size > 1 (accelerate refuses it for CPU process groups), refuses to
    checkpoint the optimizer of such a model unless `save_only_model`, and saves / loads through the private methods
    the toolkit's trainer overrides; accelerate's data loader reads the TP and data-parallel sizes from the state's
    device mesh by these dimension names; PEFT builds local-shape LoRA layers for a TP DTensor weight and adds TP
    hooks when the model has a TP plan (`global_adapter_shapes` turns both off)."""
    from accelerate import data_loader
    from peft.tuners import tuners_utils
    from peft.tuners.lora import model as lora_model
    from transformers import Trainer
    from transformers.distributed.mixin import DistributedMixin

    create = inspect.getsource(Trainer.create_accelerator_and_postprocess) + inspect.getsource(
        Trainer._build_accelerator_args
    )
    assert 'getattr(self.model, "tp_size", None)' in create and "ParallelismConfig(tp_size=" in create
    assert "save_only_model" in inspect.getsource(Trainer.__init__)
    for name, params in (
        ("_load_from_checkpoint", ["self", "resume_from_checkpoint", "model"]),
        ("_save_optimizer_and_scheduler", ["self", "output_dir"]),
        ("_load_optimizer_and_scheduler", ["self", "checkpoint"]),
        ("_save_rng_state", ["self", "output_dir"]),
        ("_track_num_input_tokens", ["self", "inputs"]),
    ):
        assert list(inspect.signature(getattr(Trainer, name)).parameters) == params, name
    # the TP override divides the increment by the TP degree: Trainer must add the sum over every process
    assert "self.state.num_input_tokens_seen += self.accelerator.gather(" in inspect.getsource(
        Trainer._track_num_input_tokens
    )
    assert "_internal_call" in inspect.signature(Trainer.save_model).parameters
    loader = inspect.getsource(data_loader.prepare_data_loader)
    assert all(f'"{dim}" in torch_device_mesh.mesh_dim_names' in loader for dim in ("tp", "dp_replicate", "dp_shard"))
    assert DistributedMixin._tp_plan is None and "return self._tp_plan" in inspect.getsource(DistributedMixin)
    assert "to_local().shape" in inspect.getsource(tuners_utils._get_in_out_features)
    assert 'getattr(model, "tp_plan", None)' in inspect.getsource(lora_model.get_tp_plan_and_mesh)


def test_a_gradient_wrapped_with_its_parameters_spec_is_the_dtensor_from_local_builds(tmp_path):
    """tp_runtime/node.py `_ShardedLinearFn.backward` wraps each factor's local gradient as `DTensor(grad, param._spec,
    requires_grad=False)` instead of `DTensor.from_local(...)`: the same DTensor (mesh, placements, global shape and
    stride), accepted by autograd as the DTensor parameter's gradient. One gloo rank in a subprocess."""
    import subprocess
    import sys

    code = f"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
dist.init_process_group("gloo", init_method="file://{tmp_path / "rendezvous"}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
param = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]))
local = torch.arange(24.0).view(6, 4)
ours = DTensor(local, param._spec, requires_grad=False)
theirs = DTensor.from_local(local, mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())
assert type(ours) is DTensor and ours.placements == theirs.placements and ours.device_mesh == theirs.device_mesh
assert ours.shape == theirs.shape and ours.stride() == theirs.stride() and ours.dtype == theirs.dtype
assert torch.equal(ours.full_tensor(), theirs.full_tensor())

class Wrapped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p):
        ctx.spec = p._spec
        return p.to_local().sum()

    @staticmethod
    def backward(ctx, grad):
        return DTensor(torch.full((6, 4), 2.0) * grad, ctx.spec, requires_grad=False)

Wrapped.apply(param).backward()
Wrapped.apply(param).backward()  # accumulates into the DTensor gradient
assert isinstance(param.grad, DTensor) and param.grad.placements == param.placements
assert torch.equal(param.grad.full_tensor(), torch.full((6, 4), 4.0))
dist.destroy_process_group()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_trainer_private_methods_used_for_atomic_checkpoints():
    """trainer/mixins.py overrides `_save_checkpoint(model, trial)` and `_get_output_dir(trial)`; the first must take
    the run directory from the second, and `rotate_checkpoints` must keep its keyword arguments."""
    from transformers import Trainer
    from transformers.trainer_utils import rotate_checkpoints

    assert list(inspect.signature(Trainer._save_checkpoint).parameters) == ["self", "model", "trial"]
    assert list(inspect.signature(Trainer._get_output_dir).parameters) == ["self", "trial"]
    assert "self._get_output_dir(trial=trial)" in inspect.getsource(Trainer._save_checkpoint)
    assert {"output_dir", "save_total_limit", "best_model_checkpoint", "use_mtime"} <= set(
        inspect.signature(rotate_checkpoints).parameters
    )


def test_transformers_tp_plan_and_collators():
    """arch/plans.py reads `base_model_tp_plan`; data/tokenize.py uses the flattening collator for packing."""
    from transformers import DataCollatorWithFlattening, LlamaConfig, TrainingArguments

    plan = LlamaConfig().base_model_tp_plan
    assert plan["layers.*.self_attn.q_proj"].startswith("colwise")
    assert plan["layers.*.mlp.down_proj"].startswith("rowwise")
    assert {"return_position_ids", "separator_id"} <= set(inspect.signature(DataCollatorWithFlattening).parameters)
    fields = TrainingArguments.__dataclass_fields__
    assert {"include_num_input_tokens_seen", "accelerator_config", "data_seed", "ddp_find_unused_parameters"} <= set(
        fields
    )


def test_transformers_expert_plan_entries_agree_with_the_served_roles():
    """arch/plans.py gives MoE expert factors their block-diagonal roles as vLLM serves the experts under TP
    (`EXPERTS_SERVED_BY_TP`: gate_up_proj packed column-wise, BD-B; down_proj row-wise, BD-A). transformers' plans
    said the same through 5.24 and dropped the entries in 5.25 (experts shard only through the EP plan); wherever the
    installed transformers still names them, for a family of that table, it must agree, or the roles and the base's
    TP split would disagree. Llama-4 keeps its own (transposed experts) and stays out of the table."""
    from transformers import CONFIG_MAPPING

    from bdlora_train.arch.plans import EXPERTS_SERVED_BY_TP

    assert "llama4_text" not in EXPERTS_SERVED_BY_TP
    missing = sorted(family for family in EXPERTS_SERVED_BY_TP if family not in CONFIG_MAPPING)
    assert not missing, f"transformers has no config for {missing}: drop them from EXPERTS_SERVED_BY_TP"
    for family, parent in EXPERTS_SERVED_BY_TP.items():
        plan = CONFIG_MAPPING[family].base_model_tp_plan or {}
        own = {k: v for k, v in plan.items() if k.startswith(f"layers.*.{parent}.experts.") and "proj" in k}
        assert own in ({}, {
            f"layers.*.{parent}.experts.gate_up_proj": "packed_colwise",
            f"layers.*.{parent}.experts.down_proj": "rowwise",
        }), f"{family}: transformers' plan splits the experts as {own}"  # fmt: skip


def test_from_pretrained_takes_use_kernels():
    """models/specs.py, models/embedded.py, quant/quantized.py and tp_diagnostics/train_step.py load bases with
    `use_kernels=False`: transformers' own modules, which the exactness comparisons and the TP runtime assume.
    transformers 5.25 made `from_pretrained` kernelize by default (`use_kernels` None -> True): on CUDA / ROCm / XPU,
    Hub kernels (RMSNorm, activations, RoPE) downloaded at load would replace them."""
    from transformers import PreTrainedModel

    source = inspect.getsource(PreTrainedModel.from_pretrained)
    assert 'kwargs.pop("use_kernels"' in source, "from_pretrained no longer reads use_kernels"


def test_importing_the_toolkit_patches_nothing():
    """The seam is explicit: importing bdlora_train leaves PEFT's and transformers' classes as they were."""
    import subprocess
    import sys

    code = (
        "import peft, peft.tuners.lora.model as m, peft.tuners.lora.layer as l, transformers\n"
        "classes = [('model', m.LoraModel), ('layer', l.Linear), ('cfg', peft.LoraConfig)]\n"
        "before = {k: dict(vars(c)) for k, c in classes}\n"
        "import bdlora_train, bdlora_train.train.run, bdlora_train.tp_diagnostics\n"
        "import bdlora_train.tp_runtime.dispatch, bdlora_train.tp_runtime.state\n"
        "import bdlora_train.serving.check, bdlora_train.cli\n"
        "after = {k: dict(vars(c)) for k, c in classes}\n"
        "keys = {k: set(before[k]) | set(after[k]) for k in before}\n"
        "changed = [f'{k}.{a}' for k in before for a in keys[k] if before[k].get(a) is not after[k].get(a)]\n"
        "assert not changed, changed\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_in_place_writes_bump_the_version():
    """vllm_plugin/cpu_punica.py remakes its side-by-side copy of a merged layer's A when a buffer's `_version`
    moves: vLLM loads an adapter into a slot by an in-place copy through a view of the stacked buffer (set_lora) and
    removes it by assigning zeros to the slot (reset_lora); both must bump the buffer's counter."""
    stacked = torch.zeros(4, 1, 8, 16)
    before = stacked._version
    stacked[1, 0, :2, :16].copy_(torch.ones(2, 16))
    assert stacked._version > before
    before = stacked._version
    stacked[2] = 0
    assert stacked._version > before


def test_module_hook_dicts_show_registered_hooks():
    """peft_integration/layers.py: the fused base-and-adapter node skips `base_layer.__call__`, so it is taken only when
    the base layer has no module hooks (DeepSpeed ZeRO-3 gathers weights in them); it reads these two dicts."""
    layer = nn.Linear(2, 2)
    assert not layer._forward_hooks and not layer._forward_pre_hooks
    pre = layer.register_forward_pre_hook(lambda m, a: None)
    post = layer.register_forward_hook(lambda m, a, o: None)
    assert layer._forward_pre_hooks and layer._forward_hooks
    pre.remove()
    post.remove()
    assert not layer._forward_hooks and not layer._forward_pre_hooks


def test_grpo_trainer_names_the_rollouts_use():
    """objectives/grpo.py and rl/rollouts.py: GRPOTrainer calls `self.rollout_func(prompts, self)` when it is set (the
    toolkit sets it after construction, the rollouts needing the trainer), tokenizes prompts with
    `_tokenize_prompts(prompts) -> (prompt_ids, images, multimodal_fields)`, and keeps per-logging-step metric lists
    in `_metrics[mode][name]` that `log` averages."""
    pytest.importorskip("trl")
    from trl import GRPOTrainer

    generate = inspect.getsource(GRPOTrainer._generate)
    assert "if self.rollout_func is not None:" in generate and "self.rollout_func(prompts, self)" in generate
    assert list(inspect.signature(GRPOTrainer._tokenize_prompts).parameters) == ["self", "prompts"]
    assert "return prompt_ids, images, multimodal_fields" in inspect.getsource(GRPOTrainer._tokenize_prompts)
    init, log = inspect.getsource(GRPOTrainer.__init__), inspect.getsource(GRPOTrainer.log)
    assert 'self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}' in init
    assert "self._metrics[mode].items()" in log
    # objectives/grpo.py DataReplicas: the train sampler is a RepeatSampler whose `batch_size` is the generation
    # batch's prompt count over every process, and the sampling seed is set per process at the end of __init__
    sampler = inspect.getsource(GRPOTrainer._get_train_sampler)
    assert "RepeatSampler(" in sampler
    assert "batch_size=self.args.generation_batch_size // self.num_generations" in sampler
    assert "set_seed(args.seed, device_specific=True)" in init
    # objectives/grpo.py ServerSampled: TRL's importance-sampling correction runs wherever `use_vllm` is set, with the
    # rollout function's log-probs as its sampling log-probs; before the rollout function it syncs vLLM's weights
    # through `vllm_generation` when `_last_loaded_step` is behind; its batch keeps the log-probs and the mask
    score = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "if self.use_vllm and self.vllm_importance_sampling_correction:" in score
    assert "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask" in score
    assert 'output["sampling_per_token_logps"] = sampling_per_token_logps' in score
    assert 'output["old_per_token_logps"] = old_per_token_logps' in score
    assert 'self._metrics[mode]["sampling/importance_sampling_ratio/min"]' in score
    assert "if self.use_vllm and self.state.global_step != self._last_loaded_step:" in generate
    assert "self.vllm_generation.sync_weights()" in generate
    loss = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]' in loss


def test_transformers_gguf_loader_draws_its_bar_with_the_module_level_tqdm():
    """models/embedded.py quiets the GGUF loader's bar (under `--quiet`) by replacing the loader module's `tqdm` for
    one load: it must still be the name `load_gguf_checkpoint` calls."""
    from transformers import modeling_gguf_pytorch_utils as gguf_loader

    source = inspect.getsource(gguf_loader.load_gguf_checkpoint)
    assert 'tqdm(reader.tensors, desc="Converting and de-quantizing GGUF tensors...")' in source
    assert callable(gguf_loader.tqdm)
