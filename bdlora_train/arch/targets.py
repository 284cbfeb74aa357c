"""From what was asked to exactly what gets adapted, or one line saying why not: never a silent partial adapter.

The default request ("the paper's 7 projections": `target_modules` unset, or exactly q/k/v/o/gate/up/down) means
*every projection of the language model's decoder layers that tensor parallelism shards*, whatever the family
calls it: Phi-3's fused `qkv_proj` and `gate_up_proj`, GPT-NeoX's `query_key_value`, Mixtral's expert parameters.
A decoder-layer Linear the TP plan does not cover (DeepSeek-V3's MLA projections) fails the request instead of
being skipped; routers and shared-expert gates are never adapted. Explicit requests must each resolve to
something adaptable; a name that matches nothing (e.g. `q_proj` on Phi-3) fails with what would and would not
be adapted. Expert parameters (3-D in transformers 5) are found before injection, by name or by the v4 names
PEFT's own conversion maps onto them (gate_proj/up_proj -> gate_up_proj, w1/w3/w2), and adapted for real
(`experts="tp"`), densely per expert under expert parallelism (`"ep"`: whole experts per rank, nblocks 1), or
left out on an explicit opt-out (`experts=False`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from bdlora_train.arch.checks import check_heads, check_module, check_segments, override_role, touches_kv_heads
from bdlora_train.arch.plan_layouts import column_segments, expert_layout, linear_layout
from bdlora_train.arch.plans import parallel_of
from bdlora_train.arch.scope import ModelView, is_router
from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.core.layout import COLUMN, Layout, role_of
from bdlora_train.core.naming import matches_name
from bdlora_train.core.roles import BD_B, DEFAULT_TARGET_MODULES, Role, module_params

# transformers-4 names of what transformers 5 fuses into expert parameters (PEFT's own v4 -> v5 mapping,
# peft/utils/transformers_weight_conversion.py): every name of a group must be asked for.
EXPERT_ALIASES = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}
EXPERT_MODES = {"tp": "tp", True: "tp", "ep": "ep", "none": "none", False: "none", None: "none"}
# How a target's factors are stored: PEFT-native packed BD-LoRA, or dense with explicit zeros off the blocks.
PACKED, DENSE = "packed", "dense"


def expert_mode(value) -> str:
    if isinstance(value, str) and value in EXPERT_MODES or isinstance(value, bool) or value is None:
        return EXPERT_MODES[value]
    raise BlockDiagLoraConfigError(
        f"BlockDiagLoraConfig: experts={value!r}; use 'tp' (TP-sharded experts, block-diagonal per expert), "
        "'ep' (expert parallelism: whole experts per rank, nblocks 1) or False (do not adapt experts)"
    )


@dataclass(frozen=True)
class Target:
    """One adapted module or expert parameter: its TP layout, block-diagonal role, blocks, rank and storage.

    storage PACKED: PEFT's native BD-LoRA block (`use_bdlora` patterns, packed factor). DENSE: PEFT's plain LoRA
    tensors holding the block-diagonal factor with explicit zeros (segment-aware blocks and expert factors, which
    PEFT's `use_bdlora` cannot express), described by `bdlora_layout.json`.
    """

    layout: Layout
    nblocks: int
    r: int
    storage: str

    @property
    def role(self) -> Role:
        return self.layout.role

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def kind(self) -> str:
        return self.layout.kind

    @property
    def params(self) -> int:
        """Free (trainable, non-zero-by-construction) parameters, once per expert."""
        lay = self.layout
        return module_params(self.role, lay.d_in, lay.d_out, self.r, self.nblocks) * max(lay.experts, 1)

    @property
    def stored(self) -> int:
        """Numbers in the saved file: the free ones, plus the explicit zeros of a dense-stored factor."""
        if self.storage == PACKED:
            return self.params
        return module_params(None, self.layout.d_in, self.layout.d_out, self.r) * max(self.layout.experts, 1)


def _keep_all(_name: str) -> bool:
    return True


@dataclass(frozen=True)
class Request:
    """What an adapter config asks for, in PEFT's terms but read without PEFT (peft_integration/resolve.py builds it).

    target_modules: names (a module matches an entry it equals or ends with "." + entry), one regex string
    (full match), "all-linear", or None (the default request); target_parameters: expert parameter names;
    rank_of(name): the rank PEFT gives a module (r, or its rank_pattern entry); keeps(name): whether PEFT's
    exclude_modules / layers_to_transform keep a module; roles: explicit {name or suffix: bd_a | bd_b}.
    """

    target_modules: object
    rank_of: Callable[[str], int]
    target_parameters: tuple = ()
    keeps: Callable[[str], bool] = _keep_all
    roles: dict | None = None
    experts: str = "tp"


def is_default(target_modules) -> bool:
    """The paper's 7 names, PEFT's "all-linear" shorthand, or nothing: every TP-sharded decoder projection."""
    if isinstance(target_modules, str):
        return target_modules.lower() == "all-linear"
    return target_modules is None or set(target_modules) == set(DEFAULT_TARGET_MODULES)


def _matches(pattern: str, name: str, is_regex: bool) -> bool:
    return re.fullmatch(pattern, name) is not None if is_regex else matches_name(name, pattern)


def _linear_target(view: ModelView, name: str, module: nn.Module, request: Request, nblocks, storage, probe_model):
    check_module(name, module)
    style = view.style(name)
    role = override_role(name, request.roles)
    if role is not None and role_of(parallel_of(style)) != role:
        style = "colwise" if role == BD_B else "rowwise"  # an explicit role beats the plan: contiguous blocks
    if parallel_of(style) is None:
        where = "" if view.relative(name) is not None else " (outside the language model's decoder layers)"
        raise BlockDiagLoraConfigError(
            f"{name}: no tensor-parallel role in the {view.family} TP plan{where}; pass "
            f"roles={{'{name.rsplit('.', 1)[-1]}': 'bd_b'}} for a column-parallel layer "
            "or 'bd_a' for a row-parallel one"
        )
    segments = column_segments(view, name, module, style, probe_model) if parallel_of(style) == COLUMN else None
    layout = linear_layout(name, module, style, segments)
    r = request.rank_of(name)
    check_segments(layout, r, nblocks)
    return Target(layout, nblocks, r, DENSE if layout.fused else storage)


def _expert_target(view: ModelView, key: str, request: Request, nblocks: int) -> Target:
    module, pname = view.experts[key]
    style = view.style(key)
    layout = expert_layout(key, module, getattr(module, pname), style) if style else None
    if layout is None:
        raise BlockDiagLoraConfigError(
            f"{key}: expert parameter with no tensor-parallel entry in the {view.family} TP plan ({style!r}); "
            "pass experts=False to leave the experts out"
        )
    r = request.rank_of(key)
    check_segments(layout, r, nblocks)
    return Target(layout, nblocks, r, DENSE)


def _default_selection(view: ModelView, request: Request) -> tuple[list[str], list[str]]:
    linears, params, unplanned = [], [], []
    for name, module in view.modules.items():
        is_linear = isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # Conv1D: refused later
        if not is_linear or not view.in_layers(name) or not request.keeps(name):
            continue
        if parallel_of(view.style(name)):
            linears.append(name)
        elif not is_router(name, module, view.config):
            unplanned.append(name)
    for key in view.experts:
        if view.in_layers(key) and request.keeps(key.rpartition(".")[0]):
            if not view.style(key):
                unplanned.append(key)
            elif request.experts != "none":
                params.append(key)
    if unplanned:
        kinds = sorted({view.short(n) for n in unplanned})
        would = sorted({view.short(n) for n in linears + params})
        raise BlockDiagLoraConfigError(
            f"default targets: {view.family} decoder layers have projections with no tensor-parallel role {kinds} "
            f"(not adapted) besides {would} (adapted); pass target_modules=[...] without them, or "
            "roles={'<name>': 'bd_a' | 'bd_b'} for each"
        )
    return linears, params


def _explicit_selection(view: ModelView, request: Request) -> tuple[list[str], list[str]]:
    targets, experts = request.target_modules, request.experts
    is_regex = isinstance(targets, str)
    patterns = [targets] if is_regex else sorted(targets or [])
    linears: set[str] = set()
    params: set[str] = set()
    absent, opted_out = [], []
    asked = set(patterns)
    for pattern in patterns:
        hits = [n for n in view.modules if _matches(pattern, n, is_regex) and request.keeps(n)]
        inside = [n for n in hits if view.relative(n) is not None]
        hits = inside or hits  # a name the language model has means the language model, not a tower's twin
        direct = [k for k in view.experts if _matches(pattern, k, is_regex) and view.relative(k) is not None]
        alias = [
            k
            for k in view.experts
            if view.relative(k) is not None
            and any(pattern in group and set(group) <= asked for group in EXPERT_ALIASES.get(k.rsplit(".", 1)[-1], ()))
        ]
        partial = [
            (k, group)
            for k in view.experts
            for group in EXPERT_ALIASES.get(k.rsplit(".", 1)[-1], ())
            if pattern in group and not set(group) <= asked and view.relative(k) is not None
        ]
        if partial and not hits and not alias:
            key, group = partial[0]
            raise BlockDiagLoraConfigError(
                f"target_modules: {pattern!r} is fused with {sorted(set(group) - {pattern})} in {key} (one "
                f"parameter per layer in transformers 5); target all of {list(group)} or none"
            )
        if experts == "none":
            if direct and not hits:
                raise BlockDiagLoraConfigError(
                    f"target_modules: {pattern!r} names expert parameters ({view.short(direct[0])}) but "
                    "experts=False; drop it or set experts='tp'"
                )
            if alias:
                opted_out.append(pattern)
            direct, alias = [], []
        linears.update(hits)
        params.update(direct + alias)
        if not hits and not direct and not alias and pattern not in opted_out:
            absent.append(pattern)
    for wanted in request.target_parameters:
        found = [k for k in view.experts if matches_name(k, wanted)]
        if not found:
            absent.append(f"target_parameters:{wanted}")
        elif experts == "none":
            raise BlockDiagLoraConfigError(f"target_parameters: {wanted!r} names expert parameters but experts=False")
        params.update(found)
    if absent:
        adapted = sorted({view.short(n) for n in linears | params})
        raise BlockDiagLoraConfigError(
            f"target_modules: {absent} match no module of {view.family} (would adapt {adapted or 'nothing'}, would "
            f"not adapt {absent}); its decoder projections are {view.catalogue()}: name those, or leave "
            "target_modules unset to adapt all of them"
        )
    return sorted(linears), sorted(params)


def resolve_targets(model: nn.Module, request: Request, nblocks: int, probe_model=None) -> dict[str, Target]:
    """Every module / expert parameter `request` asks for in `model`, with its TP layout, after every check.

    Works on meta-device models (reads module types and shapes). A fused layout that a gather-output plan entry
    leaves open is probed on `probe_model(family)`, a tiny model of the same family (refused without one).
    """
    view = ModelView(model)
    if is_default(request.target_modules) and not request.target_parameters:
        linears, params = _default_selection(view, request)
    else:
        linears, params = _explicit_selection(view, request)
    if not linears and not params:
        available = sorted({n.rsplit(".", 1)[-1] for n, mod in view.modules.items() if isinstance(mod, nn.Linear)})
        raise BlockDiagLoraConfigError(
            f"target_modules={_show(request.target_modules)} match no module of the model; its Linear layers are "
            f"{available}"
        )
    storage = DENSE if params else PACKED  # PEFT cannot combine use_bdlora with target_parameters
    targets: dict[str, Target] = {}
    for name in linears:
        targets[name] = _linear_target(view, name, view.modules[name], request, nblocks, storage, probe_model)
    for key in params:
        targets[key] = _expert_target(view, key, request, 1 if request.experts == "ep" else nblocks)
    if view.config is not None:
        check_heads(view.config, nblocks, kv=touches_kv_heads(view.config, targets.values()))
    return targets


def _show(targets) -> str:
    return repr(sorted(targets)) if isinstance(targets, (set, list)) else repr(targets)
