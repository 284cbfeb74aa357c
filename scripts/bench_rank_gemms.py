"""The rank-r GEMMs of a LoRA layer in both orientations, one thread, fp32 on CPU: why the BD-LoRA kernel
(kernels/bdlora.py) computes h = x A^T and grad_h as (r, T) tensors and hands them on transposed (the output's last
dimension a long one).

    python scripts/bench_rank_gemms.py > eval/bench/rank_gemms_cpu.txt

Each line: the product as written, its median time over 20 calls, and its share of the frozen base GEMM x W^T of
the same layer. T tokens, d_in -> d_out the layer, k the rank per block.
"""

import os
import statistics
import time

import torch


def median_ms(fn, n: int = 20) -> float:
    fn(), fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, fp32, load average {os.getloadavg()}")
    shapes = [(2048, 1024, 512, 11), (2048, 1024, 1408, 11), (2048, 1408, 1024, 11), (256, 1024, 512, 11)]
    for tokens, d_in, d_out, k in shapes:
        x, w = torch.randn(tokens, d_in), torch.randn(d_out, d_in)
        a, b = torch.randn(k, d_in), torch.randn(d_out, k)
        g, out, gx = torch.randn(tokens, d_out), torch.randn(tokens, d_out), torch.randn(tokens, d_in)
        h_t, gh_t = torch.randn(k, tokens), torch.randn(k, tokens)
        h, gh = h_t.t().contiguous(), gh_t.t().contiguous()
        base = median_ms(lambda: x @ w.t())
        print(f"\nT={tokens} {d_in}->{d_out} k={k}: base GEMM x W^T {base:.2f} ms")
        for name, fn in {
            "forward  h = x A^T           ": lambda: x @ a.t(),
            "forward  h = (A x^T)^T       ": lambda: a @ x.t(),
            "forward  out += h B^T        ": lambda: out.addmm_(h, b.t()),
            "backward grad_h = g B        ": lambda: g @ b,
            "backward grad_h = (B^T g^T)^T": lambda: b.t() @ g.t(),
            "backward grad_B = g^T h      ": lambda: g.t() @ h,
            "backward grad_B = (h^T g)^T  ": lambda: h_t @ g,
            "backward grad_A = grad_h^T x ": lambda: gh_t @ x,
            "backward grad_x += grad_h A  ": lambda: gx.addmm_(gh, a),
        }.items():
            ms = median_ms(fn)
            print(f"   {name} {ms:7.3f} ms  {100 * ms / base:5.1f}%")


if __name__ == "__main__":
    main()
