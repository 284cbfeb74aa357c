"""The runs a `bdlora compare` sweep plans: `Run` (one task x method x rank x seed x grid point, and its run id) and
`plan_runs`, which orders them so a sweep cut short still compares every method at its first seeds and points."""

from __future__ import annotations

import dataclasses
import re

from bdlora_train.comparison import grid
from bdlora_train.recipe.methods import BD_METHODS

DEFAULT_METHODS = ("lora", "bdlora")


@dataclasses.dataclass(frozen=True)
class Run:
    task: str
    method: str  # "lora" | "bdlora" | "peft-bdlora" | "base" (the model without adapter)
    r: int
    nblocks: int
    seed: int
    setting: tuple = ()  # the grid point: ((recipe key, value), ...); () without a grid

    @property
    def run_id(self) -> str:
        task = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.task)
        if self.method == "base":
            return f"{task}-base"
        shape = f"r{self.r}" + (f"-nb{self.nblocks}" if self.method in BD_METHODS else "")
        return f"{task}-{self.method}-{shape}-s{self.seed}" + grid.run_suffix(dict(self.setting))


def plan_runs(
    tasks, plan, seeds, with_base: bool, methods=DEFAULT_METHODS, settings=((),), budgets=None, only=None
) -> list[Run]:
    """Seed-major order: a sweep cut short still has every task and budget at its first seeds. Within a seed the
    grid points come in the order given, each for every adapter, so a grid cut short still compares every method
    at its first points (list the most promising first).

    budgets: {method: BD budgets it trains} (default: matched and double for every BD method). only: {(task,
    method, r): setting} restricts each adapter to one setting (the chosen one, for seeds after --grid-seeds).
    """
    runs: list[Run] = [Run(task, "base", 0, 1, 0) for task in tasks] if with_base else []
    seen = set(runs)
    adapters = []  # (method, spec) in table order
    for entry in plan:
        for budget in grid.BUDGETS:
            for method in methods:
                if (method == "lora") != (budget == "lora"):
                    continue
                if budget == "lora" or budget in (budgets or {}).get(method, grid.BUDGETS):
                    adapters.append((method, entry[budget]))
    for seed in seeds:
        for task in tasks:
            for setting in settings:
                for method, spec in adapters:
                    if only is not None:
                        if (task, method, spec["r"]) not in only:
                            continue
                        setting = tuple(only[(task, method, spec["r"])].items())
                    own = tuple(grid.for_method(dict(setting), method).items())
                    run = Run(task, method, spec["r"], spec["nblocks"], seed, own)
                    if run not in seen:
                        seen.add(run)
                        runs.append(run)
    return runs
