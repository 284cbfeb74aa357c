"""What fusing sibling projections' adapters would save: q/k/v (and gate/up) read the same input x, so their rank-r
GEMMs against x could run as one GEMM over the stacked factors instead of one per projection.

    python scripts/bench_shared_input.py > eval/bench/shared_input_cpu.txt

Issue 29's layer (Llama 1024 -> 2816, 512 tokens), one thread, fp32. For each group and rank, three products, each
timed as the toolkit's layer runs it (one per projection) and stacked (one for the group):
  forward  h = x A^T          (A x^T per projection; [A_q; A_k; A_v] x^T stacked)
  backward grad_A = grad_h^T x
  backward grad_x += grad_h A (accumulated into the input gradient in place)
Before every timed call a 64 MB buffer is rewritten and the frozen projection's GEMM x W^T runs, so x is as cold as
in a training step. Median of 25 calls. The last lines sum the saving over a 2-layer model's step.
"""

import os
import statistics
import time

import torch

TOKENS, HIDDEN, INTER, RANKS = 512, 1024, 2816, (16, 28)
GROUPS = {"q, k, v": (1024, 256, 256), "gate, up": (INTER, INTER)}  # d_out of each sibling


def median_ms(fn, prepare, n: int = 25) -> float:
    times = []
    for i in range(n + 2):
        prepare()
        start = time.perf_counter()
        fn()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, 1 thread, fp32, {TOKENS} tokens, load average {os.getloadavg()}")
    flush = [torch.randn(4_000_000) for _ in range(4)]
    x, grad_x = torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, HIDDEN)
    saved_per_layer = {r: 0.0 for r in RANKS}
    for group, d_outs in GROUPS.items():
        weight = torch.randn(d_outs[0], HIDDEN)

        def prepare():
            for buf in flush:
                buf.add_(1)
            torch.nn.functional.linear(x, weight)

        for r in RANKS:
            factors = [torch.randn(r, HIDDEN) for _ in d_outs]
            grads_h = [torch.randn(TOKENS, r) for _ in d_outs]
            stacked, stacked_grad_h = torch.cat(factors), torch.cat(grads_h, dim=1)
            products = {
                "forward  h = x A^T          ": (
                    lambda: [torch.mm(a, x.t()) for a in factors],
                    lambda: torch.mm(stacked, x.t()),
                ),
                "backward grad_A = grad_h^T x": (
                    lambda: [torch.mm(g.t(), x) for g in grads_h],
                    lambda: torch.mm(stacked_grad_h.t(), x),
                ),
                "backward grad_x += grad_h A ": (
                    lambda: [grad_x.addmm_(g, a) for g, a in zip(grads_h, factors)],
                    lambda: grad_x.addmm_(stacked_grad_h, stacked),
                ),
            }
            print(f"\n{group} (d_out {', '.join(map(str, d_outs))}), r {r}: one per projection vs stacked, ms")
            for name, (apart, together) in products.items():
                t_apart, t_together = median_ms(apart, prepare), median_ms(together, prepare)
                saved_per_layer[r] += t_apart - t_together
                print(f"   {name} {t_apart:6.3f}  {t_together:6.3f}  saves {t_apart - t_together:6.3f}")
    print()
    for r, saved in saved_per_layer.items():
        print(f"r {r}: stacking saves {saved:.2f} ms per decoder layer, {2 * saved:.2f} ms per 2-layer step")


if __name__ == "__main__":
    main()
