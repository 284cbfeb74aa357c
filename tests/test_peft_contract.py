"""What bdlora-train relies on in PEFT and transformers, in one file: run it first after upgrading either.

Every assertion here is a fact some toolkit module depends on (named in each test). When one fails, fix that
module, then move the upper bound in pyproject.toml (`peft<…`, `transformers<…`) to the version that passes.
"""

import inspect

import pytest
import torch
from torch import nn


def test_lora_config_carries_use_bdlora_through_save_and_load(tmp_path):
    """config.py / patterns.py: PEFT stores roles as `use_bdlora` and reads them back (as a dict from JSON)."""
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
    """adapters.py / layers.py / export.py: BD-B lora_B.weight is (d_out, r/N), BD-A lora_A.weight is (r, d_in/N),
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
    """patterns.py: PEFT assigns roles by `pattern in module_name`, so "up_proj" also claims "gate_up_proj"."""
    import peft
    from peft.tuners.lora.variants import BlockDiagonalLinear

    model = peft.get_peft_model(_tiny(), _stock(["o_"], ["q", "gate", "up"]))  # fragments, not names or suffixes
    mlp = model.base_model.model.model.layers[0].mlp
    assert isinstance(mlp.gate_proj.lora_B["default"], BlockDiagonalLinear)
    with pytest.raises(ValueError, match="matches neither"):  # gate_proj matched by no pattern + match_strict
        peft.get_peft_model(_tiny(), _stock(["o_proj"], ["q_proj"]))


def test_custom_module_mapping_builds_our_layer_with_config_and_full_target_name():
    """config.py / layers.py: `LoraConfig._register_custom_module` (experimental API) dispatches nn.Linear to our
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
    assert isinstance(inspect.getattr_static(PeftLoraLinear, "lora_variants"), property)  # BdLoraLinear overrides it
    assert ("use_bdlora",) in q_proj.lora_variants


def test_peft_helpers_the_toolkit_imports():
    """roles.py / budget.py: PEFT's own target matcher and pattern lookup."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.other import get_pattern_key

    cfg = LoraConfig(target_modules=["q_proj"])
    assert check_target_module_exists(cfg, "model.layers.0.self_attn.q_proj")
    assert not check_target_module_exists(cfg, "model.layers.0.self_attn.qq_proj")
    assert get_pattern_key(["q_proj"], "model.layers.0.self_attn.q_proj") == "q_proj"
    params = inspect.signature(__import__("peft").PeftModel.from_pretrained).parameters
    assert "config" in params  # adapters.load_adapter passes a prepared BlockDiagLoraConfig


def test_trainer_private_methods_used_for_atomic_checkpoints():
    """train/trainer.py overrides `_save_checkpoint(model, trial)` and `_get_output_dir(trial)`; the first must take
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
    """roles.py reads `base_model_tp_plan`; train/data.py uses the flattening collator for packing."""
    from transformers import DataCollatorWithFlattening, LlamaConfig, TrainingArguments

    plan = LlamaConfig().base_model_tp_plan
    assert plan["layers.*.self_attn.q_proj"].startswith("colwise")
    assert plan["layers.*.mlp.down_proj"].startswith("rowwise")
    assert {"return_position_ids", "separator_id"} <= set(inspect.signature(DataCollatorWithFlattening).parameters)
    fields = TrainingArguments.__dataclass_fields__
    assert {"include_num_input_tokens_seen", "accelerator_config", "data_seed", "ddp_find_unused_parameters"} <= set(
        fields
    )


def test_importing_the_toolkit_patches_nothing():
    """The seam is explicit: importing bdlora_train leaves PEFT's and transformers' classes as they were."""
    import subprocess
    import sys

    code = (
        "import peft, peft.tuners.lora.model as m, peft.tuners.lora.layer as l, transformers\n"
        "classes = [('model', m.LoraModel), ('layer', l.Linear), ('cfg', peft.LoraConfig)]\n"
        "before = {k: dict(vars(c)) for k, c in classes}\n"
        "import bdlora_train, bdlora_train.train, bdlora_train.tp, bdlora_train.serving, bdlora_train.cli\n"
        "after = {k: dict(vars(c)) for k, c in classes}\n"
        "keys = {k: set(before[k]) | set(after[k]) for k in before}\n"
        "changed = [f'{k}.{a}' for k in before for a in keys[k] if before[k].get(a) is not after[k].get(a)]\n"
        "assert not changed, changed\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
