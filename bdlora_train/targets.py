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

import copy
import re
from dataclasses import dataclass

from torch import nn

from bdlora_train.errors import BlockDiagLoraError
from bdlora_train.families import (
    COLUMN,
    GATHER_STYLES,
    Layout,
    candidate_segments,
    consumer_of,
    decoder_prefix,
    expert_layout,
    is_router,
    layer_kind,
    linear_layout,
    parallel_of,
    plan_style,
    probed_layout,
    relative,
    text_config,
    tp_plan,
)
from bdlora_train.patterns import BD_A, BD_B, check_peft_conversion

# The paper's setup: every attention and MLP projection of the decoder layers (q, k, v, o, gate, up, down).
DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# transformers-4 names of what transformers 5 fuses into expert parameters (PEFT's own v4 -> v5 mapping,
# peft/utils/transformers_weight_conversion.py): every name of a group must be asked for.
EXPERT_ALIASES = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}
EXPERT_MODES = {"tp": "tp", True: "tp", "ep": "ep", "none": "none", False: "none", None: "none"}
PACKED, DENSE_STORAGE = "packed", "dense"


def expert_mode(value) -> str:
    if isinstance(value, str) and value in EXPERT_MODES or isinstance(value, bool) or value is None:
        return EXPERT_MODES[value]
    raise BlockDiagLoraError(
        f"BlockDiagLoraConfig: experts={value!r}; use 'tp' (TP-sharded experts, block-diagonal per expert), "
        "'ep' (expert parallelism: whole experts per rank, nblocks 1) or False (do not adapt experts)"
    )


@dataclass(frozen=True)
class Target:
    """One adapted module or expert parameter: its TP layout, block-diagonal role, blocks, rank and storage.

    storage "packed": PEFT's native BD-LoRA block (`use_bdlora` patterns, packed factor). "dense": PEFT's plain
    LoRA tensors holding the block-diagonal factor with explicit zeros (segment-aware blocks and expert factors,
    which PEFT's `use_bdlora` cannot express), described by `bdlora_layout.json`.
    """

    layout: Layout
    role: str
    nblocks: int
    r: int
    storage: str

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def kind(self) -> str:
        return self.layout.kind

    @property
    def params(self) -> int:
        """Free (trainable, non-zero-by-construction) parameters: per expert r(d_in + d_out/N) or r(d_in/N + d_out)."""
        lay, r, n = self.layout, self.r, self.nblocks
        each = r * lay.d_in + r * lay.d_out // n if self.role == BD_B else r * lay.d_in // n + r * lay.d_out
        return each * max(lay.experts, 1)

    @property
    def stored(self) -> int:
        """Numbers in the saved file: the free ones, plus the explicit zeros of a dense-stored factor."""
        if self.storage == PACKED:
            return self.params
        return self.r * (self.layout.d_in + self.layout.d_out) * max(self.layout.experts, 1)


def is_default(target_modules) -> bool:
    """The paper's 7 names, PEFT's "all-linear" shorthand, or nothing: every TP-sharded decoder projection."""
    if isinstance(target_modules, str):
        return target_modules.lower() == "all-linear"
    return target_modules is None or set(target_modules) == set(DEFAULT_TARGET_MODULES)


def canonical(name: str) -> str:
    """A module/parameter name with PEFT's wrapper levels (`.base_layer`) removed."""
    return name.replace(".base_layer", "")


def _matches(pattern: str, name: str, is_regex: bool) -> bool:
    if is_regex:
        return re.fullmatch(pattern, name) is not None
    return name == pattern or name.endswith("." + pattern)


def _short(name: str, prefix: str) -> str:
    """`model.layers.3.self_attn.q_proj` -> `self_attn.q_proj` (the kind of layer, for messages)."""
    rel = relative(name, prefix)
    kind = layer_kind(rel if rel is not None else name)
    return re.sub(r"^[A-Za-z_]+\.\*\.", "", kind)


class _Model:
    """What resolution reads from a model: its Linear modules, expert parameters, scope and plan."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = getattr(model, "config", None)
        self.family = getattr(self.config, "model_type", None) or type(model).__name__
        self.prefix = decoder_prefix(model) if self.config is not None else ""
        self.plan = tp_plan(self.config) if self.config is not None else {}
        self.modules: dict[str, nn.Module] = {}
        self.experts: dict[str, tuple[nn.Module, str]] = {}  # "module.param" -> (owning module, param name)
        for name, module in model.named_modules():
            if not name or ".lora_" in name or name.endswith(".base_layer"):
                continue
            base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
            self.modules[canonical(name)] = base
            for pname, param in base.named_parameters(recurse=False):
                if param.ndim == 3:
                    self.experts[f"{canonical(name)}.{pname}"] = (base, pname)
        for name, module in model.named_modules():  # experts modules that PEFT already wrapped
            if name.endswith(".base_layer") and not hasattr(module, "get_base_layer"):
                for pname, param in module.named_parameters(recurse=False):
                    if param.ndim == 3:
                        self.experts.setdefault(f"{canonical(name)}.{pname}", (module, pname))

    def relative(self, name: str) -> str | None:
        return relative(name, self.prefix)

    def style(self, name: str) -> str | None:
        rel = self.relative(name)
        return plan_style(rel, self.plan) if rel is not None else None

    def in_layers(self, name: str) -> bool:
        rel = self.relative(name)
        return rel is not None and re.match(r"^[A-Za-z_]+\.\d+\.", rel) is not None

    def catalogue(self) -> list[str]:
        """The kinds of TP-sharded projections of the decoder layers: for messages."""
        kinds: dict[str, str] = {}
        for name, module in self.modules.items():
            if isinstance(module, nn.Linear) and parallel_of(self.style(name)) and self.in_layers(name):
                kinds.setdefault(_short(name, self.prefix), name)
        for key in self.experts:
            if self.style(key) and self.in_layers(key):
                kinds.setdefault(_short(key, self.prefix), key)
        return sorted(kinds)


def _peft_keeps(config, name: str) -> bool:
    """Whether PEFT's exclude_modules / layers_to_transform keep `name` (asked as if it were targeted by name)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    probe = copy.copy(config)
    probe.target_modules = {name}
    return bool(check_target_module_exists(probe, name))


def _column_segments(m: _Model, name: str, module: nn.Module, style: str) -> tuple[int, ...] | None:
    """Segments of a column-parallel Linear: implied by transformers' style, else probed (see families.py)."""
    if style not in GATHER_STYLES:
        return None  # colwise: contiguous (transformers runs the consumer on contiguous shards); packed: halves
    consumer = consumer_of(name, m.plan, m.model, m.prefix)
    consumer_in = m.modules[consumer].in_features if consumer in m.modules else None
    candidates = candidate_segments(m.config, module.out_features, consumer_in)
    if len(candidates) == 1:
        return candidates["contiguous"]  # no fused reading of its width: one projection
    label = probed_layout(m.family, layer_kind(m.relative(name)))
    if label not in candidates:  # None: nothing confirmed; or a reading this model's widths do not allow
        raise BlockDiagLoraError(
            f"{name}: {style} output of width {module.out_features} could be laid out as {sorted(candidates)} and "
            f"no layout could be confirmed on a tiny {m.family} model; drop it from target_modules"
        )
    return candidates[label]


def _linear_target(m: _Model, name: str, module: nn.Module, config, nblocks: int, overrides, storage: str):
    from bdlora_train.roles import check_module, check_segments, override_role, rank_for

    check_module(name, module)
    style = m.style(name)
    role = override_role(name, overrides)
    if role is not None and parallel_of(style) != (COLUMN if role == BD_B else "row"):
        style = "colwise" if role == BD_B else "rowwise"  # an explicit role beats the plan: contiguous blocks
    if parallel_of(style) is None:
        where = "" if m.relative(name) is not None else " (outside the language model's decoder layers)"
        raise BlockDiagLoraError(
            f"{name}: no tensor-parallel role in the {m.family} TP plan{where}; pass "
            f"roles={{'{name.rsplit('.', 1)[-1]}': 'bd_b'}} for a column-parallel layer "
            "or 'bd_a' for a row-parallel one"
        )
    segments = _column_segments(m, name, module, style) if parallel_of(style) == COLUMN else None
    layout = linear_layout(name, module, style, segments)
    r = rank_for(config, name)
    check_segments(layout, r, nblocks)
    return Target(
        layout, BD_B if layout.factor == "B" else BD_A, nblocks, r, DENSE_STORAGE if layout.fused else storage
    )


def _expert_target(m: _Model, key: str, config, nblocks: int):
    from bdlora_train.roles import check_segments, rank_for

    module, pname = m.experts[key]
    style = m.style(key)
    layout = expert_layout(key, module, getattr(module, pname), style) if style else None
    if layout is None:
        raise BlockDiagLoraError(
            f"{key}: expert parameter with no tensor-parallel entry in the {m.family} TP plan ({style!r}); "
            "pass experts=False to leave the experts out"
        )
    r = rank_for(config, key)
    check_segments(layout, r, nblocks)
    return Target(layout, BD_B if layout.factor == "B" else BD_A, nblocks, r, DENSE_STORAGE)


def _default_selection(m: _Model, config, experts: str) -> tuple[list[str], list[str]]:
    linears, params, unplanned = [], [], []
    for name, module in m.modules.items():
        is_linear = isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # Conv1D: refused later
        if not is_linear or not m.in_layers(name) or not _peft_keeps(config, name):
            continue
        if parallel_of(m.style(name)):
            linears.append(name)
        elif not is_router(name, module, m.config):
            unplanned.append(name)
    for key in m.experts:
        if m.in_layers(key) and _peft_keeps(config, key.rpartition(".")[0]):
            if not m.style(key):
                unplanned.append(key)
            elif experts != "none":
                params.append(key)
    if unplanned:
        kinds = sorted({_short(n, m.prefix) for n in unplanned})
        would = sorted({_short(n, m.prefix) for n in linears + params})
        raise BlockDiagLoraError(
            f"default targets: {m.family} decoder layers have projections with no tensor-parallel role {kinds} "
            f"(not adapted) besides {would} (adapted); pass target_modules=[...] without them, or "
            "roles={'<name>': 'bd_a' | 'bd_b'} for each"
        )
    return linears, params


def _explicit_selection(m: _Model, config, experts: str) -> tuple[list[str], list[str]]:
    targets = config.target_modules
    is_regex = isinstance(targets, str)
    patterns = [targets] if is_regex else sorted(targets or [])
    linears: set[str] = set()
    params: set[str] = set()
    absent, opted_out = [], []
    asked = set(patterns)
    for pattern in patterns:
        hits = [n for n in m.modules if _matches(pattern, n, is_regex) and _peft_keeps(config, n)]
        inside = [n for n in hits if m.relative(n) is not None]
        hits = inside or hits  # a name the language model has means the language model, not a tower's twin
        direct = [k for k in m.experts if _matches(pattern, k, is_regex) and m.relative(k) is not None]
        alias = [
            k
            for k in m.experts
            if m.relative(k) is not None
            and any(pattern in group and set(group) <= asked for group in EXPERT_ALIASES.get(k.rsplit(".", 1)[-1], ()))
        ]
        partial = [
            (k, group)
            for k in m.experts
            for group in EXPERT_ALIASES.get(k.rsplit(".", 1)[-1], ())
            if pattern in group and not set(group) <= asked and m.relative(k) is not None
        ]
        if partial and not hits and not alias:
            key, group = partial[0]
            raise BlockDiagLoraError(
                f"target_modules: {pattern!r} is fused with {sorted(set(group) - {pattern})} in {key} (one "
                f"parameter per layer in transformers 5); target all of {list(group)} or none"
            )
        if experts == "none":
            if direct and not hits:
                raise BlockDiagLoraError(
                    f"target_modules: {pattern!r} names expert parameters ({_short(direct[0], m.prefix)}) but "
                    "experts=False; drop it or set experts='tp'"
                )
            if alias:
                opted_out.append(pattern)
            direct, alias = [], []
        linears.update(hits)
        params.update(direct + alias)
        if not hits and not direct and not alias and pattern not in opted_out:
            absent.append(pattern)
    for wanted in getattr(config, "target_parameters", None) or []:
        found = [k for k in m.experts if _matches(wanted, k, False)]
        if not found:
            absent.append(f"target_parameters:{wanted}")
        elif experts == "none":
            raise BlockDiagLoraError(f"target_parameters: {wanted!r} names expert parameters but experts=False")
        params.update(found)
    if absent:
        adapted = sorted({_short(n, m.prefix) for n in linears | params})
        raise BlockDiagLoraError(
            f"target_modules: {absent} match no module of {m.family} (would adapt {adapted or 'nothing'}, would not "
            f"adapt {absent}); its decoder projections are {m.catalogue()}: name those, or leave target_modules "
            "unset to adapt all of them"
        )
    return sorted(linears), sorted(params)


def resolve_targets(model: nn.Module, config, nblocks: int, overrides=None, experts="tp") -> dict[str, Target]:
    """Every module / expert parameter `config` asks for in `model`, with its TP layout, after every check.

    Works on meta-device models (reads module types and shapes; fused layouts gather-output plans leave open are
    probed on a tiny model of the same family).
    """
    from bdlora_train.roles import check_heads

    experts = expert_mode(experts)
    m = _Model(model)
    if is_default(config.target_modules) and not getattr(config, "target_parameters", None):
        linears, params = _default_selection(m, config, experts)
    else:
        linears, params = _explicit_selection(m, config, experts)
    if not linears and not params:
        available = sorted({n.rsplit(".", 1)[-1] for n, mod in m.modules.items() if isinstance(mod, nn.Linear)})
        raise BlockDiagLoraError(
            f"target_modules={_show(config.target_modules)} match no module of the model; its Linear layers are "
            f"{available}"
        )
    storage = DENSE_STORAGE if params else PACKED  # PEFT cannot combine use_bdlora with target_parameters
    targets: dict[str, Target] = {}
    for name in linears:
        targets[name] = _linear_target(m, name, m.modules[name], config, nblocks, overrides, storage)
    for key in params:
        targets[key] = _expert_target(m, key, config, 1 if experts == "ep" else nblocks)
    if m.config is not None:
        check_heads(m.config, nblocks, kv=_touches_kv_heads(m.config, targets.values()))
        check_peft_conversion(model, linears, params, canonical)
    return targets


def _touches_kv_heads(model_config, targets) -> bool:
    """Whether any target's output holds key/value-head channels (k_proj, v_proj, a fused qkv): only then must
    nblocks divide the KV heads (engines replicate KV heads when TP exceeds them, so q/o alone shard fine)."""
    config = text_config(model_config)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if not heads or kv == heads:
        return True
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    for target in targets:
        lay = target.layout
        if lay.parallel != COLUMN or lay.experts:
            continue
        if lay.d_out in (kv * head_dim, (heads + 2 * kv) * head_dim) or kv * head_dim in lay.segments:
            return True
    return False


def _show(targets) -> str:
    return repr(sorted(targets)) if isinstance(targets, (set, list)) else repr(targets)


def plan_layouts(model: nn.Module) -> dict[str, Layout]:
    """Every Linear and expert parameter of the language model's decoder that its TP plan shards, with its layout
    (what a TP harness or engine shards; independent of what an adapter targets)."""
    m = _Model(model)
    out: dict[str, Layout] = {}
    for name, module in m.modules.items():
        style = m.style(name)
        if not isinstance(module, nn.Linear) or parallel_of(style) is None:
            continue
        segments = _column_segments(m, name, module, style) if parallel_of(style) == COLUMN else None
        out[name] = linear_layout(name, module, style, segments)
    for key, (module, pname) in m.experts.items():
        style = m.style(key)
        layout = expert_layout(key, module, getattr(module, pname), style) if style else None
        if layout is not None:
            out[key] = layout
    return out
