"""The family coverage table of docs/families.md, generated from the code (tests/test_families.py compares them).

Every family of `models.TINY_FAMILIES` is built tiny and resolved with the default targets at nblocks 2; each
one that resolves gets a random BD-LoRA adapter and is checked under TP 2 (`tp_check`, all in one spawn), plus
two explicit adapters: DeepSeek-V3 with its MLA up-projections and experts, and Mixtral with expert parallelism.

    python -m tools.families_table            # rewrite the table in docs/families.md (one 2-rank spawn, ~2-3 min)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bdlora_train.core.errors import BlockDiagLoraError, first_line

START, END = "<!-- families:start -->", "<!-- families:end -->"
DOC = Path(__file__).resolve().parent.parent / "docs" / "families.md"
NBLOCKS = 2
# Adapters beyond the default targets, checked in the same spawn: (label, base, BlockDiagLoraConfig arguments).
EXPLICIT = [
    (
        "deepseek_v3 (explicit: MLA q_b/kv_b/o + experts)",
        "deepseek_v3",
        dict(target_modules=["q_b_proj", "kv_b_proj", "o_proj"], target_parameters=["gate_up_proj", "down_proj"]),
    ),
    ("mixtral (experts='ep')", "mixtral", dict(experts="ep")),
]


def resolve_family(family: str, **config) -> dict:
    """Default (or `config`) targets of a tiny `family` model: {"targets": {...}} or {"error": one line}."""
    from bdlora_train.models import build_tiny_model
    from bdlora_train.peft_integration.config import BlockDiagLoraConfig
    from bdlora_train.peft_integration.resolve import resolve

    model = build_tiny_model(family)
    try:
        cfg = BlockDiagLoraConfig(r=2 * NBLOCKS, nblocks=NBLOCKS, **config)
        return {"targets": resolve(model, cfg, NBLOCKS, cfg.roles, cfg.experts)}
    except BlockDiagLoraError as err:
        return {"error": first_line(err, 10_000)}


_BLOCKS = {"self_attn", "mlp", "attn", "attention", "self_attention", "feed_forward", "ffn"}


def _kind(name: str) -> str:
    """`model.layers.0.mlp.experts.gate_up_proj` -> `experts.gate_up_proj`; `...self_attn.q_proj` -> `q_proj`."""
    parts = [part for part in name.split(".") if not part.isdigit()]
    return parts[-1] if len(parts) < 2 or parts[-2] in _BLOCKS or parts[-2] in ("layers", "h") else ".".join(parts[-2:])


def _segments(target) -> str:
    lay = target.layout
    if not lay.fused:
        return ""
    return "[" + ({2: "gate|up", 3: "q|k|v"}.get(len(lay.segments)) or "|".join(map(str, lay.segments))) + "]"


def roles_cell(targets: dict) -> str:
    by_role: dict[str, dict[str, str]] = {}
    for name, t in targets.items():
        extra = f" x{t.layout.experts}" if t.layout.experts else ""
        blocks = "" if t.nblocks == NBLOCKS else f" (nblocks {t.nblocks})"
        by_role.setdefault(t.role, {}).setdefault(_kind(name), f"{_kind(name)}{_segments(t)}{extra}{blocks}")
    return "; ".join(f"{role}: {', '.join(kinds[k] for k in sorted(kinds))}" for role, kinds in sorted(by_role.items()))


def handled_cell(targets: dict) -> str:
    fused = sorted({_kind(n) for n, t in targets.items() if t.layout.fused and not t.layout.experts})
    experts = sorted({_kind(n) for n, t in targets.items() if t.layout.experts})
    parts = []
    if fused:
        parts.append(f"fused, segment-aware blocks: {', '.join(fused)}")
    if experts:
        parts.append(f"experts: {', '.join(experts)}")
    dense = any(t.storage == "dense" for t in targets.values())
    if dense:
        parts.append("stored dense" + (" (plain-LoRA file)" if experts else " for the fused ones"))
    return "; ".join(parts) or "-"


def _bucket(err: float) -> str:
    """Coarse, so the table does not depend on float summation order (thread counts differ between machines)."""
    for limit in (1e-5, 1e-4):
        if err < limit:
            return f"< {limit:g}"
    return f"{err:.1e} (NOT exact)"


def tp_cell(result: dict | None) -> str:
    if result is None:
        return "-"
    verdict = "yes" if result["ok"] else "NO"
    return (
        f"{verdict}: rel. err {_bucket(max(result['max_rel_err'], result['base_rel_err']))}, collectives base "
        f"{result['base_collectives']} = BD-LoRA {result['bdlora_collectives']} (S-LoRA {result['slora_collectives']})"
    )


def run_tp(families: list[str], explicit=EXPLICIT) -> dict[str, dict]:
    """TP 2 check of a random default-target adapter on each family and of each explicit adapter, one spawn."""
    from bdlora_train.tp_diagnostics.harness import random_adapter, tp_check

    with tempfile.TemporaryDirectory(prefix="bdlora-coverage-") as tmp:
        extra = [
            random_adapter(Path(tmp, f"explicit{i}"), f"tiny:{base}", NBLOCKS, r=2 * NBLOCKS, seed=i, config=config)
            for i, (_, base, config) in enumerate(explicit)
        ]
        first, rest = (extra[0], extra[1:]) if extra else (None, [])
        bases = [f"tiny:{family}" for family in families]
        if first is None:
            first_base, bases = bases[0], bases[1:]
        results = tp_check(
            first,
            tp=NBLOCKS,
            base=None if first else first_base,
            tokens=8,
            extra_adapters=rest,
            extra_bases=bases,
        )
    labels = [label for label, _, _ in explicit] + list(families)
    return dict(zip(labels, results))


def coverage_rows(tp_results: dict[str, dict] | None = None) -> list[dict]:
    """One row per family (default targets) and per explicit adapter; TP cells from `tp_results` when given."""
    from bdlora_train.models import TINY_FAMILIES

    rows = []
    for family in TINY_FAMILIES:
        resolved = resolve_family(family)
        rows.append(_row(family, resolved, (tp_results or {}).get(family)))
    for label, base, config in EXPLICIT:
        rows.append(_row(label, resolve_family(base, **config), (tp_results or {}).get(label)))
    return rows


def _row(label: str, resolved: dict, tp: dict | None) -> dict:
    if "error" in resolved:
        return dict(family=label, roles="-", handled="-", tp="-", refused=resolved["error"])
    targets = resolved["targets"]
    return dict(family=label, roles=roles_cell(targets), handled=handled_cell(targets), tp=tp_cell(tp), refused="-")


def markdown(rows: list[dict]) -> str:
    lines = [
        "| family (tiny:&lt;type&gt;) | roles (nblocks 2) | fused / experts handled "
        "| TP 2 exact, zero extra collectives | refused (message) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [row[key].replace("|", "\\|") for key in ("family", "roles", "handled", "tp", "refused")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def resolvable_families() -> list[str]:
    from bdlora_train.models import TINY_FAMILIES

    return [family for family in TINY_FAMILIES if "targets" in resolve_family(family)]


def doc_table(path: Path = DOC) -> str:
    text = path.read_text()
    return text[text.index(START) + len(START) : text.index(END)].strip("\n") + "\n"


def write_table(table: str, path: Path = DOC) -> None:
    from bdlora_train.core.files import atomic_write_text

    text = path.read_text()
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    atomic_write_text(path, f"{head}{START}\n{table}{END}{tail}")


if __name__ == "__main__":
    write_table(markdown(coverage_rows(run_tp(resolvable_families()))))
    print(f"wrote the family table of {DOC}")
