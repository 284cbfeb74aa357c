"""The one-node layer (a frozen Linear and its BD-LoRA adapter, forward + backward) against another tree's, in one run.

A change to the BD-LoRA kernel (`kernels/bdlora.py`; `peft_integration/layers.py` before it moved there) that moves
the layer by a millisecond or two is below what whole-model runs on a shared CPU resolve (their overhead's standard
error is 7-20 ms). This loads the other tree's kernel file beside the current one and times both on the same tensors,
interleaved within every round (the order alternates), for each projection of one Llama decoder layer, with the frozen
base layer alone as the floor. Before every timed call a 48 MiB buffer is written, so that, as in a real step, the
call finds its activations out of cache. The clock is this process's CPU time (one thread).

    git worktree add /tmp/before 078b574     # the commit before the adapter-first order (docs/tp.md item 7)
    python scripts/bench_node_ab.py --old /tmp/before --rounds 41
    python scripts/bench_node_ab.py --old /tmp/before --rounds 41 --lora-dropout 0.05

The other tree's one-node entry is called as it has it: `one_node(NodeInputs(...))` where the kernel has its own
module, `_BlockDiagLoraLinearFn.apply(x, dropout, drop_dtype, weight, bias, weight_a, weight_b, scaling, nblocks,
role)` in an older `peft_integration/layers.py`; everything else is imported from this one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bdlora_train.core.files import atomic_write_text
from bdlora_train.core.roles import BD_B
from bdlora_train.kernels import bdlora as new_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_adapters as bench  # noqa: E402  (issue 29's shape, its rank, blocks and tokens)

SHAPE = "llama-1024"
# every projection of one decoder layer, each timed on its own (bench_adapters groups k / v and gate / up)
PROJECTIONS = {
    single: (d_in, d_out, role)
    for names, d_in, d_out, role, _ in bench.projection_shapes(SHAPE)
    for single in names.split(", ")
}


def tree_commit(tree: Path) -> str:
    """The checkout's commit, with "-dirty" when it has uncommitted changes (what "old" and "new" were)."""
    proc = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else "not a git checkout"


KERNEL_FILES = ("bdlora_train/kernels/bdlora.py", "bdlora_train/peft_integration/layers.py")  # newest layout first


def load_tree_kernel(tree: Path):
    """The other tree's kernel module: kernels/bdlora.py, or peft_integration/layers.py in a checkout before the
    kernel moved out of it."""
    path = next((tree / name for name in KERNEL_FILES if (tree / name).is_file()), None)
    if path is None:
        sys.exit(f"bench_node_ab: --old {tree}: no {' or '.join(KERNEL_FILES)} there; pass a checkout's root")
    spec = importlib.util.spec_from_file_location("bench_node_ab_old_kernel", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def node_call(kernel):
    """`call(x, p, weight, weight_a, weight_b, scaling, nblocks, role)` -> the one node's output, as `kernel` spells
    its entry (see the module docstring)."""
    if hasattr(kernel, "NodeInputs"):
        return lambda x, p, weight, a, b, scaling, nblocks, role: kernel.one_node(
            kernel.NodeInputs(x, weight, None, kernel.AdapterFactors(a, b, scaling, nblocks, role), p, x.dtype)
        )
    return lambda x, p, weight, a, b, scaling, nblocks, role: kernel._BlockDiagLoraLinearFn.apply(
        x, p, x.dtype, weight, None, a, b, scaling, nblocks, role
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="root of the other checkout (e.g. a git worktree)")
    parser.add_argument("--tokens", type=int, default=bench.DEFAULT_TOKENS[SHAPE])
    parser.add_argument("--rank", type=int, default=bench.DEFAULT_RANK[SHAPE])
    parser.add_argument("--nblocks", type=int, default=bench.NBLOCKS[SHAPE])
    parser.add_argument("--lora-dropout", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    impls = {"old": node_call(load_tree_kernel(args.old)), "new": node_call(new_kernel)}
    evict = torch.empty(12 * 1024 * 1024)  # 48 MiB: more than this machine's L2 + L3

    def floor(case):
        torch.nn.functional.linear(case["x"], case["weight"]).backward(case["g"])

    def one_node(call):
        def step(case):
            x, factors = case["x"], (case["weight_a"], case["weight_b"], 2.0, args.nblocks, case["role"])
            call(x, args.lora_dropout, case["weight"], *factors).backward(case["g"])

        return step

    cases = {}
    for name, (d_in, d_out, role) in PROJECTIONS.items():
        # PEFT's packing: BD-B's B is (d_out, r / nblocks), BD-A's A is (r, d_in / nblocks)
        shape_a = (args.rank, d_in if role == BD_B else d_in // args.nblocks)
        shape_b = (d_out, args.rank // args.nblocks if role == BD_B else args.rank)
        cases[name] = dict(
            x=torch.randn(args.tokens, d_in, requires_grad=True),
            weight=torch.randn(d_out, d_in) / d_in**0.5,
            weight_a=(torch.randn(shape_a) / d_in**0.5).requires_grad_(),
            weight_b=(torch.randn(shape_b) / args.rank).requires_grad_(),
            g=torch.randn(args.tokens, d_out),
            role=role,
        )
    steps = {"floor": floor, **{label: one_node(apply) for label, apply in impls.items()}}
    times = {name: {label: [] for label in steps} for name in cases}
    for round_ in range(args.rounds + 2):  # the first two rounds warm up
        order = list(steps) if round_ % 2 == 0 else list(reversed(steps))
        for name, case in cases.items():
            for label in order:
                evict.fill_(round_)
                for key in ("x", "weight_a", "weight_b"):
                    case[key].grad = None
                start = time.process_time()
                steps[label](case)
                if round_ >= 2:
                    times[name][label].append(time.process_time() - start)

    def overhead(name, label):  # per round: the variant minus the floor of the same round, ms
        return [1e3 * (a - b) for a, b in zip(times[name][label], times[name]["floor"])]

    rows = []
    layer = {label: [0.0] * args.rounds for label in impls}
    print(
        f"bench_node_ab: torch {torch.__version__}, 1 thread, cpu clock, {args.tokens} tokens, r {args.rank}, "
        f"nblocks {args.nblocks}, lora_dropout {args.lora_dropout}, {args.rounds} rounds, load {os.getloadavg()}"
    )
    commits = dict(old=tree_commit(args.old), new=tree_commit(Path(__file__).resolve().parents[1]))
    print(f"command: python scripts/bench_node_ab.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"old: {args.old} at {commits['old']}; new: this tree at {commits['new']}\n")
    print("| projection | floor ms | old overhead ms | new overhead ms | new / old |")
    print("|---|---:|---:|---:|---:|")
    for name in cases:
        per = {label: overhead(name, label) for label in impls}
        for label in impls:
            layer[label] = [a + b for a, b in zip(layer[label], per[label])]
        old, new = statistics.median(per["old"]), statistics.median(per["new"])
        base = 1e3 * statistics.median(times[name]["floor"])
        rows.append(dict(projection=name, floor_ms=base, old_ms=old, new_ms=new))
        print(f"| {name} | {base:.2f} | {old:.3f} | {new:.3f} | {new / old if old > 0 else float('nan'):.2f} |")
    old, new = statistics.median(layer["old"]), statistics.median(layer["new"])
    wins = sum(n < o for n, o in zip(layer["new"], layer["old"]))
    print(f"| decoder layer (sum per round) | | {old:.3f} | {new:.3f} | {new / old:.2f} |")
    print(f"\nnew below old in {wins} of {args.rounds} rounds (the decoder layer's summed overhead)")
    if args.json:
        record = dict(
            argv=sys.argv[1:] if argv is None else argv,
            commits=commits,
            loadavg=os.getloadavg(),
            rows=rows,
            layer=dict(old_ms=old, new_ms=new, new_below_old_rounds=wins, rounds=args.rounds),
        )
        atomic_write_text(args.json, json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
