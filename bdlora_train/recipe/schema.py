"""The training recipe: its keys in sections, each a dataclass defined and validated by the package that owns it.

    section      class          owner
    base         ModelKeys      here; the quantization keys checked by quant/keys.py
    adapter      AdapterKeys    recipe/methods.py
    data         DataKeys       data/keys.py
    rollouts     RolloutKeys    objectives/grpo_keys.py (read by objective: grpo)
    training     TrainingKeys   trainer/keys.py
    parallelism  ParallelKeys   recipe/parallel_keys.py
    hub          HubKeys        here

A recipe YAML stays flat: every key names its section's field (`lora_r` is `recipe.adapter.lora_r`), and
`recipe.lora_r` reads it too. `objective` and `training_args` (the pass-through TrainingArguments keys) sit on the
recipe itself. Every key carries its help text in its field's metadata; docs/training.md's key table is generated
from them (a test keeps the two equal). `Recipe.validate` runs each section's check, then the rules that span
sections, then the objective's (objectives/).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import yaml

from bdlora_train.core.degrees import check_rank
from bdlora_train.core.dtypes import DTYPES
from bdlora_train.core.errors import RecipeError
from bdlora_train.core.keys import check_bounds, check_fields, key
from bdlora_train.data.keys import DataKeys
from bdlora_train.objectives import DEFAULT as DEFAULT_OBJECTIVE
from bdlora_train.objectives import NAMES as OBJECTIVES
from bdlora_train.objectives import objective_named
from bdlora_train.objectives.grpo_keys import RolloutKeys
from bdlora_train.quant.keys import QUANT_TYPES, QuantKeys
from bdlora_train.recipe.methods import BD_METHODS, AdapterKeys
from bdlora_train.recipe.parallel_keys import ParallelKeys, check_parallel_keys
from bdlora_train.trainer.keys import TrainingKeys


@dataclass
class ModelKeys:
    """The recipe's base section: which model, at which dtype, quantized how."""

    model: str = key("embedded", "models.load_model spec: embedded | tiny:<type> | local dir | Hub id")
    torch_dtype: str = key(
        "float32", "dtype of the frozen base weights (and of the adapter on float64: exactness checks)", choices=DTYPES
    )
    load_in_4bit: bool = key(False, "load the base 4-bit with bitsandbytes (QLoRA); adapters stay float")
    bnb_4bit_quant_type: str = key("nf4", "4-bit data type", choices=QUANT_TYPES)
    bnb_4bit_compute_dtype: str | None = key(None, "dtype the 4-bit matmuls run in; null: torch_dtype")
    bnb_4bit_use_double_quant: bool = key(False, "also quantize the 4-bit block scales (QLoRA's double quantization)")
    load_in_8bit: bool = key(False, "load the base 8-bit with bitsandbytes (LLM.int8)")
    torchao_int8: bool = key(False, "load the base with torchao int8 weight-only quantization (Int8WeightOnlyConfig)")

    @property
    def quant_keys(self) -> QuantKeys:
        """How the base is quantized (load_in_4bit, ...): all off for a float base."""
        return QuantKeys(**{f.name: getattr(self, f.name) for f in dataclasses.fields(QuantKeys)})

    def check(self) -> None:
        check_fields(self)
        self.quant_keys.check()


@dataclass
class HubKeys:
    """The recipe's hub section: where the finished adapter is pushed."""

    push_to_hub: bool = key(False, "upload adapter/ with its model card when training finishes")
    hub_model_id: str | None = key(None, "target repo, e.g. me/smollm2-bdlora")
    hub_private_repo: bool = key(False, "create the Hub repo as private")

    def check(self) -> None:
        check_fields(self)
        if self.push_to_hub and not self.hub_model_id:
            raise RecipeError("recipe: push_to_hub=true needs hub_model_id (e.g. hub_model_id=me/smollm2-bdlora)")


@dataclass
class RecipeKeys:
    """The keys on the recipe itself, outside any section."""

    objective: str = key(
        DEFAULT_OBJECTIVE,
        "sft: learn the completions (loss on completion tokens) | grpo: reinforcement learning with verifiable "
        "rewards (TRL's GRPOTrainer; GRPOConfig keys pass through; docs/rl.md)",
        choices=OBJECTIVES,
    )
    training_args: dict = key(
        {},
        "other transformers.TrainingArguments keys (eval_strategy, eval_steps, lr_scheduler_kwargs, "
        "neftune_noise_alpha, torch_compile, dataloader_num_workers, ...), written at the top level of a recipe "
        "and type-checked against TrainingArguments",
    )


SECTIONS = {
    "base": ModelKeys,
    "adapter": AdapterKeys,
    "data": DataKeys,
    "rollouts": RolloutKeys,
    "training": TrainingKeys,
    "parallelism": ParallelKeys,
    "hub": HubKeys,
}
SECTION_OF = {f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
OWN = tuple(f.name for f in dataclasses.fields(RecipeKeys))  # objective, training_args


def recipe_fields() -> list[dataclasses.Field]:
    """Every key's field, in the order `bdlora train --help`, the docs and recipe.yaml list them."""
    own = {f.name: f for f in dataclasses.fields(RecipeKeys)}
    fields = [*dataclasses.fields(ModelKeys), *dataclasses.fields(AdapterKeys), own["objective"]]
    for cls in list(SECTIONS.values())[2:]:
        fields += dataclasses.fields(cls)
    return [*fields, own["training_args"]]


def recipe_keys() -> list[str]:
    return [f.name for f in recipe_fields()]


class Recipe:
    """Everything one training run needs, in sections (SECTIONS); `Recipe(key=value, ...)` takes the flat keys a
    YAML has, and `recipe.key` reads them back from their section."""

    def __init__(self, objective: str = DEFAULT_OBJECTIVE, training_args: dict | None = None, **keys):
        unknown = [k for k in keys if k not in SECTION_OF]
        if unknown:
            raise TypeError(f"Recipe: unknown key {unknown[0]!r}")
        self.objective = objective
        self.training_args = dict(training_args or {})
        for name, cls in SECTIONS.items():
            setattr(self, name, cls(**{k: v for k, v in keys.items() if SECTION_OF[k] == name}))

    def __getattr__(self, name: str):  # only for names not set on the recipe: a key of one of its sections
        section = SECTION_OF.get(name)
        if section is None or section not in self.__dict__:
            raise AttributeError(f"'Recipe' object has no attribute {name!r}")
        return getattr(self.__dict__[section], name)

    def __setattr__(self, name: str, value) -> None:
        section = SECTION_OF.get(name)
        target = self if section is None else self.__dict__[section]
        object.__setattr__(target, name, value)

    def flat(self) -> dict:
        """{key: value} for every key, in `recipe_fields` order (training_args as one dict)."""
        return {name: getattr(self, name) for name in recipe_keys()}

    def replace(self, **changes) -> "Recipe":
        """A new recipe with `changes` (flat keys), its derived keys worked out again (AdapterKeys.__post_init__)."""
        return Recipe(**{**self.flat(), **changes})

    @property
    def model_parallel(self) -> bool:
        return self.parallelism.model_parallel

    @property
    def quant_keys(self) -> QuantKeys:
        return self.base.quant_keys

    @property
    def loggers(self) -> list[str]:
        return self.training.loggers

    @property
    def targets(self) -> list[str]:
        return self.adapter.targets

    def __eq__(self, other) -> bool:
        return isinstance(other, Recipe) and self.flat() == other.flat()

    def __repr__(self) -> str:
        return f"Recipe({', '.join(f'{k}={v!r}' for k, v in self.flat().items())})"

    def validate(self) -> "Recipe":
        """Cheap checks that need no model: fail in a second, not after loading 8B weights. Each section's own
        check, then the rules that span sections, then the objective's."""
        for name in SECTIONS:
            getattr(self, name).check()
        for f in dataclasses.fields(RecipeKeys):
            check_bounds(f, getattr(self, f.name))
        keys = self.quant_keys
        check_parallel_keys(self, keys)
        # under TP the run's plan checks nblocks and lora_r after tp_size meets the model's heads (run_plan.py), so
        # no refusal suggests a value another rule refuses
        bd_rank = self.method in BD_METHODS and self.nblocks and not self.match_budget_of_lora_rank
        if bd_rank and not self.model_parallel:
            check_rank(self.lora_r, self.nblocks, "recipe", key="lora_r", error=RecipeError)
        self._check_objective_keys()
        strategy = str(self.training_args.get("eval_strategy", "no"))
        if strategy != "no" and not (self.eval_dataset or self.eval_fraction):
            raise RecipeError(
                f"recipe: eval_strategy={strategy} needs evaluation data; set eval_dataset=<spec> or eval_fraction=0.05"
            )
        if strategy == "no" and self.training_args.get("eval_steps") is not None:
            raise RecipeError(
                f"recipe: eval_steps={self.training_args['eval_steps']:g} without eval_strategy does nothing "
                "(transformers evaluates only with eval_strategy=steps); add eval_strategy=steps"
            )
        if keys.kind and (self.deepspeed or self.fsdp):
            raise RecipeError(
                f"recipe: {keys.switches_on[0]}=true with deepspeed/fsdp is not supported (a quantized base is trained "
                "on one device per process); drop deepspeed/fsdp, or train an unquantized base with them"
            )
        return self

    def _check_objective_keys(self) -> None:
        """Another objective's keys refused, then the objective's own checks (objectives/)."""
        for name in OBJECTIVES:
            if name != self.objective:
                given = [k for k in objective_named(name).recipe_keys if getattr(self, k)]
                if given:
                    raise RecipeError(
                        f"recipe: {given[0]} applies to objective={name} only; add objective={name} or drop it"
                    )
        objective_named(self.objective).check_recipe(self)

    def to_yaml(self) -> str:
        """The recipe as the YAML a user would write: TrainingArguments pass-through keys at the top level."""
        data = self.flat()
        data.update(data.pop("training_args"))
        return yaml.safe_dump(data, sort_keys=False)
