"""Pushing an adapter to the Hugging Face Hub with the card made for it: any adapter dir (`bdlora push`) or a finished
run's (a recipe's `push_to_hub`), whose outcome is recorded in the run's metrics.json.

The card for the Hub is composed here: serving/plan.py `serving_lines` for the repo (hub=True: downloaded into a
directory named like the repo), rendered by cards.py. hub.py is the upload alone (checks, one commit, its errors), so
it sits beside the card's pieces and below the training run that calls it.
"""

from __future__ import annotations

import json
from pathlib import Path

from bdlora_train import cards, hub
from bdlora_train.core.errors import HubError
from bdlora_train.serving.plan import serving_lines
from bdlora_train.train import rundir


def hub_card(adapter_dir: str | Path, adapter, repo_id: str) -> str:
    """The card of `adapter_dir` (its `read_adapter`) as it goes up to `repo_id`: snippet, serve lines and title name
    the repo."""
    serving = serving_lines(adapter, cards.card_base(adapter), repo_id, hub=True)
    return cards.model_card(adapter_dir, serving, repo_id=repo_id, adapter=adapter)


def push_adapter(
    adapter_dir: str | Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """One Hub commit of the adapter dir with its card for `repo_id` (hub.py `push_adapter`); the commit URL."""
    return hub.push_adapter(
        adapter_dir, repo_id, lambda adapter: hub_card(adapter_dir, adapter, repo_id), private, revision, commit_message
    )


def push_run(adapter_dir: Path, repo_id: str, private: bool, metrics: dict, output_dir: Path) -> None:
    """Push a finished run's adapter and record the outcome in metrics.json (rundir.record_push): a failure keeps the
    adapter, says so with the `bdlora push` line that retries it, and leaves `"pushed": false`, so re-running the same
    train command retries the push instead of reporting nothing to do."""
    retry = hub.retry_command(adapter_dir, repo_id, private=private)
    try:
        url = push_adapter(adapter_dir, repo_id, private=private)
    except HubError as err:  # the trained adapter is safe on disk: say so, and how to retry
        rundir.record_push(output_dir, metrics, repo_id, None)
        reason = str(err).removeprefix("push: ").split(f"; {hub.RETRY}`")[0]
        raise HubError(
            f"push: training finished and the adapter is in {adapter_dir}, but {reason}; "
            f"{hub.RETRY}`{retry}` (or re-run this train command)"
        ) from None
    rundir.record_push(output_dir, metrics, repo_id, url)
    print(f"bdlora train: pushed {adapter_dir} -> {url}", flush=True)


def record_in_run(adapter: str | Path, repo_id: str, url: str) -> None:
    """The adapter of a `bdlora train` run whose push to this repo failed (metrics.json: `"pushed": false`): record
    that it is pushed now (by `bdlora push`), so re-running the train command finds nothing left to do."""
    adapter_dir = Path(adapter)
    metrics_file = adapter_dir.parent / rundir.METRICS_NAME
    if adapter_dir.name != rundir.ADAPTER_NAME or not metrics_file.is_file():
        return
    try:
        metrics = json.loads(metrics_file.read_text())
    except (OSError, json.JSONDecodeError):
        return
    if isinstance(metrics, dict) and metrics.get("pushed") is False and metrics.get("hub_repo_id") == repo_id:
        rundir.record_push(adapter_dir.parent, metrics, repo_id, url)
