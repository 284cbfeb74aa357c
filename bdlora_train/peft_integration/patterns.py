"""PEFT's `use_bdlora` block, read and written exactly as stock PEFT does.

PEFT stores roles as two pattern lists, `target_modules_bd_a` and `target_modules_bd_b`, and assigns a role by
a *substring* test of each pattern on the full module name (core/naming.py, `substring_role`), so "up_proj" also
claims "gate_up_proj". The toolkit resolves roles by exact names (arch/targets.py); this module is the one place
that translates between the two: it reads patterns back the way PEFT will, and writes patterns PEFT cannot misread.
"""

from __future__ import annotations

from bdlora_train.core.errors import BlockDiagLoraConfigError
from bdlora_train.core.naming import canonical, matches_name, substring_role
from bdlora_train.core.roles import BD_A, BD_B, ROLES


def bdlora_field(use_bdlora, key: str):
    """A field of `LoraConfig.use_bdlora`, which PEFT holds as a `BdLoraConfig` or, read from JSON, a dict."""
    if use_bdlora is None:
        return None
    return use_bdlora.get(key) if isinstance(use_bdlora, dict) else getattr(use_bdlora, key, None)


def bdlora_nblocks(use_bdlora) -> int:
    """nblocks of a `use_bdlora` block; 1 (dense) when there is none."""
    return int(bdlora_field(use_bdlora, "nblocks") or 1) if use_bdlora is not None else 1


def stock_roles(names, use_bdlora) -> dict[str, str | None]:
    """Roles exactly as stock PEFT assigns them: a substring test of each pattern on the full module name."""
    bd_a = list(bdlora_field(use_bdlora, "target_modules_bd_a") or [])
    bd_b = list(bdlora_field(use_bdlora, "target_modules_bd_b") or [])
    return {name: substring_role(name, bd_a, bd_b) for name in names}


def compact_patterns(roles: dict[str, str], unroled=()) -> dict[str, list[str]]:
    """Shortest name suffixes that give exactly `roles` under PEFT's substring matching.

    For each module we take the shortest dotted suffix that is no substring of any module with another role or
    of any `unroled` module (targets PEFT must build as plain LoRA: Phi-3's `gate_up_proj` next to `up_proj`),
    falling back to the full name, then verify the result with `stock_roles`.
    """
    patterns: dict[str, set[str]] = {role: set() for role in ROLES}
    unroled = list(unroled)
    for name, role in roles.items():
        others = [n for n, r in roles.items() if r != role] + unroled
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            candidate = ".".join(parts[-k:])
            if not any(candidate in other for other in others):
                break
        patterns[role].add(candidate)
    result = {role: sorted(p) for role, p in patterns.items()}
    everything = {**roles, **dict.fromkeys(unroled)}
    stock = stock_roles(everything, {"target_modules_bd_a": result[BD_A], "target_modules_bd_b": result[BD_B]})
    if stock != everything:  # cannot happen for distinct names; a wrong file would be worse than a crash
        raise BlockDiagLoraConfigError(
            "patterns: no use_bdlora patterns reproduce these roles under PEFT's substring rule"
        )
    return result


def compact_names(selected, universe) -> list[str]:
    """Shortest dotted suffixes that PEFT's list matching (name == entry or name ends with '.' + entry) maps onto
    exactly `selected` among `universe`: one entry per kind of layer when they are unambiguous (`q_proj`), longer
    ones where a tower or a sibling shares the leaf name (`language_model.layers.0.self_attn.q_proj`)."""
    selected = set(selected)
    others = [n for n in universe if n not in selected]
    chosen: set[str] = set()
    for name in sorted(selected):
        if any(matches_name(name, c) for c in chosen):
            continue
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            if parts[-k].isdigit() and k < len(parts):
                continue  # "layers.1.q_proj", not "1.q_proj"
            candidate = ".".join(parts[-k:])
            if not any(matches_name(other, candidate) for other in others):
                break
        chosen.add(candidate)
    if {n for n in universe if any(matches_name(n, c) for c in chosen)} != selected:
        raise BlockDiagLoraConfigError("patterns: no target list reproduces the resolved modules under PEFT's matching")
    return sorted(chosen)


def check_peft_conversion(model, linears, params) -> None:
    """PEFT rewrites target names of transformers-v5 MoE families (gate_proj/up_proj/down_proj/gate -> expert
    target_parameters) whenever it builds or loads an adapter. Run that conversion on the LoraConfig that names
    exactly these targets; if it would change anything, refuse here, before injection, instead of crashing inside
    PEFT or loading differently from how it was trained."""
    from peft import LoraConfig

    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # transformers < 5: no conversion
        return
    universe = {canonical(n) for n, _ in model.named_modules() if n and ".lora_" not in n}
    probe = LoraConfig(
        target_modules=set(compact_names(linears, universe)) if linears else set(),
        target_parameters=sorted(params) or None,
    )
    before = (set(probe.target_modules), set(probe.target_parameters or []))
    convert_peft_config_for_transformers(probe, model, None)
    after = (set(probe.target_modules or []), set(probe.target_parameters or []))
    if after != before:
        rewritten = sorted(before[0] - after[0])
        raise BlockDiagLoraConfigError(
            f"target_modules {rewritten}: PEFT's transformers-v5 conversion for {model.config.model_type} turns "
            f"these Linear names into expert target_parameters {sorted(after[1])} when it builds or loads an adapter "
            "(peft/utils/transformers_weight_conversion.py), so layers with these names cannot be stored loadably; "
            "leave them out (reach the experts with target_parameters=['experts.gate_up_proj', 'experts.down_proj'])"
        )
