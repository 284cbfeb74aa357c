"""What wrapping one factor gradient as a DTensor costs, the two ways tp_runtime/node.py could do it (CPU, one process):
why `_ShardedLinearFn.backward` builds `DTensor(grad, param._spec, requires_grad=False)` instead of calling
`DTensor.from_local(grad, mesh, placements, run_check=False, shape=..., stride=...)`.

    python scripts/bench_dtensor_grad_wrap.py > eval/bench/dtensor_grad_wrap_cpu.txt

A one-rank gloo mesh (the per-call Python is what differs, not the rank count), a (22, 1024) parameter sharded on
dim 0 like a BD-B factor's A; each line is the mean over 2000 calls under no_grad, as in a backward.
"""

import os
import tempfile
import time

import torch
import torch.distributed as dist


def mean_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            param = distribute_tensor(torch.randn(22, 1024), mesh, [Shard(0)])
            grad = torch.randn(22, 1024)
            print(f"torch {torch.__version__}, load average {os.getloadavg()}")
            with torch.no_grad():
                from_local = mean_us(
                    lambda: DTensor.from_local(
                        grad, mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
                    )
                )
                with_spec = mean_us(lambda: DTensor(grad, param._spec, requires_grad=False))
            print(f"DTensor.from_local(grad, mesh, placements, run_check=False, shape, stride): {from_local:7.1f} us")
            print(f"DTensor(grad, param._spec, requires_grad=False):                        {with_spec:7.1f} us")
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
