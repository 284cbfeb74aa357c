"""rl/ranks.py over four real gloo processes laid out as two TP groups of two (ranks {0,1} and {2,3}): the agreements
every rank reaches, and a TP group's completions passed from its asking rank to its peer exactly (float64)."""

import os

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.launching import free_port

WORLD, TP = 4, 2


def _worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from bdlora_train.rl.ranks import Ranks

    groups = [dist.new_group([g * TP + i for i in range(TP)]) for g in range(WORLD // TP)]
    ranks = Ranks(groups[rank // TP])
    # the asking rank's completions: uneven lengths, log-probs that float32 could not carry
    mine = ([[rank, 7, 9], [11]], [[-0.1 - 1e-12 * rank, -2.0, -3.5], [-1e-300]])
    ids, lps = ranks.share_samples(*(mine if ranks.asks else (None, None)))
    results[rank] = {
        "sampler": (ranks.sampler, ranks.samplers, ranks.asks, ranks.is_main),
        "any": (ranks.any(rank == 3), ranks.any(False)),
        "max": (ranks.max(float(rank)), ranks.max(float("nan") if rank == 2 else 0.0)),
        "main_value": ranks.main_value(1000 + rank),
        "shared": (ids, lps),
    }
    dist.destroy_process_group()


def test_agreements_and_shared_samples_over_two_tp_groups():
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), results), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        got = results[rank]
        group_main = rank // TP * TP  # the asking rank of this rank's group
        assert got["sampler"] == (rank // TP, WORLD // TP, rank % TP == 0, rank == 0)
        assert got["any"] == (True, False)
        assert got["max"][0] == 3.0 and got["max"][1] != got["max"][1]  # NaN on one rank: NaN on all
        assert got["main_value"] == 1000
        ids, lps = got["shared"]
        assert ids == [[group_main, 7, 9], [11]]
        assert lps == [[-0.1 - 1e-12 * group_main, -2.0, -3.5], [-1e-300]]


def test_one_process_is_a_no_op():
    from bdlora_train.rl.ranks import Ranks

    assert not dist.is_initialized()
    ranks = Ranks()
    assert (ranks.rank, ranks.world, ranks.sampler, ranks.samplers, ranks.asks, ranks.is_main) == (0, 1, 0, 1, True,
                                                                                                   True)
    assert ranks.any(True) and not ranks.any(False) and ranks.max(2.5) == 2.5 and ranks.main_value(5) == 5
    assert ranks.share_samples([[1]], [[-1.0]]) == ([[1]], [[-1.0]])
