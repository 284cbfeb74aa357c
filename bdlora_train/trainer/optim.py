"""Per-factor learning rates: `bd_lr_ratio` for the block-diagonal factor of BD-LoRA, `loraplus_lr_ratio` (LoRA+)
for LoRA's B factor. The rule that derives `bd_lr_ratio: auto` lives here (`resolve_bd_lr_ratio`).

Why a block-diagonal factor needs its own rate. Adam moves every weight by about the learning rate whatever its
gradient's scale, and a step's weight changes line up with the gradient, so the change they cause in one output
adds up over the weights summed into it: it is proportional to the factor's fan-in. That is the rule muP gives
for Adam (learning rate ∝ 1/fan-in; Yang et al. 2022, arXiv 2203.03466) and the one LoRA+ applies to LoRA's two
factors (Hayou et al. 2024, arXiv 2402.12354). A block-diagonal factor with N blocks has 1/N of the fan-in of the
same factor of dense LoRA at the same rank r:

- BD-B (column-parallel q, k, v, gate, up): each output of block i sums the r/N rank components of block i, not r;
- BD-A (row-parallel o, down): each rank component reads the d_in/N inputs of its block, not d_in;
- a fused projection (segment-aware blocks) and an expert (per-expert blocks) are block-diagonal the same way.

So at one learning rate the block-diagonal factor moves the output N times less than its dense counterpart, and
`bd_lr_ratio: auto` is N = nblocks for every block-diagonal factor. What else could enter, and why it does not:

- the adapter scale (alpha / r, or alpha / sqrt(r) with rsLoRA) multiplies the whole update of LoRA and BD-LoRA
  alike at the same rank: it moves no factor relative to the other, so the ratio does not depend on use_rslora;
- the block-diagonal factor's own init does not change the size of an Adam step; the gain its step acts through is
  the other factor: BD-B's dense A (the same init as LoRA's A) and BD-A's B (zero at init, as in LoRA). The larger
  init of PEFT's block-diagonal A (kaiming over d_in/N) speeds up the *dense* B of BD-A layers instead, by a constant
  sqrt(6) not a function of N; the ratio leaves that factor alone (docs/compare.md measures both);
- a quantized base (QLoRA) changes the frozen weight, not the adapter's factors.

Why LoRA+ is LoRA's own knob. LoRA+ multiplies the rate of every `lora_B`. On a BD method the B of BD-B layers IS
the block-diagonal factor that `bd_lr_ratio` scales, so both on one adapter would multiply on that weight; a BD method
refuses `loraplus_lr_ratio` (and LoRA refuses `bd_lr_ratio`, methods.check_method_keys), and `bdlora compare` grids
each ratio for the methods that read it. PEFT's `peft.optimizers.create_loraplus_optimizer` builds the optimizer
object itself (outside the Trainer's `optimizer_cls_and_kwargs` route used here for both ratios) and resets weight
decay to its own `loraplus_weight_decay`; the groups below use its definition of the B group (`lora_B` in the name).
The scheduler scales every group alike, so a ratio holds for the whole run.

Outside `bdlora train` (TRL's SFTTrainer / DPOTrainer, any Trainer subclass, a loop of one's own), the public
`bdlora_optimizer(model, args)` and `bdlora_param_groups(model, learning_rate)` build the same groups
(docs/training.md, "With TRL").
"""

from __future__ import annotations

from bdlora_train.core.errors import BlockDiagLoraConfigError, RecipeError

AUTO = "auto"


def resolve_bd_lr_ratio(value: float | str, nblocks: int) -> float:
    """The block-diagonal factor's learning-rate multiplier: `value`, or for "auto" the fan-in of the dense factor
    over that of the block-diagonal one, which is nblocks for every block-diagonal factor (module docstring)."""
    if value == AUTO:
        return float(nblocks)
    if isinstance(value, str):
        raise RecipeError(f"recipe: bd_lr_ratio={value!r}; use auto (= nblocks) or a number > 0")
    return float(value)


def lr_multipliers(model, bd_lr_ratio: float, loraplus_lr_ratio: float) -> dict[int, float]:
    """{id(param): multiplier of learning_rate} for every trainable parameter: `bd_lr_ratio` for a block-diagonal
    factor (packed or masked, peft_integration.layers.block_diagonal_factors), `loraplus_lr_ratio` for any other
    `lora_B`,
    1 for the rest. check_method_keys keeps at least one of the two ratios at 1, so no weight gets both."""
    if bd_lr_ratio != 1.0 and loraplus_lr_ratio != 1.0:
        raise RecipeError(
            f"recipe: bd_lr_ratio={bd_lr_ratio:g} and loraplus_lr_ratio={loraplus_lr_ratio:g} would both scale the "
            "block-diagonal lora_B of column-parallel layers; set one of them to 1"
        )
    from bdlora_train.peft_integration.layers import (
        block_diagonal_factors,  # imports PEFT: not on `train --help`'s path
    )

    bd = {id(p) for p in block_diagonal_factors(model)} if bd_lr_ratio != 1.0 else set()
    if bd_lr_ratio != 1.0 and not bd:
        raise RecipeError(f"recipe: bd_lr_ratio={bd_lr_ratio:g} but the adapter has no block-diagonal factor; drop it")
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[id(p)] = bd_lr_ratio if id(p) in bd else loraplus_lr_ratio if "lora_B" in name else 1.0
    return out


def param_groups(model, learning_rate: float, weight_decay: float, decay_names, multipliers: dict) -> list[dict]:
    """Optimizer param groups: one per (multiplier, in weight decay) pair, lr = multiplier x learning_rate."""
    decay = set(decay_names)
    groups: dict[tuple[float, bool], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault((multipliers[id(p)], name in decay), []).append(p)
    return [
        {"params": ps, "weight_decay": weight_decay if in_decay else 0.0, "lr": learning_rate * multiplier}
        for (multiplier, in_decay), ps in sorted(groups.items())
    ]


def check_optimizer_route(trainer, key: str) -> None:
    """The param groups reach the optimizer only where the Trainer builds it from its own `model` before wrapping
    it: refuse the two launch modes where they would be dropped without a word — a DeepSpeed config with its own
    `optimizer` section (DeepSpeed builds that one from every parameter at one rate) and FSDP1 (the Trainer builds
    the optimizer after wrapping, from parameters the groups do not hold); FSDP2 and DeepSpeed without an
    optimizer section take them."""
    ds = getattr(trainer.args, "hf_deepspeed_config", None)
    if trainer.is_deepspeed_enabled and ds is not None and "optimizer" in ds.config:
        raise RecipeError(
            f"recipe: {key} needs the Trainer's optimizer, but the DeepSpeed config defines its own 'optimizer' "
            f"(one rate for every parameter); remove that section or set {key}=1"
        )
    if trainer.is_fsdp_enabled and getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1) != 2:
        raise RecipeError(
            f"recipe: {key} needs FSDP2 (fsdp_config version: 2): FSDP1 builds the optimizer after wrapping the "
            f"model, without the learning-rate groups; use version 2 or set {key}=1"
        )


def apply_lr_ratios(trainer, bd_lr_ratio: float, loraplus: float) -> None:
    """Give `trainer` an optimizer whose block-diagonal factors train at `bd_lr_ratio` x `learning_rate` and whose
    other lora_B factors at `loraplus` x (both resolved numbers: the run's plan, train/run_plan.py `lr_ratios`); a no-op
    when both are 1 (the Trainer builds its own optimizer then). Same optimizer class, kwargs and weight-decay split
    as the Trainer's."""
    if bd_lr_ratio == 1.0 and loraplus == 1.0:
        return
    model, key = trainer.model, "bd_lr_ratio" if bd_lr_ratio != 1.0 else "loraplus_lr_ratio"
    multipliers = lr_multipliers(model, bd_lr_ratio, loraplus)
    check_optimizer_route(trainer, key)
    args = trainer.args  # the recipe's optim, learning_rate and weight_decay (training_args.py training_arguments)
    cls, kwargs = trainer.get_optimizer_cls_and_kwargs(args, model)
    if "params" in kwargs or "model" in kwargs or "optimizer_dict" in kwargs:
        optim = getattr(args.optim, "value", args.optim)  # transformers' OptimizerNames
        raise RecipeError(f"recipe: {key} cannot be combined with optim={optim}; use adamw_torch or set {key}=1")
    decay = trainer.get_decay_parameter_names(model)
    params = param_groups(model, args.learning_rate, args.weight_decay, decay, multipliers)
    trainer.optimizer_cls_and_kwargs = (cls, {**kwargs, "params": params})


def adapter_nblocks(model) -> int:
    """nblocks of the active adapter of a PEFT model: a `BlockDiagLoraConfig`'s, or a stock `LoraConfig`'s
    `use_bdlora` block; refused for a model without a BD-LoRA adapter (bd_lr_ratio has nothing to scale there)."""
    from bdlora_train.peft_integration.config import BlockDiagLoraConfig
    from bdlora_train.peft_integration.patterns import bdlora_nblocks

    configs = getattr(model, "peft_config", None)
    active = getattr(model, "active_adapter", None)
    if not isinstance(configs, dict) or not isinstance(active, str) or active not in configs:
        raise BlockDiagLoraConfigError(
            f"bdlora_param_groups: got a {type(model).__name__}, not a PEFT model with one active adapter; pass the "
            "model bdlora_train.get_peft_model returned"
        )
    config = configs[active]
    if isinstance(config, BlockDiagLoraConfig):
        return config.nblocks
    if getattr(config, "use_bdlora", None) is None:
        raise BlockDiagLoraConfigError(
            f"bdlora_param_groups: adapter {active!r} is plain LoRA (no use_bdlora), it has no block-diagonal factor; "
            "use the Trainer's own optimizer"
        )
    return bdlora_nblocks(config.use_bdlora)


def bdlora_param_groups(
    model, learning_rate: float, weight_decay: float = 0.0, bd_lr_ratio: float | str = AUTO
) -> list[dict]:
    """Param groups for any torch optimizer that train every block-diagonal factor of `model` (a PEFT model with a
    BD-LoRA adapter) at `bd_lr_ratio` x `learning_rate` ("auto": nblocks, the default of `bdlora train`) and every
    other trainable parameter at `learning_rate`; `weight_decay` on the parameters transformers' Trainer decays
    (not biases or norms), 0 on the rest. `torch.optim.AdamW(bdlora_param_groups(model, 2e-4))`."""
    from transformers import Trainer

    ratio = resolve_bd_lr_ratio(bd_lr_ratio, adapter_nblocks(model))
    if not ratio > 0:
        raise BlockDiagLoraConfigError(f"bdlora_param_groups: bd_lr_ratio={bd_lr_ratio!r}; use auto (= nblocks) or > 0")
    multipliers = lr_multipliers(model, ratio, 1.0)
    # the Trainer's own weight-decay rule (an instance method that reads nothing of the instance)
    decay = Trainer.get_decay_parameter_names(None, model)
    return param_groups(model, learning_rate, weight_decay, decay, multipliers)


def bdlora_optimizer(model, args, bd_lr_ratio: float | str = AUTO):
    """The optimizer transformers' Trainer would build from `args` (a `TrainingArguments`, e.g. TRL's `SFTConfig` /
    `DPOConfig`: its `optim` class, betas, eps, `learning_rate`, `weight_decay`), with `bdlora_param_groups`: the
    block-diagonal factors at `bd_lr_ratio` x `args.learning_rate` ("auto": nblocks). For any Trainer subclass:
    `SFTTrainer(model=model, args=args, ..., optimizers=(bdlora_optimizer(model, args), None))`; the Trainer builds
    its scheduler from `args` on top of it. Not under FSDP (the Trainer refuses a given optimizer there)."""
    from transformers import Trainer

    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    if "params" in kwargs or "model" in kwargs or "optimizer_dict" in kwargs:
        raise BlockDiagLoraConfigError(
            f"bdlora_optimizer: optim={args.optim} builds its own parameter groups; use adamw_torch (the default)"
        )
    return cls(bdlora_param_groups(model, args.learning_rate, args.weight_decay, bd_lr_ratio), **kwargs)
