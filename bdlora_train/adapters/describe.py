"""What `bdlora inspect` prints and the model card shows: per module (or module kind) role, shapes, params."""

from __future__ import annotations

from bdlora_train.adapters.reader import Adapter


def describe(adapter: Adapter, per_module: bool = False) -> dict:
    """What `bdlora inspect` prints: per module (or per module kind) role, shapes and params; TP degrees."""
    rows = []
    groups: dict[tuple, dict] = {}
    for name, m in adapter.modules.items():
        row = dict(
            module=name,
            role=(
                f"{m.bd_role} (dense, {'experts ' if m.experts else ''}segments {list(m.segments)})"
                if m.structure
                else m.role or "lora"
            ),
            nblocks=m.bd_nblocks,
            r=m.r,
            A_packed=list(m.A.shape),
            B_packed=list(m.B.shape),
            A_dense=[m.r, m.d_in],
            B_dense=[m.d_out, m.r],
            params=m.params,
        )
        if per_module:
            rows.append(row)
            continue
        kind = ".".join(p for p in name.split(".") if not p.isdigit() and p not in ("model", "layers"))
        key = (kind, row["role"], row["r"], tuple(row["A_packed"]), tuple(row["B_packed"]))
        group = groups.setdefault(key, {**row, "module": kind, "count": 0})
        group["count"] += 1
    if not per_module:
        rows = list(groups.values())
    return dict(
        path=str(adapter.path),
        base_model=adapter.config.base_model_name_or_path,
        bdlora=adapter.has_structure,
        use_bdlora=adapter.is_bdlora,
        nblocks=adapter.bd_nblocks,
        total_params=adapter.params,
        dense_stored=sorted({name.rsplit(".", 1)[-1] for name, m in adapter.modules.items() if m.structure}),
        native_tp=adapter.bd_nblocks if adapter.has_structure else None,
        tp_degrees=adapter.tp_degrees(),
        modules=rows,
    )


def module_table(info: dict) -> list[str]:
    """Markdown rows of `describe(...)["modules"]`: what `bdlora inspect` prints and the model card shows."""
    lines = [
        "| module | count | role | r | A stored | A dense | B stored | B dense | params each |",
        "|---|---:|---|---:|---|---|---|---|---:|",
    ]
    for row in info["modules"]:
        lines.append(
            f"| {row['module']} | {row.get('count', 1)} | {row['role']} | {row['r']} | {tuple(row['A_packed'])} | "
            f"{tuple(row['A_dense'])} | {tuple(row['B_packed'])} | {tuple(row['B_dense'])} | {row['params']:,} |"
        )
    return lines
