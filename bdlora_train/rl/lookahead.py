"""What asynchronous rollouts (`max_staleness` > 0, rl/rollouts.py) need besides the server: the prompts of the
steps to come, and requests that run while the trainer trains.

TRL hands a rollout function the prompts of the step it is at, never the next ones. `PromptStream` reads them from a
second pass over the trainer's own data order: the trainer's `get_train_dataloader()` again (its sampler is seeded,
so a second one yields the same batches; under DDP and TP the same per-rank split), one batch per generation. A
prediction is only ever used after the step's real prompts equal it (rl/rollouts.py compares them); where they do
not (a resumed run, whose trainer skips batches the stream has not), the stream realigns on the real prompts, and
after a miss it finds no more it stops predicting and the run samples synchronously.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass


class PromptStream:
    """`loader()`: a second dataloader of the trainer's (made at the first prediction; iterated again for each epoch,
    as the trainer iterates its own, so its seeded sampler draws the same permutation per epoch); `every`: the
    dataloader batches per generation (TRL's steps_per_generation x num_iterations: TRL repeats each generation batch
    that many times); `horizon`: how many generations to search for the real prompts when realigning."""

    def __init__(self, loader: Callable[[], Iterable], every: int, horizon: int):
        self.loader, self.every, self.horizon = loader, every, horizon
        self.passes: Iterator[list] | None = None
        self.queue: deque[list] = deque()  # predicted prompts of the next generations, in order
        self.lost = False  # realigning failed: no more predictions

    def _prompts(self) -> Iterator[list]:
        loader = self.loader()
        while True:  # epoch after epoch, as the trainer's loop iterates its dataloader again
            empty = True
            for i, batch in enumerate(loader):
                empty = False
                if i % self.every == 0:
                    yield [row["prompt"] for row in batch]
            if empty:
                return

    def upcoming(self, current: list, count: int) -> list[list] | None:
        """The prompts of the `count` generations after the one whose prompts are `current`, or None when the stream
        cannot say (it lost the trainer's order)."""
        if self.lost:
            return None
        if self.queue and self.queue[0] == current:
            self.queue.popleft()
        elif not self._realign(current):
            self.lost = True
            return None
        while len(self.queue) < count:
            nxt = next(self.passes, None)
            if nxt is None:
                break
            self.queue.append(nxt)
        return list(self.queue)[:count]

    def _realign(self, current: list) -> bool:
        if self.passes is None:
            self.passes = self._prompts()
        self.queue.clear()
        for _ in range(self.horizon):
            nxt = next(self.passes, None)
            if nxt is None:
                return False
            if nxt == current:
                return True
        return False


@dataclass
class InFlight:
    """A request sent ahead: the prompts it samples, the adapter version it samples under, its answer (None on a
    rank that does not ask: a TP peer receives its group's completions)."""

    prompts: list
    version: int
    answer: Future | None


def in_background(work: Callable[[], object]) -> Future:
    """`work()` on a daemon thread (a request the trainer does not wait for; a run that stops does not wait for it
    either); its result or exception in the Future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as err:  # handed to whoever waits on it
            future.set_exception(err)

    threading.Thread(target=run, daemon=True).start()
    return future
