"""Wall time of `bdlora <command> --help`, two source trees side by side (e.g. before/after lazy imports).

    git archive <old-commit> bdlora_train | tar -x -C /tmp/old
    python scripts/bench_cli_startup.py --old /tmp/old --new . --rounds 7 --out eval/bench/cli_help_cpu.json

Each round runs every command once per tree, the two trees in alternating order, each in a fresh interpreter with
PYTHONPATH pointing at the tree (it wins over the editable install). Reported: the median wall seconds per command
and tree, and the median of the per-round ratios new / old (paired, so load that moves both cancels out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = ("budget", "train", "compare", "inspect", "export", "push", "check-serving", "tp-check", "bench-tp")
CODE = (
    "import sys\nimport bdlora_train\nassert bdlora_train.__file__.startswith(sys.argv[2]), bdlora_train.__file__\n"
    "from bdlora_train.cli import main\nsys.exit(main([sys.argv[1], '--help']))"
)


def wall(tree: Path, command: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    start = time.perf_counter()
    # from a neutral directory: `python -c` puts the working directory first on sys.path, before PYTHONPATH
    argv = [sys.executable, "-c", CODE, command, str(tree.resolve())]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{tree}: `bdlora {command} --help` failed:\n{done.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="source tree holding the old bdlora_train/")
    parser.add_argument("--new", type=Path, required=True, help="source tree holding the new bdlora_train/")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--commands", nargs="+", default=list(COMMANDS))
    parser.add_argument("--out", help="write the JSON result here too")
    args = parser.parse_args()
    times = {c: {"old": [], "new": []} for c in args.commands}
    for round_ in range(args.rounds):
        for command in args.commands:
            order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
            for name in order:
                times[command][name].append(wall(getattr(args, name), command))
    rows = []
    for command, t in times.items():
        ratios = [n / o for n, o in zip(t["new"], t["old"])]
        rows.append(
            dict(
                command=command,
                old_median_s=round(statistics.median(t["old"]), 3),
                new_median_s=round(statistics.median(t["new"]), 3),
                ratio_median=round(statistics.median(ratios), 3),
                old_s=[round(x, 3) for x in t["old"]],
                new_s=[round(x, 3) for x in t["new"]],
            )
        )
    result = dict(
        command=" ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        python=platform.python_version(),
        cpu_count=os.cpu_count(),
        load_average=[round(x, 2) for x in os.getloadavg()],
        rounds=args.rounds,
        rows=rows,
    )
    print("| command | old s (median) | new s (median) | new / old (median of paired ratios) |")
    print("|---|---:|---:|---:|")
    for row in rows:
        old, new, ratio = row["old_median_s"], row["new_median_s"], row["ratio_median"]
        print(f"| {row['command']} | {old:.2f} | {new:.2f} | {ratio:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
