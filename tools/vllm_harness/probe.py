"""Count the tensor-parallel group's collectives inside vLLM's workers (tests and benchmarks only).

Run through `LLM.collective_rpc(fn)` (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1: the function is pickled by
reference to this module). Every collective of vLLM's TP `GroupCoordinator` is wrapped on the instance, which
is what `tensor_model_parallel_all_reduce` / `_all_gather` / `_gather` call (`vllm/distributed/
communication_op.py`), so the base layers' and the LoRA layers' collectives are both seen.
"""

from __future__ import annotations

from collections import Counter

OPS = ("all_reduce", "all_gather", "all_gatherv", "gather", "reduce_scatter", "reduce_scatterv", "broadcast",
       "broadcast_tensor_dict", "send", "recv", "send_tensor_dict", "recv_tensor_dict")


def install_counter(worker=None) -> bool:
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if getattr(group, "_bdlora_counts", None) is not None:
        group._bdlora_counts.clear()
        return False
    counts: Counter = Counter()
    for op in OPS:
        original = getattr(group, op, None)
        if original is None:
            continue

        def counted(*args, _op=op, _original=original, **kwargs):
            counts[_op] += 1
            return _original(*args, **kwargs)

        setattr(group, op, counted)
    group._bdlora_counts = counts
    return True


def reset_counter(worker=None) -> None:
    from vllm.distributed.parallel_state import get_tp_group

    get_tp_group()._bdlora_counts.clear()


def read_counter(worker=None) -> dict:
    from vllm.distributed.parallel_state import get_tp_group

    return dict(get_tp_group()._bdlora_counts)
