"""BD-LoRA on MoE expert parameters: PEFT's `ParamWrapper`, with each expert's factor kept block-diagonal.

transformers 5 stores a layer's experts as 3-D parameters (Mixtral `experts.gate_up_proj` (E, 2I, H) and
`experts.down_proj` (E, H, I)); PEFT adapts them with `ParamWrapper` (`LoraConfig.target_parameters`), one
(A_e, B_e) pair per expert, delta_e = scaling * B_e A_e folded into the parameter for the forward. Under TP
(transformers' `moe_tp_experts`) each rank holds the i-th 1/N of every expert along one dimension: gate_up packed
column-parallel (the i-th half of gate and of up: `packed_colwise`), down row-parallel. So the factor spanning
that dimension is block-diagonal per expert, segment-aware for gate|up, and rank i computes its slice of every
delta_e from its own blocks: no collective beyond the experts' own all-reduce.

PEFT's ParamWrapper accepts no LoRA variant (and so no `use_bdlora`), so the block structure is a mask: the
factors are PEFT's plain ones, the blocks outside the diagonal start at zero and, because every forward uses the
masked factor, never receive a gradient. The saved tensors are therefore exactly PEFT's format with explicit
zeros (peft_integration/storage.py), and stock PEFT computes the same deltas.
"""

from __future__ import annotations

from peft.tuners.lora.layer import ParamWrapper as PeftParamWrapper

from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.kernels.experts import expert_delta, expert_delta_factors
from bdlora_train.peft_integration.masked import apply_masks, masked_factors


class ParamWrapper(PeftParamWrapper):
    """PEFT's ParamWrapper with per-expert block-diagonal factors (masks from the resolved target).

    Named like PEFT's class on purpose: PEFT recognises an already-wrapped experts module (to nest the wrapper of
    its second parameter around the first) by the class name "ParamWrapper" (peft/tuners/tuners_utils.py).
    """

    def __init__(self, base_layer, adapter_name, parameter_name, config, r=0, lora_alpha=1, **kwargs):
        self._bd_target_name = kwargs.get("target_name")
        super().__init__(base_layer, adapter_name, parameter_name, config, r=r, lora_alpha=lora_alpha, **kwargs)

    def resolve_lora_variant(self, *, config, **kwargs):
        return None  # the block structure is the masks; PEFT's ParamWrapper takes no variant

    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
        target_name = kwargs.pop("target_name", None) or self._bd_target_name
        super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)
        resolved = getattr(config, "resolved", None) or {}
        target = resolved.get(target_name)
        if resolved and target is None:
            raise BlockDiagLoraConfigError(
                f"layers: {target_name}: an expert parameter the BlockDiagLoraConfig did not resolve"
            )
        if target is not None:
            apply_masks(self, adapter_name, target, config)

    def get_delta_factors(self, adapter_name):
        lhs, rhs = expert_delta_factors(*masked_factors(self, adapter_name), self.num_experts, self._transposed)
        param = self.get_param()
        return lhs.to(param.dtype), rhs.to(param.dtype), self.scaling[adapter_name]

    def get_delta_weight(self, adapter_name, *args, **kwargs):
        return expert_delta(*masked_factors(self, adapter_name), self.num_experts, self.scaling[adapter_name],
                            self._transposed, self.get_param().dtype)

    @property
    def _transposed(self) -> bool:
        """Whether the parameter is (E, in, out): PEFT swaps in/out features for (E, out, in) ones."""
        return not self._did_swap_in_out_features

