"""Reward functions for GRPO (`objective: grpo`): the built-ins, user rewards named `module:function`, weights.

A recipe's `rewards:` lists them; `load_rewards(entries, dataset)` turns that list into the `reward_funcs` and
`reward_weights` that `trl.GRPOTrainer` takes. A user reward has TRL's reward signature:

    def score(prompts, completions, completion_ids, answer, **kwargs) -> list[float | None]:
        return [1.0 if c.strip() == a.strip() else 0.0 for c, a in zip(completions, answer)]

It is called once per batch with keyword arguments only: `prompts` and `completions` (one string each per
completion, or lists of chat messages for conversational data; a prompt repeats once per generation),
`completion_ids` (token ids), one list per other dataset column (`answer`, the row's reference completion, and
any column of your data), and TRL's `trainer_state`, `log_extra` and `log_metric`. It returns one float per
completion, or None for a completion it does not score. A reward that raises, returns the wrong number of values
or a value that is not a finite number stops the run with one RewardError line naming the reward and the row.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from pathlib import Path

from bdlora_train.core.errors import RewardError, first_line

# Task datasets whose rows carry a one-answer `answer` column, scored as the task's own evaluation scores them
# (GenerationTask.evaluate: metrics.accuracy with the task's `match`, first_word for both).
TASK_REWARDS = {"task:arithmetic": ["exact_match"], "task:analogies": ["exact_match"]}
MATCH_MODE = "first_word"
FIX = "name a reward as module:function (a module importable from the current directory) or path/to/file.py:function"


def _text(x) -> str:
    """A prompt or completion as text: a string, or the last message's content of a conversation."""
    if isinstance(x, list) and x and isinstance(x[-1], Mapping):
        return str(x[-1].get("content", ""))
    return x if isinstance(x, str) else str(x)


def exact_match(prompts, completions, answer=None, **kwargs) -> list[float]:
    """1.0 when the completion's first word is the row's `answer` (the tasks' first_word exact match), else 0.0."""
    from bdlora_train.tasks.metrics import exact_match as match  # lazy: the tasks package imports torch

    if answer is None:
        columns = sorted(k for k in kwargs if k not in ("completion_ids", "trainer_state", "log_extra", "log_metric"))
        raise RewardError(
            f"reward exact_match needs an 'answer' column (the reference completion of each row); the data has "
            f"columns {columns}; add one, or name your own reward as module:function"
        )
    return [float(a is not None and match(_text(c), str(a), MATCH_MODE)) for c, a in zip(completions, answer)]


BUILTIN: dict[str, Callable] = {"exact_match": exact_match}


def default_rewards(dataset: str) -> list[str]:
    """The rewards a recipe with `objective: grpo` and no `rewards:` gets: exact_match on the answer tasks."""
    if dataset in TASK_REWARDS:
        return list(TASK_REWARDS[dataset])
    raise RewardError(
        f"recipe: objective=grpo with dataset={dataset} needs rewards: {FIX}, with TRL's reward signature "
        f"fn(prompts, completions, **columns) -> list[float]; built-in: {', '.join(BUILTIN)} (scores an 'answer' "
        f"column; the default for {' and '.join(TASK_REWARDS)})"
    )


# ---------------------------------------------------------------------------------------------- resolving


@contextmanager
def _path_first(entry: str):
    """`entry` first on sys.path for the duration (as `uvicorn app:app` searches the current directory)."""
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        try:
            sys.path.remove(entry)  # the first occurrence: ours, unless the import put the same entry before it
        except ValueError:
            pass


def _import(module: str, spec: str):
    """The module of a user reward: a .py file path, or a module name (current directory searched first)."""
    try:
        if module.endswith(".py"):
            path = Path(module).expanduser().resolve()
            if not path.is_file():
                raise RewardError(f"reward {spec}: no such file {path}; {FIX}")
            name = f"_bdlora_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
            if name in sys.modules:
                return sys.modules[name]
            loader_spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = mod  # dataclasses and pickling look their module up here
            try:
                with _path_first(str(path.parent)):  # the file may import its neighbours
                    loader_spec.loader.exec_module(mod)
            except BaseException:
                del sys.modules[name]
                raise
            return mod
        with _path_first(os.getcwd()):
            return importlib.import_module(module)
    except RewardError:
        raise
    except ModuleNotFoundError as err:
        if err.name and (module == err.name or module.startswith(err.name + ".")):
            raise RewardError(
                f"reward {spec}: module '{module}' not found in the current directory ({os.getcwd()}) or on "
                f"sys.path; {FIX}"
            ) from err
        raise RewardError(f"reward {spec}: importing '{module}' failed: {first_line(err)}; install it") from err
    except Exception as err:
        detail = f"{type(err).__name__}: {first_line(err)}"
        raise RewardError(f"reward {spec}: importing '{module}' raised {detail}") from err


def resolve(spec: str) -> Callable:
    """The function a reward spec names (unwrapped): a built-in name, `module:function` or `file.py:function`."""
    if ":" not in spec:
        if spec in BUILTIN:
            return BUILTIN[spec]
        raise RewardError(f"reward {spec}: not a built-in reward (built-in: {', '.join(BUILTIN)}); {FIX}")
    module, attr = spec.rsplit(":", 1)
    if not module or not attr:
        raise RewardError(f"reward {spec}: give both the module and the function; {FIX}")
    obj = _import(module, spec)
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = getattr(obj, "__dict__", {}).items()
            defined = sorted(k for k, v in names if inspect.isfunction(v) and not k.startswith("_"))
            raise RewardError(f"reward {spec}: '{module}' has no attribute '{part}' (functions: {defined[:10]}); {FIX}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(f"reward {spec}: '{attr}' is a {type(obj).__name__}, not a function; {FIX}")
    return obj


# ---------------------------------------------------------------------------------------------- calling


def _is_async(fn) -> bool:
    """Whether calling `fn` returns a coroutine (as trl's is_async_callable decides: TRL awaits those)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _row(kwargs: dict, i: int) -> str:
    prompts = kwargs.get("prompts")
    prompt = _text(prompts[i]) if isinstance(prompts, list) and i < len(prompts) else "?"
    return f"completion {i} (prompt {prompt[:60]!r})"


def _one_row(kwargs: dict, n: int, i: int) -> dict:
    """TRL's kwargs for completion `i` alone: every per-completion list cut to its i-th entry."""
    return {k: v[i : i + 1] if isinstance(v, list) and len(v) == n else v for k, v in kwargs.items()}


def _raised(spec: str, kwargs: dict, n: int, err: Exception, row: int | None) -> RewardError:
    where = f"on {_row(kwargs, row)}" if row is not None else f"on the batch of {n} completions"
    detail = f"{type(err).__name__}: {first_line(err)}" if str(err).strip() else type(err).__name__
    return RewardError(f"reward {spec} raised {where}: {detail}")


def _same(a: Exception, b: Exception) -> bool:
    return type(a) is type(b) and str(a) == str(b)


def _checked(spec: str, out, kwargs: dict, n: int) -> list[float | None]:
    if isinstance(out, (str, bytes, Mapping)) or not isinstance(out, Iterable):
        raise RewardError(f"reward {spec} returned a {type(out).__name__}; return a list of one float per completion")
    out = list(out)
    if len(out) != n:
        raise RewardError(
            f"reward {spec} returned {len(out)} values for a batch of {n} completions; return one float (or None) "
            f"per completion"
        )
    values: list[float | None] = []
    for i, value in enumerate(out):
        if value is not None and not (isinstance(value, numbers.Real) and math.isfinite(value)):
            raise RewardError(
                f"reward {spec} returned {value!r} ({type(value).__name__}) for {_row(kwargs, i)}; return a finite "
                f"float, or None to leave the completion unscored"
            )
        values.append(None if value is None else float(value))
    return values


def wrap(fn: Callable, spec: str, name: str) -> Callable:
    """`fn` called as TRL calls rewards (kwargs passed through unchanged), its failures one RewardError line.

    When the batch call raises, each completion is replayed alone to find the row that raises the same error;
    when none does, the error names the batch."""
    if _is_async(fn):

        async def reward(**kwargs):
            n = len(kwargs.get("completions", []))
            try:
                out = await fn(**kwargs)
            except RewardError:
                raise
            except Exception as err:
                for i in range(n):
                    try:
                        await fn(**_one_row(kwargs, n, i))
                    except Exception as row_err:
                        if _same(err, row_err):
                            raise _raised(spec, kwargs, n, row_err, i) from row_err
                raise _raised(spec, kwargs, n, err, None) from err
            return _checked(spec, out, kwargs, n)

    else:

        def reward(**kwargs):
            n = len(kwargs.get("completions", []))
            try:
                out = fn(**kwargs)
            except RewardError:
                raise
            except Exception as err:
                for i in range(n):
                    try:
                        fn(**_one_row(kwargs, n, i))
                    except Exception as row_err:
                        if _same(err, row_err):
                            raise _raised(spec, kwargs, n, row_err, i) from row_err
                raise _raised(spec, kwargs, n, err, None) from err
            return _checked(spec, out, kwargs, n)

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = getattr(fn, "__doc__", None)
    reward.spec = spec
    return reward


# ---------------------------------------------------------------------------------------------- the recipe key


def _entry(i: int, entry) -> tuple[str, float]:
    """(spec, weight) of one `rewards:` entry: "spec" or {name: spec, weight: float}."""
    where = f"recipe: rewards[{i}] = {entry!r}"
    if isinstance(entry, Mapping):
        unknown = sorted(map(str, set(entry) - {"name", "weight"}))
        if unknown:
            raise RewardError(f"{where}: unknown key(s) {unknown}; an entry is a name or {{name: ..., weight: ...}}")
        spec, weight = entry.get("name"), entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise RewardError(f"{where}: weight must be a finite number (e.g. weight: 0.5)")
    else:
        spec, weight = entry, 1.0
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"{where}: give the reward as a name (exact_match, module:function) or {{name:, weight:}}")
    return spec.strip(), float(weight)


def _names(specs: list[str]) -> list[str]:
    """Distinct, readable __name__s (TRL logs rewards/<name>/mean): the function's name; when two share it,
    module.function; when those clash too, a _2, _3 suffix."""
    short = [s.rsplit(":", 1)[-1].rsplit(".", 1)[-1] for s in specs]
    names = [
        n if short.count(n) == 1 or ":" not in s else f"{Path(s.rsplit(':', 1)[0]).stem.rsplit('.', 1)[-1]}.{n}"
        for s, n in zip(specs, short)
    ]
    out: list[str] = []
    for name in names:
        candidate, k = name, 2
        while candidate in out:
            candidate, k = f"{name}_{k}", k + 1
        out.append(candidate)
    return out


def load_rewards(entries, dataset: str) -> tuple[list[Callable], list[float]]:
    """(reward_funcs, reward_weights) for trl.GRPOTrainer from a recipe's `rewards:` (empty: default_rewards)."""
    if entries is None or (isinstance(entries, (list, tuple)) and not entries):
        entries = default_rewards(dataset)
    if not isinstance(entries, (list, tuple)):
        raise RewardError(
            f"recipe: rewards = {entries!r} must be a list, e.g. rewards: [exact_match] or "
            f"rewards: [{{name: my_rewards:score, weight: 0.5}}]"
        )
    parsed = [_entry(i, entry) for i, entry in enumerate(entries)]
    specs = [spec for spec, _ in parsed]
    for i, spec in enumerate(specs):
        if spec in specs[:i]:
            raise RewardError(
                f"recipe: rewards[{i}] = {spec!r} is listed twice; list each reward once (weight: counts it more)"
            )
    funcs = [wrap(resolve(spec), spec, name) for spec, name in zip(specs, _names(specs))]
    return funcs, [weight for _, weight in parsed]
