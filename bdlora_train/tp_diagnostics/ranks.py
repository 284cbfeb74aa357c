"""Spawn N ranks (gloo on CPU, NCCL with one GPU each) that run a job function, count the collectives they issue, and
measure what one step allocates (`step_peak_bytes`).

Used by the forward check and benchmark (harness.py) and the training-step check and benchmark (train_check.py).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import tempfile
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bdlora_train.core.errors import TPError

# Library chatter that says nothing about a check: CommDebugMode's module tracker on ModelOutput objects, PEFT looking
# for a config.json of a "tiny:" spec, transformers deprecations reached through PEFT.
_QUIET = (
    "For backward hooks to be called",
    "Could not find a config file",
    "`is_gradient_checkpointing` is deprecated",
)


def quiet_warnings() -> None:
    """A check's output is its table: no library warnings above, no weight-loading progress bars."""
    from transformers.utils import logging as transformers_logging

    for message in _QUIET:
        warnings.filterwarnings("ignore", message=message)
    transformers_logging.disable_progress_bar()


def comm_counter():
    """A dispatch mode counting every collective (calls, per-op counts, bytes handed to it on this rank).

    Like torch's CommDebugMode (same op tables) but without its per-module tracker, which raises IndexError on
    models whose modules finish out of the order they started in (Phi-2, Llama-4): only totals are needed here.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops
    from torch.utils._python_dispatch import TorchDispatchMode

    collectives = set(NATIVE_TO_PY_MAPPING) | set(NATIVE_TO_PY_MAPPING.values()) | set(c10d_collective_ops)

    class CollectiveCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts: dict = {}
            self.comm_bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **(kwargs or {}))
            if any(t is DTensor for t in types):
                return NotImplemented  # let DTensor decompose into the collectives it needs, then count those
            out = func(*args, **(kwargs or {}))
            packet = func._overloadpacket
            if packet in collectives:
                packet = NATIVE_TO_PY_MAPPING.get(packet, packet)
                self.counts[packet] = self.counts.get(packet, 0) + 1
                first = args[0] if args else None  # funcol ops take the buffer first; c10d ops a list of tensors
                tensors = first if isinstance(first, (list, tuple)) else [first]
                self.comm_bytes += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            return out

        def get_total_counts(self) -> int:
            return sum(self.counts.values())

        def get_comm_counts(self) -> dict:
            return dict(self.counts)

    return CollectiveCounter()


@contextlib.contextmanager
def quiet_native_output():
    """The profiler's C++ side logs start/stop lines straight to fds 1 and 2; keep them out of the table."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def step_peak_bytes(step, device: torch.device) -> int:
    """High-water mark of memory allocated during one call of `step`, above what was live before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    # CPU has no allocator counter: replay the profiler's allocation/free events in time order.
    with (
        quiet_native_output(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        step()
    events = sorted(
        ((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda t: t[0],
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def token_ids(config, batch: int, tokens: int, seed: int) -> torch.Tensor:
    """Random token ids, without a multimodal model's image/audio placeholder ids (they need pixel inputs)."""
    vocab = config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    special = {
        v
        for k, v in vars(config).items()
        if isinstance(v, int) and k.endswith(("token_index", "token_id")) and k not in ("pad_token_id", "eos_token_id")
    }
    for value in special:
        ids[ids == value] = 1
    return ids


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: elementwise ratios blow up near zero logits."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _rank_main(rank: int, world: int, init_file: str, job_name: str, jobs: list[dict], out_dir: str, device: str):
    import importlib

    from torch.distributed.device_mesh import init_device_mesh

    from bdlora_train.core.chatter import quiet_library_chatter

    quiet_library_chatter()  # before the job's module imports PEFT (and torchao)
    module, _, name = job_name.partition(":")
    job_fn = getattr(importlib.import_module(module), name)
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    quiet_warnings()
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=10),
    )
    try:
        if dist.get_world_size() != world:
            raise RuntimeError(f"tp: world size {dist.get_world_size()} != --tp {world}")
        mesh = init_device_mesh(device, (world,))
        results = [job_fn({**job, "device": device}, mesh) for job in jobs]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        del mesh
    finally:
        dist.destroy_process_group()
        # The process group's last references (the mesh, DTensors in reference cycles) go now, while the interpreter is
        # whole: left to interpreter exit, gloo's teardown aborted the rank ("terminate called without an active
        # exception", no Python frame) in about one bench_tp run in eight on a 2-CPU host.
        gc.collect()


def _rank_failure(text: str) -> str:
    """One line for a rank that died: the exception it raised (the last line of its traceback)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if any("bootstrapping phase" in line for line in lines):
        return "tp: ranks could not start: call tp_check / bench_tp under `if __name__ == '__main__':` in scripts"
    return f"tp: a rank failed: {lines[-1] if lines else 'no message'}"


def machine_record(device: str, tp: int) -> dict:
    """What a benchmark record says about the machine it ran on (shared CPUs make the load part of the result)."""
    return dict(
        device=device,
        threads_per_rank=max(1, (os.cpu_count() or 1) // tp),
        torch=torch.__version__,
        cpu_count=os.cpu_count(),
        load_average=[round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    )


def timing_row(tokens: int, modes, wall: dict, cpu: dict, counts: dict, compared) -> dict:
    """One benchmark row from this rank's per-repeat wall and CPU seconds per mode (collective: every rank calls it):
    a repeat's time is its slowest rank's; medians, minimum, the counted collectives, and each of `compared`'s ratio
    to the base."""
    import statistics

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (wall, cpu))  # after timing, so the gather is not timed
    row = dict(tokens=tokens)
    for mode in modes:
        per_iter = [max(times) for times in zip(*(rank[0][mode] for rank in everyone))]
        per_iter_cpu = [max(times) for times in zip(*(rank[1][mode] for rank in everyone))]
        row[f"{mode}_ms"] = 1000 * statistics.median(per_iter)
        row[f"{mode}_min_ms"] = 1000 * min(per_iter)
        row[f"{mode}_cpu_ms"] = 1000 * statistics.median(per_iter_cpu)
        row[f"{mode}_collectives"], row[f"{mode}_bytes"] = counts[mode]
    for mode in compared:
        row[f"{mode}_ratio"] = row[f"{mode}_ms"] / row["base_ms"]
        row[f"{mode}_cpu_ratio"] = row[f"{mode}_cpu_ms"] / row["base_cpu_ms"]
    return row


def check_tp_degree(tp: int) -> None:
    """Every TP check and benchmark compares sharded ranks with the unsharded model: one rank has nothing to compare."""
    if tp < 2:
        raise TPError(
            f"tp: --tp {tp}: with one rank nothing is sharded and no collective runs, so there is nothing to check or "
            "time; use --tp 2 or more (the adapter's nblocks or a divisor of it)"
        )


def check_device(device: str, tp: int) -> None:
    """The ranks' device: gloo on CPU, or NCCL with one GPU per rank (before anything is built for them)."""
    if device not in ("cpu", "cuda"):
        raise TPError(f"tp: --device {device!r}; use 'cpu' (gloo) or 'cuda' (NCCL, one GPU per rank)")
    if device == "cuda" and torch.cuda.device_count() < tp:
        raise TPError(
            f"tp: --device cuda needs {tp} GPUs for --tp {tp}, found {torch.cuda.device_count()}; use --device cpu"
        )


def launch(job_fn, jobs: list[dict], tp: int, device: str = "cpu") -> list[list[dict]]:
    """Spawn `tp` ranks (gloo on CPU, NCCL with one GPU each), each running `job_fn(job, mesh)` (a module-level
    function: the rank imports it by name) for every job; every rank's results once all reported."""
    import torch.multiprocessing as mp

    check_device(device, tp)

    job_name = f"{job_fn.__module__}:{job_fn.__qualname__}"  # imported by name in the rank, after quieting
    with tempfile.TemporaryDirectory(prefix="bdlora-tp-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        try:
            mp.start_processes(
                _rank_main,
                args=(tp, init_file, job_name, jobs, tmp, device),
                nprocs=tp,
                join=True,
                start_method="spawn",
            )
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            raise TPError(_rank_failure(str(err))) from None
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(tp)]
    for results in per_rank:
        for result in results:
            if result["world_size"] != tp:
                raise RuntimeError(f"tp: a rank ran with world size {result['world_size']}, expected {tp}")
    return per_rank
