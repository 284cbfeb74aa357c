"""The "walk" of the training path: which of the package's functions and files one tiny `train()` passes through.

    PYTHONPATH=. python scripts/walk_training_path.py --label after --recipe plain \
        --out eval/bench/walk_training_path.json

It trains `Recipe(model="tiny:llama", max_steps=1, lora_r=4, ...)` (`--recipe plain`), or the same with its rank
matched to LoRA r=8's budget (`--recipe matched`: lora_r=None, match_budget_of_lora_rank=8), in this process
(output in a temporary directory, nothing downloaded) under `sys.setprofile`, with `bdlora_train.train.run`
imported beforehand (so the package's own import is not part of the walk), and reports for the package found on
sys.path (PYTHONPATH wins, so two trees can be compared: `git worktree add /tmp/walk-before <commit>`,
`PYTHONPATH=/tmp/walk-before`):

- a *library function* is a Python function whose code lies in a file under bdlora_train/. Module bodies (imports
  run lazily inside a function) and functions of every other library are not part of the walk: a call from a
  library function through transformers back into the package counts as a call from that library function (the
  nearest library frame below it on the stack is its caller);
- an *entry* is a call that starts a library function's frame (a generator or context manager resumed after a
  `yield` is not a new entry);
- stops: distinct library functions entered (by file, qualified name and first line);
- files: distinct library files entered;
- returns: control handed back (a return or a `yield`) from a library frame to a caller that is a library frame of
  another function (returns to the script, recursion, and a comprehension back to the function it is written in
  are not counted);
- climbs: those returns whose caller is in another file than the callee: the walk goes back to a file it had left
  (a re-entry of that file);
- entries of a file: how many times the walk comes into the file from outside it, counted once per calling frame:
  a library function outside the file (a comprehension or generator expression counts as the function it is
  written in) calling into the file while no frame of the file is running. A loop in one caller that calls the
  file's functions (or reads a property defined there) for every module is one entry; a callback into the file
  from a function it called itself (resolve.py's `rank_of` lambda, called by arch/targets.py) is inside the entry
  that is running. Counted for every file (`file_entries`), picked out for peft_integration/resolve.py, arch/targets.py,
  arch/checks.py and budget.py (`entries`);
- entries of a watched function (recipe/methods.py `build_peft_config`, train/run_plan.py `plan_run`, and the two that
  resolve a request into targets, peft_integration/resolve.py `resolve` and arch/targets.py `resolve_targets`): its
  calls
  while it is not running.

- the recipe's walk (`recipe_walk`): the same counts restricted to the frames that hold a `Recipe` among their
  arguments (`self` included), i.e. following `recipe` down from `train()`: stops (distinct functions given the
  recipe), files, returns (a recipe frame handing back to the recipe frame that called it) and climbs (those
  returns that go back into another file).

The counts are deterministic for a tree (no timing enters them); `wall_s` is the profiled run's wall time only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

WATCHED_FILES = ("peft_integration/resolve.py", "arch/targets.py", "arch/checks.py", "budget.py")
WATCHED_FUNCTIONS = (
    ("recipe/methods.py", "build_peft_config"),
    ("train/run_plan.py", "plan_run"),
    ("peft_integration/resolve.py", "resolve"),  # one resolution of an adapter request into targets
    ("arch/targets.py", "resolve_targets"),
)
RECIPES = {
    "plain": dict(lora_r=4),
    "matched": dict(lora_r=None, match_budget_of_lora_rank=8),
}
CO_GENERATOR_LIKE = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR
INLINE = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")  # part of the function they are written in


class Walk:
    """The profiler callback and its counters (see the module docstring for what each counts)."""

    def __init__(self, root: Path):
        self.root = str(root.resolve()) + os.sep
        self.codes: dict = {}  # code object -> (file, qualname, firstline) or None (not a library function)
        self.stack: list = []  # [(frame, key, owner frame, owner key)] of the running library frames, innermost last
        # Both keep their frames alive, so that a frame id is never reused while it is a key here.
        self.entered: dict[int, tuple] = {}  # id(owner frame) -> (the frame, the files it has entered)
        self.suspended: dict[int, object] = {}  # generator frames that yielded (a later "call" resumes them)
        self.stops: set = set()
        self.files: set[str] = set()
        self.returns = 0
        self.climbs = 0
        self.file_entries: dict[str, int] = {}
        self.active: dict[str, int] = {}  # file -> its frames on the stack
        self.function_entries: dict[tuple[str, str], int] = {}
        self.watched = set(WATCHED_FUNCTIONS)
        self.recipe_type = None  # frames holding an instance of it are the recipe's walk
        self.recipe_stack: list = []  # [(frame, key)] of the running frames that hold a recipe
        self.recipe_stops: set = set()
        self.recipe_returns = 0
        self.recipe_climbs = 0

    def key(self, code):
        try:
            return self.codes[code]
        except KeyError:
            pass
        key = None
        if code.co_filename.startswith(self.root) and code.co_name != "<module>":
            key = (code.co_filename[len(self.root) :], code.co_qualname, code.co_firstlineno)
        self.codes[code] = key
        return key

    def __call__(self, frame, event, arg):
        if event == "call":
            key = self.key(frame.f_code)
            if key is None:
                return
            owner, owner_key = frame, key
            if frame.f_code.co_name in INLINE and self.stack:
                owner, owner_key = self.stack[-1][2:]
            caller = self.stack[-1][2] if self.stack else None
            files = self.entered.setdefault(id(caller), (caller, set()))[1] if caller is not None else set()
            outside = not self.active.get(key[0]) and key[0] not in files
            self.stack.append((frame, key, owner, owner_key))
            self.active[key[0]] = self.active.get(key[0], 0) + 1
            if self.suspended.pop(id(frame), None) is frame:  # a generator resumed: not a new entry
                return
            self.stops.add(key)
            self.files.add(key[0])
            if self.recipe_type is not None and any(
                isinstance(value, self.recipe_type) for value in frame.f_locals.values()
            ):
                self.recipe_stack.append((frame, key))
                self.recipe_stops.add(key)
            if outside:
                files.add(key[0])
                self.file_entries[key[0]] = self.file_entries.get(key[0], 0) + 1
            name = (key[0], key[1])
            if name in self.watched and not any(entry[1][:2] == name for entry in self.stack[:-1]):
                self.function_entries[name] = self.function_entries.get(name, 0) + 1
        elif event == "return":
            if not self.stack or self.stack[-1][0] is not frame:
                return  # not a library frame (or one entered before profiling began)
            _, key, owner, owner_key = self.stack.pop()
            if self.recipe_stack and self.recipe_stack[-1][0] is frame:
                self.recipe_stack.pop()
                if self.recipe_stack:
                    self.recipe_returns += 1
                    self.recipe_climbs += self.recipe_stack[-1][1][0] != key[0]
            self.active[key[0]] -= 1
            if owner is frame and not frame.f_code.co_flags & CO_GENERATOR_LIKE:
                self.entered.pop(id(frame), None)  # the frame is done: its id may be reused
            if frame.f_code.co_flags & CO_GENERATOR_LIKE:
                self.suspended[id(frame)] = frame
            caller = self.stack[-1][3] if self.stack else None
            if caller is not None and caller[:2] != owner_key[:2]:
                self.returns += 1
                if caller[0] != key[0]:
                    self.climbs += 1

    def report(self) -> dict:
        return {
            "stops": len(self.stops),
            "files": len(self.files),
            "returns": self.returns,
            "climbs": self.climbs,
            "entries": {
                **{path: self.file_entries.get(path, 0) for path in WATCHED_FILES},
                **{f"{path}:{name}": self.function_entries.get((path, name), 0) for path, name in WATCHED_FUNCTIONS},
            },
            "file_entries": dict(sorted(self.file_entries.items())),
            "recipe_walk": {
                "stops": len(self.recipe_stops),
                "files": len({key[0] for key in self.recipe_stops}),
                "returns": self.recipe_returns,
                "climbs": self.recipe_climbs,
                "functions": sorted(f"{key[0]}:{key[1]}" for key in self.recipe_stops),
            },
        }


def walk(recipe_name: str, max_train_samples: int) -> dict:
    import bdlora_train
    import bdlora_train.train.run as run_module
    from bdlora_train.recipe.schema import Recipe

    root = Path(bdlora_train.__file__).parent
    with tempfile.TemporaryDirectory(prefix="walk-") as tmp:
        keys = dict(
            model="tiny:llama",
            max_steps=1,
            **RECIPES[recipe_name],
            per_device_train_batch_size=4,
            dataset="packaged:tiny_sums.jsonl",
            max_train_samples=max_train_samples,
            save_steps=0,
            logging_steps=1,
            seed=0,
        )
        recipe = Recipe(**keys, output_dir=str(Path(tmp) / "run"))
        profile = Walk(root)
        profile.recipe_type = Recipe
        start = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # Trainer's log dicts: stdout carries the JSON only
            sys.setprofile(profile)
            try:
                result = run_module.train(recipe)
            finally:
                sys.setprofile(None)
        wall = time.perf_counter() - start
    return {
        "package": str(root),
        "recipe": "Recipe(" + ", ".join(f"{k}={v!r}" for k, v in keys.items()) + ", output_dir=<tmp>)",
        "nblocks": result.metrics["nblocks"],
        "r": result.metrics["r"],
        "trainable_params": result.metrics["trainable_params"],
        **profile.report(),
        "wall_s": round(wall, 2),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="now", help="name of this measurement in --out (e.g. before, after)")
    parser.add_argument("--out", default=None, help="JSON file to add the measurement to (kept: other labels)")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="plain", help="which tiny run to walk")
    parser.add_argument("--max-train-samples", type=int, default=16)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    entry = {
        "command": " ".join(
            [f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}", "python", "scripts/walk_training_path.py"]
            + (argv if argv is not None else sys.argv[1:])
        ),
        **walk(args.recipe, args.max_train_samples),
        "python": platform.python_version(),
    }
    print(json.dumps(entry, indent=2))
    if args.out:
        out = Path(args.out)
        data = json.loads(out.read_text()) if out.is_file() else {}
        data.setdefault("script", "scripts/walk_training_path.py (definitions in its docstring)")
        data.setdefault("runs", {}).setdefault(args.label, {})[args.recipe] = entry
        out.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
