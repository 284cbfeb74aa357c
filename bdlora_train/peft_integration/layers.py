"""The toolkit's BD-LoRA layer: PEFT's modules and saved format, with the BD-LoRA kernel (kernels/bdlora.py) as its
forward and backward: a faster exact path, the PEFT glue around it.

`BlockDiagLoraLinear` is PEFT's `Linear` whose BD-LoRA adapters take the kernel: `FastBlockDiagLoraVariant` adds the
adapter into the base layer's output in place (`add_adapter_`), and a frozen dense base layer with its one adapter
runs as one autograd node (`one_node`). Here: which layers may take that node, the factors PEFT stores as the kernel
takes them, the init checks against the resolved TP plan.

The modules are PEFT's own (`lora_A` / `lora_B`, `BlockDiagonalLinear` with its packed weight), so state dicts
and `save_pretrained` output are byte-for-byte PEFT's format, and stock PEFT loads them.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from peft.tuners.lora.variants import BdLoraLinearVariant, BlockDiagonalLinear

from bdlora_train.arch.targets import DENSE
from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.core.roles import BD_A, BD_B, PLAIN, Role
from bdlora_train.kernels.bdlora import AdapterFactors, NodeInputs, add_adapter_, one_node, one_node_dtypes
from bdlora_train.peft_integration.masked import apply_masks, bd_a_bound, masked_factors, uniform_


def drops(module: PeftLoraLinear, adapter: str) -> bool:
    """Whether the adapter's dropout changes its input now (training, p > 0; not PEFT's Identity)."""
    dropout = module.lora_dropout[adapter]
    return isinstance(dropout, torch.nn.Dropout) and dropout.training and dropout.p > 0


def node_dropout(module: PeftLoraLinear, adapter: str) -> float | None:
    """The p the one-node layers draw themselves (`draw_dropout`): 0.0 when the dropout changes nothing, p for torch's
    own nn.Dropout with 0 < p < 1; None for anything else (a subclass, p = 1), which keeps the module's own forward."""
    if not drops(module, adapter):
        return 0.0
    dropout = module.lora_dropout[adapter]
    return float(dropout.p) if type(dropout) is torch.nn.Dropout and dropout.p < 1 else None


def adapter_role(module: PeftLoraLinear, adapter_name: str) -> tuple[Role, int]:
    """(role, nblocks) of one adapter in a LoRA layer, read from which factor PEFT made block-diagonal."""
    return _role(module.lora_A[adapter_name], module.lora_B[adapter_name])


def _role(lora_a: torch.nn.Module, lora_b: torch.nn.Module) -> tuple[Role, int]:
    if isinstance(lora_a, BlockDiagonalLinear):
        return BD_A, lora_a.nblocks
    if isinstance(lora_b, BlockDiagonalLinear):
        return BD_B, lora_b.nblocks
    return PLAIN, 1


def check_prepared(config, target: str) -> None:
    """A BlockDiagLoraConfig must have resolved its roles (prepare_bdlora_config) before any layer is built."""
    resolved = getattr(config, "resolved_roles", None)
    if resolved is not None and not resolved:  # a BlockDiagLoraConfig that never saw the model
        raise BlockDiagLoraConfigError(
            f"layers: {target}: BlockDiagLoraConfig has no roles yet; use "
            "bdlora_train.get_peft_model(model, config), "
            "or call bdlora_train.prepare_bdlora_config(model, config) before PEFT's get_peft_model / add_adapter"
        )


def finish_init(module: PeftLoraLinear, adapter_name: str, config, target: str) -> None:
    """After the block-diagonal factor is built: the role PEFT's substring patterns gave must be the one resolved from
    the TP plan; then the optional `bd_a_init="lora"` redraw."""
    # A target stored densely (segment-aware blocks, adapters with experts) is plain LoRA to PEFT, masked here.
    resolved_target = (getattr(config, "resolved", None) or {}).get(target)
    expected = (getattr(config, "resolved_roles", None) or {}).get(target)
    if resolved_target is not None and resolved_target.storage == DENSE:
        expected = PLAIN
    role, _ = adapter_role(module, adapter_name)
    if expected is not None and expected != role:
        raise BlockDiagLoraConfigError(
            f"layers: {target} resolved to role {expected} but PEFT's use_bdlora patterns "
            f"give {role}; set BlockDiagLoraConfig(roles={{...}}) explicitly for this module"
        )
    if role == BD_A and hasattr(config, "lora_a_init_"):
        config.lora_a_init_(module.lora_A[adapter_name].weight, module.in_features)
    if expected == PLAIN:
        apply_masks(module, adapter_name, resolved_target, config)


class FastBlockDiagLoraVariant(BdLoraLinearVariant):
    """PEFT's BD-LoRA variant with the fused in-place forward; init, merge and unmerge are PEFT's (BD-aware)."""

    @staticmethod
    def init(module: PeftLoraLinear, adapter_name: str, config, **kwargs) -> None:
        target = kwargs.get("target_name", "")
        check_prepared(config, target)
        weight = module.get_base_layer().weight
        if weight.dtype == torch.float32:
            BdLoraLinearVariant.init(module, adapter_name, config, **kwargs)
        else:
            # PEFT draws a block-diagonal A in the base layer's dtype (`BlockDiagonalLinear`); redrawn in float32
            # (masked.uniform_, at PEFT's scale: masked.bd_a_bound) on the stream PEFT's draw would have taken in
            # float32, PEFT's own draw made on a forked stream
            kind = weight.device.type
            forked = [] if kind in ("cpu", "meta") else [weight.device]
            with torch.random.fork_rng(devices=forked, device_type="cuda" if not forked else kind):
                BdLoraLinearVariant.init(module, adapter_name, config, **kwargs)
            role, nblocks = adapter_role(module, adapter_name)
            if role == BD_A:  # bd_a_init="lora" redraws it after (finish_init), as in float32
                uniform_(module.lora_A[adapter_name].weight, bd_a_bound(config, module.in_features, nblocks))
        finish_init(module, adapter_name, config, target)

    @staticmethod
    def forward(
        module: PeftLoraLinear, active_adapter: str, x: torch.Tensor, result: torch.Tensor, **kwargs
    ) -> torch.Tensor:
        if drops(module, active_adapter):
            x = module.lora_dropout[active_adapter](x)
        return add_adapter_(result, x, _factors(module, active_adapter))


def _factors(module: PeftLoraLinear, adapter: str) -> AdapterFactors:
    """The adapter's factors as the kernel takes them."""
    lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
    role, nblocks = _role(lora_a, lora_b)
    if role == PLAIN:  # a densely stored block-diagonal factor: its masks (none for plain LoRA)
        weight_a, weight_b = masked_factors(module, adapter)
        return AdapterFactors(weight_a, weight_b, module.scaling[adapter], nblocks, role)
    return AdapterFactors(lora_a.weight, lora_b.weight, module.scaling[adapter], nblocks, role)


def _plain_tensor(t) -> bool:
    return t is None or (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and type(t.data) is torch.Tensor


def _one_node(module: PeftLoraLinear, x, args, kwargs) -> NodeInputs | None:
    """The kernel's `one_node` inputs when the base layer and its one active adapter can run as one node (with
    gradients, `_BlockDiagLoraLinearFn`), else None.

    The common training and inference case: one BD-LoRA adapter, unmerged, on a plain `nn.Linear` (no hooks, no
    quantized or distributed tensors), frozen when gradients are wanted, dtypes `one_node_dtypes` takes (autocast and
    fp32 adapter weights on a bf16 base included), eager; dropout or not. Anything else takes PEFT's `Linear.forward`
    and the variant, unchanged. The arguments are gathered in the pass that checks them, so the base layer, its
    parameters and the dropout are looked up once: on decode-sized inputs this dispatch is a fifth of the layer's
    time (`nn.Module.__getattr__` costs about a microsecond a lookup on CPU)."""
    if args or kwargs or module.disable_adapters or module.merged or torch.compiler.is_compiling():
        return None
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) != 1 or not isinstance(module.lora_variant.get(active[0]), FastBlockDiagLoraVariant):
        return None
    adapter = active[0]
    base = module.base_layer
    if type(base) is not torch.nn.Linear or base._forward_hooks or base._forward_pre_hooks:
        return None
    weight, bias = base.weight, base.bias
    if torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad)):
        return None  # the node computes no gradient for the base layer
    if not (_plain_tensor(x) and _plain_tensor(weight) and _plain_tensor(bias)):
        return None
    dropout = node_dropout(module, adapter)
    stored = module.lora_A[adapter].weight, module.lora_B[adapter].weight  # as stored (before any masks)
    if dropout is None or not one_node_dtypes(x, weight, bias, *stored):
        return None
    factors = _factors(module, adapter)
    # as PEFT's Linear.forward: the input cast to the adapter's dtype, then dropout (the same mask)
    drop_dtype = factors.a.dtype if module.cast_input_dtype_enabled else x.dtype
    return NodeInputs(x, weight, bias, factors, dropout, drop_dtype)


class BlockDiagLoraLinear(PeftLoraLinear):
    """`peft.tuners.lora.Linear` whose BD-LoRA adapters take the fused path. Plain LoRA adapters stay PEFT's."""

    @property
    def lora_variants(self):
        return {**super().lora_variants, ("use_bdlora",): FastBlockDiagLoraVariant}

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """PEFT's, except that a dense base layer and its one BD-LoRA adapter run as one node: an autograd node in
        training; under no_grad (evaluation, generation) the same forward, so eval and training outputs are equal to
        the last bit."""
        node = _one_node(self, x, args, kwargs)
        if node is None:
            return super().forward(x, *args, **kwargs)
        return one_node(node)

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """BD-aware (PEFT's `Linear.get_delta_weight` multiplies the packed weights): scaling * B_dense @ A_dense."""
        if isinstance(self.lora_variant.get(adapter), BdLoraLinearVariant):
            weight = self.lora_B[adapter].weight
            delta = BdLoraLinearVariant._get_bdlora_delta_weight(self, adapter)
            return delta.to(weight.dtype)
        return super().get_delta_weight(adapter)

    def __repr__(self) -> str:
        return "bdlora." + super().__repr__()[len("lora.") :]


def block_diagonal_factors(model) -> list:
    """The trainable weight of every block-diagonal factor in `model`: PEFT's packed `BlockDiagonalLinear` weights and
    the densely stored, masked factors (segment-aware fused layers, expert parameters), nothing else."""
    found = {}
    for module in model.modules():
        if isinstance(module, BlockDiagonalLinear):
            found[id(module.weight)] = module.weight
        for buffer_name, _ in module.named_buffers(recurse=False):
            for label, factors in (("bdmask_A_", "lora_A"), ("bdmask_B_", "lora_B")):
                if buffer_name.startswith(label):
                    weight = getattr(module, factors)[buffer_name.removeprefix(label)].weight
                    found[id(weight)] = weight
    return [weight for weight in found.values() if weight.requires_grad]
