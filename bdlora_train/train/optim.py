"""`bd_lr_ratio`: a LoRA+-style learning-rate multiplier for the block-diagonal factor of BD-LoRA.

Why a multiplier: Adam moves every weight by about the learning rate whatever its gradient scale, so how far one
step moves a layer's output grows with the number of weights summed into each output (the factor's fan-in). A
block-diagonal factor has 1/N of its dense counterpart's fan-in: BD-B's B sums r/N rank components per output
block instead of r, BD-A's A reads d_in/N inputs per rank component instead of d_in. At the same learning rate
the block-diagonal factor therefore moves the output about N times less (fully coherent updates; sqrt(N) for
random ones) than the same factor of LoRA. LoRA+ (Hayou et al., 2024, arXiv 2402.12354) gives the two LoRA factors
different learning rates for the same reason; here the ratio multiplies the learning rate of the block-diagonal
factor only (BD-A's `lora_A` on row-parallel layers, BD-B's `lora_B` on column-parallel ones), packed or stored
densely with masks (fused projections, MoE experts); everything else keeps `learning_rate`. The scheduler scales every
group alike, so the ratio holds for the whole run.
"""

from __future__ import annotations

from bdlora_train.core.errors import RecipeError
from bdlora_train.peft_seam.layers import block_diagonal_factors


def apply_bd_lr_ratio(trainer, recipe) -> None:
    """Give `trainer` an optimizer whose block-diagonal factors train at `bd_lr_ratio` x `learning_rate`; a no-op
    at ratio 1 (Trainer builds its own optimizer then). Same optimizer class, kwargs and weight-decay split."""
    ratio = recipe.bd_lr_ratio
    if ratio == 1.0:
        return
    model = trainer.model
    bd = {id(p) for p in block_diagonal_factors(model)}
    if not bd:
        raise RecipeError(f"recipe: bd_lr_ratio={ratio} but the adapter has no block-diagonal factor; drop it")
    cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, model)
    if "params" in kwargs or "model" in kwargs or "optimizer_dict" in kwargs:
        raise RecipeError(f"recipe: bd_lr_ratio={ratio} cannot be combined with optim={recipe.optim}; use adamw_torch")
    decay = set(trainer.get_decay_parameter_names(model))
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault((id(p) in bd, name in decay), []).append(p)
    params = [
        {
            "params": ps,
            "weight_decay": recipe.weight_decay if in_decay else 0.0,
            "lr": recipe.learning_rate * (ratio if is_bd else 1.0),
        }
        for (is_bd, in_decay), ps in sorted(groups.items())
    ]
    trainer.optimizer_cls_and_kwargs = (cls, {**kwargs, "params": params})
