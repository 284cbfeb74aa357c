"""How far did each adapter move each layer? ||scaling * B A||_F per projection, from saved adapters.

    python eval/results/smollm2-135m-tuned/diag/update_norms.py OUT.json RUN_DIR [RUN_DIR ...]

RUN_DIR is a `bdlora compare` run directory (runs/<run_id>/ with adapter/ and record.json). For every adapter it
writes the Frobenius norm of the learned weight update dW = scaling * B A (B and A dense, block-diagonal factors
expanded), averaged over the 30 layers, per projection (q, k, v, gate, up: column-parallel, BD-B; o, down:
row-parallel, BD-A), next to the run's validation/test scores. B starts at zero, so dW is the whole update.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from bdlora_train.adapters.reader import read_adapter


def norms(run_dir: Path) -> dict:
    adapter = read_adapter(run_dir / "adapter")
    per_proj: dict[str, list[float]] = defaultdict(list)
    for name, module in adapter.modules.items():
        proj = re.sub(r".*\.", "", name)
        per_proj[proj].append(module.delta_weight().norm().item())
    record = json.loads((run_dir / "record.json").read_text())
    return {
        "run_id": record["run_id"],
        "method": record["method"],
        "r": record["r"],
        "setting": record.get("setting", {}),
        "val": record.get("val_metrics", {}),
        "test": record["metrics"],
        "dW_fro_mean": {p: sum(v) / len(v) for p, v in sorted(per_proj.items())},
    }


def main(argv: list[str]) -> None:
    out, dirs = Path(argv[0]), [Path(d) for d in argv[1:]]
    rows = [norms(d) for d in dirs if (d / "adapter").is_dir() and (d / "record.json").is_file()]
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out} ({len(rows)} adapters)")


if __name__ == "__main__":
    main(sys.argv[1:])
