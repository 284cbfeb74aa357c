"""The prompt stream asynchronous rollouts predict the next steps with (bdlora_train/rl/lookahead.py), against a
stand-in for the trainer's dataloader: a sampler seeded once whose generator moves on each epoch (as TRL's
RepeatSampler's does), each generation batch yielded `every` times."""

from __future__ import annotations

import torch

from bdlora_train.rl.lookahead import PromptStream, in_background


class Loader:
    """10 prompts, 2 per batch, a new permutation each epoch from one seeded generator; each batch `every` times."""

    def __init__(self, every: int = 1, seed: int = 0):
        self.every, self.generator = every, torch.Generator().manual_seed(seed)

    def __iter__(self):
        order = torch.randperm(10, generator=self.generator).tolist()
        for start in range(0, 10, 2):
            batch = [{"prompt": f"p{i}", "answer": str(i)} for i in order[start:start + 2]]
            for _ in range(self.every):
                yield batch


def _trainer_order(every: int, generations: int) -> list[list[str]]:
    """The prompts of each generation as the trainer's own loop meets them (its own loader, epoch after epoch)."""
    loader, out = Loader(every), []
    while len(out) < generations:
        for i, batch in enumerate(loader):
            if i % every == 0:
                out.append([row["prompt"] for row in batch])
    return out[:generations]


def test_the_stream_predicts_the_next_generations_across_epochs():
    for every in (1, 3):
        order = _trainer_order(every, 13)  # 2.6 epochs: the sampler's later permutations too
        stream = PromptStream(lambda every=every: Loader(every), every, horizon=100)
        for k in range(11):
            assert stream.upcoming(order[k], 2) == order[k + 1:k + 3], (every, k)


def test_a_resumed_trainer_is_found_where_it_is_and_an_unknown_order_stops_the_predictions():
    order = _trainer_order(1, 12)
    stream = PromptStream(Loader, 1, horizon=100)
    assert stream.upcoming(order[7], 1) == [order[8]]  # the trainer skipped 7 generations: found by searching
    assert stream.upcoming(order[8], 3) == order[9:12]
    lost = PromptStream(Loader, 1, horizon=100)
    assert lost.upcoming(["not", "in the data"], 1) is None
    assert lost.upcoming(order[0], 1) is None  # lost stays lost: the run samples synchronously from there
    assert PromptStream(Loader, 1, horizon=3).upcoming(order[7], 1) is None  # beyond the horizon


def test_a_request_in_the_background_hands_over_its_answer_or_its_error():
    assert in_background(lambda: 42).result(timeout=10) == 42
    failed = in_background(lambda: 1 / 0)
    assert isinstance(failed.exception(timeout=10), ZeroDivisionError)
