"""Optional lm-evaluation-harness scores for each trained adapter, folded into the compare records.

With a Hub id or local model directory the harness loads the base itself with the saved adapter
(`--model hf --model_args pretrained=BASE,peft=ADAPTER`, its documented PEFT path). The embedded GGUF
model and tiny random models have no such path, so the in-memory PeftModel is wrapped in lm-eval's HFLM.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from bdlora_train.core.errors import CompareError


class LmEvalError(CompareError):
    """lm-eval is missing or a task name it does not know."""


def require() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise LmEvalError(
            "compare: --lm-eval-tasks needs lm-evaluation-harness, which is not installed; "
            "run `pip install 'bdlora-train[lm-eval]'` (or drop --lm-eval-tasks)"
        )


def flatten(results: dict) -> dict[str, float]:
    """{"lm_eval/<task>/<metric>": value} for every numeric metric in simple_evaluate's "results"."""
    out = {}
    for task, scores in (results.get("results") or {}).items():
        for key, value in scores.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "alias":
                out[f"lm_eval/{task}/{key.replace(',none', '')}"] = float(value)
    return out


def evaluate(
    model,
    tokenizer,
    tasks: list[str],
    limit: int | None = None,
    model_spec: str | None = None,
    adapter_dir: Path | None = None,
    batch_size: int = 8,
    include_path: str | None = None,
) -> dict[str, float]:
    """Scores of `tasks` (lm-eval names, or task YAMLs found under `include_path`) for one trained adapter."""
    require()
    import lm_eval
    from lm_eval.tasks import TaskManager

    local_base = model_spec is not None and not model_spec.startswith("tiny:") and model_spec != "embedded"
    if local_base and adapter_dir is not None:
        lm = "hf"
        model_args = f"pretrained={model_spec},peft={adapter_dir}"
        kwargs = dict(model=lm, model_args=model_args)
    else:
        from lm_eval.models.huggingface import HFLM

        kwargs = dict(model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size))
    try:
        manager = TaskManager(include_path=include_path) if include_path else None
        unknown = [t for t in tasks if manager is not None and t not in manager.all_tasks]
        if unknown:
            raise KeyError(unknown[0])
        results = lm_eval.simple_evaluate(
            tasks=list(tasks), limit=limit, batch_size=batch_size, task_manager=manager, **kwargs
        )
    except KeyError as err:
        raise LmEvalError(f"compare: lm-eval does not know task {err}; list tasks with `lm_eval ls tasks`") from None
    return flatten(results or {})
