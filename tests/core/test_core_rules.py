"""The pure core's rules, each tested directly: core.naming, core.layout, core.dtypes, core.chatter."""

import logging
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from bdlora_train.core.chatter import QUIET_LOGGERS, quiet_library_chatter
from bdlora_train.core.dtypes import DTYPES, dtype_of
from bdlora_train.core.errors import BlockDiagLoraConfigError, BlockDiagLoraError
from bdlora_train.core.layout import (
    COLUMN,
    ROW,
    Layout,
    expert_axis,
    expert_dims,
    is_transposed,
    to_param_layout,
)
from bdlora_train.core.naming import (
    canonical,
    family_name,
    layer_kind,
    matches_any,
    matches_name,
    relative,
    substring_role,
    unwrap,
)
from bdlora_train.core.roles import BD_B

Q = "model.layers.0.self_attn.q_proj"

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------- core.naming


@pytest.mark.parametrize(
    "name, pattern, expected",
    [
        (Q, Q, True),  # the full name
        (Q, "q_proj", True),  # a dotted suffix
        (Q, "self_attn.q_proj", True),
        (Q, "proj", False),  # a substring that is not a dotted suffix
        (Q, "_proj", False),
        ("model.layers.0.self_attn.qq_proj", "q_proj", False),  # ends with the text, not with "." + text
        (Q, "layers.0", False),  # a prefix is no match
    ],
)
def test_matches_name_is_full_name_or_dotted_suffix(name, pattern, expected):
    assert matches_name(name, pattern) is expected


def test_matches_any_is_true_when_one_pattern_matches():
    assert matches_any(Q, ["v_proj", "q_proj"])
    assert not matches_any(Q, ["v_proj", "proj"])
    assert not matches_any(Q, [])


def test_substring_role_is_a_substring_test_so_up_proj_claims_gate_up_proj():
    fused = "model.layers.0.mlp.gate_up_proj"
    assert substring_role(fused, ["down_proj"], ["up_proj"]) == "bd_b"
    assert substring_role("model.layers.0.mlp.down_proj", ["down"], ["up"]) == "bd_a"
    assert substring_role(Q, ["o_proj"], ["k_proj"]) is None
    assert substring_role(Q, None, None) is None


def test_substring_role_refuses_a_name_both_role_patterns_claim():
    with pytest.raises(BlockDiagLoraConfigError) as info:
        substring_role("model.layers.0.mlp.gate_up_proj", ["gate"], ["up"])
    message = str(info.value)
    assert "\n" not in message
    assert "model.layers.0.mlp.gate_up_proj" in message and "disjoint" in message
    assert isinstance(info.value, BlockDiagLoraError)


def test_canonical_drops_every_base_layer_level():
    assert canonical("model.layers.0.self_attn.q_proj.base_layer") == Q
    assert canonical("a.experts.base_layer.base_layer.gate_up_proj") == "a.experts.gate_up_proj"
    assert canonical(Q) == Q


def test_relative_names_a_module_inside_the_prefix_only():
    assert relative(Q, "model") == "layers.0.self_attn.q_proj"
    assert relative(Q, "") == Q  # the model itself
    assert relative("modelx.layers.0", "model") is None  # a sibling whose name starts with the prefix text
    assert relative("model", "model") is None  # the prefix module itself is not inside it
    assert relative("lm_head", "model") is None


def test_layer_kind_replaces_every_index():
    assert layer_kind("layers.3.self_attn.q_proj") == "layers.*.self_attn.q_proj"
    assert layer_kind("layers.12.mlp.experts.7.w1") == "layers.*.mlp.experts.*.w1"
    assert layer_kind("lm_head") == "lm_head"


def test_family_name_maps_text_only_types_to_their_family():
    assert family_name("llama4_text") == "llama4"
    assert family_name("qwen2") == "qwen2"
    assert family_name(None) is None


def test_unwrap_returns_the_module_under_every_wrapper():
    inner = nn.Linear(2, 2)

    class Wrapper(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base

        def get_base_layer(self):
            return self.base

    class SelfBase(nn.Linear):  # get_base_layer returning itself (PEFT's layers on an unwrapped base): stop there
        def get_base_layer(self):
            return self

    assert unwrap(Wrapper(Wrapper(inner))) is inner
    assert unwrap(inner) is inner
    lone = SelfBase(2, 2)
    assert unwrap(lone) is lone


def test_unwrap_of_a_peft_layer_is_its_linear():
    from peft import LoraConfig, get_peft_model

    from bdlora_train.models import build_tiny_model

    model = get_peft_model(build_tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    base = unwrap(q)
    assert base is not q and hasattr(q, "lora_A")  # q is PEFT's wrapper, base the tiny Llama's 64 -> 64 Linear
    assert type(base) is nn.Linear and (base.in_features, base.out_features) == (64, 64)


# ------------------------------------------------------------------------------------------------- core.layout


def test_layout_properties():
    contiguous = Layout("q", "colwise", BD_B, (64,), d_in=64, d_out=64)
    fused = Layout("qkv", "colwise_gather_output", BD_B, (64, 32, 32), d_in=64, d_out=128)
    expert = Layout("e.gate_up_proj", "packed_colwise", BD_B, (64, 64), d_in=64, d_out=128, experts=4)
    assert (contiguous.kind, contiguous.fused, contiguous.split) == ("linear", False, 64)
    assert (fused.kind, fused.fused, fused.split) == ("linear", True, 128)
    assert (expert.kind, expert.fused, expert.split) == ("expert", True, 128)
    assert ROW == "row" and COLUMN == "column"


def test_is_transposed_reads_the_experts_module_flag():
    class Experts(nn.Module):
        is_transposed = True

    assert is_transposed(Experts()) is True
    assert is_transposed(nn.Linear(2, 2)) is False


def test_expert_dims_follow_peft_param_wrapper():
    # (E, d1, d2) = (4, 128, 64): PEFT reads (E, out, in) unless transposed, then (E, in, out)
    assert expert_dims((4, 128, 64), transposed=False) == (4, 64, 128)
    assert expert_dims((4, 128, 64), transposed=True) == (4, 128, 64)


def test_to_param_layout_transposes_per_expert_only_when_the_module_is_transposed():
    delta = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5)  # (E, d_out, d_in)
    assert to_param_layout(delta, transposed=False) is delta
    moved = to_param_layout(delta, transposed=True)
    assert moved.shape == (2, 5, 3)
    assert moved[1, 4, 2] == delta[1, 2, 4] == 1 * 15 + 2 * 5 + 4


@pytest.mark.parametrize(
    "factor, transposed, axis",
    [("B", False, 1), ("A", False, 2), ("B", True, 2), ("A", True, 1)],
)
def test_expert_axis(factor, transposed, axis):
    assert expert_axis(factor, transposed) == axis


# ------------------------------------------------------------------------------------------------- core.dtypes


def test_dtype_of_each_name():
    assert DTYPES == ("float32", "bfloat16", "float16", "float64")
    assert dtype_of("float32") is torch.float32
    assert dtype_of("float64") is torch.float64
    assert dtype_of("bfloat16") is torch.bfloat16
    assert dtype_of("float16") is torch.float16
    with pytest.raises(KeyError):  # recipes check the choices first (Recipe.torch_dtype)
        dtype_of("fp16")


# ------------------------------------------------------------------------------------------------ core.chatter


@pytest.fixture
def restored_loggers():
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_quiet_library_chatter_silences_the_listed_loggers(restored_loggers):
    assert set(QUIET_LOGGERS) == {"torchao", "torch.utils._pytree", "bitsandbytes"}
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)
    quiet_library_chatter()
    for name in QUIET_LOGGERS:
        assert logging.getLogger(name).level == logging.ERROR, name
        assert not logging.getLogger(name).isEnabledFor(logging.WARNING)


def test_quiet_library_chatter_filters_only_the_named_warnings(restored_loggers):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_library_chatter()
        warnings.warn("`foo` is deprecated and will be removed in v6", FutureWarning)
        warnings.warn("`torch.distributed.all_reduce_coalesced` is deprecated", FutureWarning)
        warnings.warn("FSDP2-wrapped module norm returned a view tensor", UserWarning)
        warnings.warn("this setting is deprecated and will be removed in v7", FutureWarning)  # not ours to hide
        warnings.warn("a user warning the toolkit must keep", UserWarning)
    texts = [str(w.message) for w in caught]
    assert texts == ["this setting is deprecated and will be removed in v7", "a user warning the toolkit must keep"]


def _logged(name: str, message: str, *args) -> list[str]:
    """What `logging.getLogger(name).warning(message, *args)` shows (after the import-chatter filter)."""
    shown = []

    class Keep(logging.Handler):
        def emit(self, record):
            shown.append(record.getMessage())

    logger = logging.getLogger(name)
    handler, propagate, level = Keep(), logger.propagate, logger.level
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.WARNING)  # as a user's process has it (a CLI run before this test raised it to ERROR)
    try:
        logger.warning(message, *args)
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        logger.setLevel(level)
    return shown


def test_the_import_chatter_filter_drops_only_the_named_lines():
    """`import bdlora_train` installs it: torchao's .so failures and torch's notes on torchao's enums go, every other
    line of the same loggers (a user's own enum, another torchao warning) stays."""
    import enum

    from bdlora_train.core.chatter import filter_library_chatter

    filter_library_chatter()
    filter_library_chatter()  # idempotent
    assert logging.getLogger("torchao").filters.count(logging.getLogger("torchao").filters[0]) == 1
    so = "Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load"
    assert _logged("torchao", so) == []
    assert _logged("torchao", "Int8WeightOnlyConfig is deprecated") == ["Int8WeightOnlyConfig is deprecated"]
    note = "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type."
    torchao_enum = enum.Enum("KernelPreference", "AUTO")
    torchao_enum.__module__ = "torchao.quantization.quantize_.common.kernel_preference"
    users_enum = enum.Enum("Mine", "A")
    assert _logged("torch.utils._pytree", note, torchao_enum) == []
    assert _logged("torch.utils._pytree", note, users_enum) == [
        "<enum 'Mine'> is an Enum subclass and is now natively supported by torch.compile as an opaque value type."
    ]
    hint = "Failed to load CPU gemm_4bit_forward from kernels-community: no module. Please make sure ..."
    assert _logged("bitsandbytes.backends.cpu.ops", hint) == []


def test_deepspeeds_cpu_line_goes_only_where_torch_has_no_cuda(monkeypatch):
    import torch

    from bdlora_train.core.chatter import filter_library_chatter

    filter_library_chatter()
    line = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _logged("DeepSpeed", line) == []
    assert _logged("DeepSpeed", "Setting ds_accelerator to cpu (auto detect)") == [
        "Setting ds_accelerator to cpu (auto detect)"
    ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU DeepSpeed did not find: the line matters
    assert _logged("DeepSpeed", line) == [line]
    # vLLM's CPU build at import (TRL imports it in the vLLM environment); its other lines stay
    triton = "Triton is installed, but doesn't include CPU backend. Disabling Triton."
    assert _logged("vllm.triton_utils.importing", triton) == []
    assert _logged("vllm.triton_utils.importing", "Triton not installed") == ["Triton not installed"]


def _warned(message: str, category, module: str) -> list[str]:
    """What `warnings.warn_explicit` from `module` shows once the library-chatter filters are in place."""
    from bdlora_train.core.chatter import filter_library_chatter

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_library_chatter()
        warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 1, module=module)
    return [str(w.message) for w in caught]


def test_the_warnings_peft_and_trl_raise_on_every_run_are_dropped_only_from_their_module():
    save = "Could not find a config file in tiny:llama - will assume that the vocabulary was not modified."
    assert _warned(save, UserWarning, "peft.utils.save_and_load") == []
    assert _warned(save.replace("tiny:llama", "tiny:qwen3_moe"), UserWarning, "peft.utils.save_and_load") == []
    hub = save.replace("tiny:llama", "meta-llama/Llama-3.1-8B")  # a Hub id offline: PEFT's note stays
    assert _warned(hub, UserWarning, "peft.utils.save_and_load") == [hub]
    assert _warned(save, UserWarning, "my_script") == [save]
    deprecated = (
        "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_checkpointing`"
    )
    assert _warned(deprecated, FutureWarning, "transformers.modeling_utils") == []
    other = "`foo` is deprecated and will be removed in v6"
    assert _warned(other, FutureWarning, "transformers.modeling_utils") == [other]
    trl = ("TRL currently supports vLLM versions from 0.22.0 to 0.31.0. You have version 0.32.0 installed. We "
           "recommend installing a supported version to avoid compatibility issues.")
    assert _warned(trl, UserWarning, "trl.import_utils") == [] and _warned(trl, UserWarning, "trl") == []
    assert _warned(trl, UserWarning, "vllm_checks") == [trl]


def test_the_startup_filter_is_one_line_that_loads_the_filter_without_the_package(tmp_path):
    """`make install` writes it into the environment's site-packages (install_startup_filter); Python runs it at
    startup. Run here alone (`python -S`: no site-packages, so not the environment's own copy) through
    site.addsitedir, as Python's startup runs it: the filter is in place and no module of the package is imported (a
    stock-PEFT process stays free of the toolkit); with no toolkit to find, it does nothing."""
    import subprocess
    import sys

    from bdlora_train.core.chatter import STARTUP_PTH, install_startup_filter

    (tmp_path / "site").mkdir()  # a directory of its own: the .pth is the only file there
    path = install_startup_filter(tmp_path / "site")
    assert path == tmp_path / "site" / STARTUP_PTH and len(path.read_text().splitlines()) == 1
    code = (
        "import logging, site, sys\n"
        "site.addsitedir(sys.argv[1])\n"
        "print(len(logging.getLogger('torchao').filters), len(logging.getLogger('DeepSpeed').filters),"
        " sorted(m for m in sys.modules if m.startswith('bdlora_train')))\n"
    )
    for cwd, expected in ((ROOT, "1 1 []"), (tmp_path, "0 0 []")):  # the package importable from cwd, or not at all
        done = subprocess.run(
            [sys.executable, "-S", "-c", code, str(path.parent)], capture_output=True, text=True, timeout=60, cwd=cwd
        )
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert done.stdout.strip() == expected, cwd


def test_help_defaults_are_spelled_as_the_user_types_them():
    from bdlora_train.core.helptext import spell

    assert [spell(v) for v in (None, True, False, [16, 256, 2048], [], "runs/compare", 0.5)] == [
        "null",
        "true",
        "false",
        "16 256 2048",
        "none",
        "runs/compare",
        "0.5",
    ]


def test_the_launcher_environment_is_read_in_one_module(monkeypatch):
    """RANK / LOCAL_RANK / WORLD_SIZE: what core/launch_env.py reads, and no other module of the package names them."""
    import ast
    from pathlib import Path

    from bdlora_train.core import launch_env

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert (launch_env.rank(), launch_env.local_rank(), launch_env.world_size()) == (0, None, 1)
    assert launch_env.is_main_process() and launch_env.launched_world_size() is None
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (launch_env.rank(), launch_env.local_rank(), launch_env.world_size()) == (3, 1, 4)
    assert not launch_env.is_main_process()
    monkeypatch.setenv("WORLD_SIZE", "")  # set but empty: no launcher's number
    assert launch_env.launched_world_size() is None and launch_env.world_size() == 1
    package = Path(launch_env.__file__).parents[1]
    readers = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    )
    assert set(readers) == {"core/launch_env.py"}, readers
