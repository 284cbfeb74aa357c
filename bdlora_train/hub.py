"""The Hugging Face Hub upload of an adapter dir with the model card its caller renders (train/push.py composes it:
cards.py renders, serving/plan.py gives the serve lines), for `bdlora push` and a recipe's `push_to_hub`.

The token comes from HF_TOKEN or `hf auth login` and is never printed (nor any text that holds it). Every Hub
failure is one HubError line naming the repo, what went wrong (no answer, 401, 403, 409, 429, 5xx) and what to do,
ending with the `bdlora push` line that retries it. The endpoint is asked once first, with a short timeout
(models/reach.py), so an unreachable Hub answers in seconds instead of after huggingface_hub's retries.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from pathlib import Path

from bdlora_train.adapters.reader import CONFIG_NAME, read_adapter
from bdlora_train.core.boundary import network_errors
from bdlora_train.core.errors import HubError, first_line
from bdlora_train.models import reach

RETRY = "then retry "  # every failed upload's message ends with it and the `bdlora push` line
_MODEL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def require_token() -> None:
    """Fail before training or uploading when no token can be found (the value itself is never shown)."""
    from huggingface_hub import get_token

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise HubError(
            "push: HF_HUB_OFFLINE=1 is set; unset it (e.g. `HF_HUB_OFFLINE=0 bdlora push ...`) to reach the Hub"
        )
    if not get_token():
        raise HubError("push: no Hugging Face token; set HF_TOKEN or run `hf auth login` (a token with write access)")


def check_repo_id(repo_id: str | None) -> None:
    """One line for a repo id the Hub would refuse; checked before anything is written or sent."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not repo_id or repo_id.count("/") != 1:
        raise HubError(f"push: repo_id={repo_id!r} must look like 'user-or-org/name'")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise HubError(f"push: repo_id={repo_id!r} is not a valid Hub repo id ({first_line(err)})") from None


def retry_command(adapter_dir: str | Path, repo_id: str, private: bool = False, revision: str | None = None) -> str:
    """The exact `bdlora push` line that (re)does this push, quoted for a POSIX shell."""
    line = f"bdlora push {shlex.quote(str(adapter_dir))} --repo-id {shlex.quote(repo_id)}"
    if private:
        line += " --private"
    if revision:
        line += f" --revision {shlex.quote(revision)}"
    return line


def check_adapter_dir(adapter_dir: str | Path) -> None:
    """One line for a directory `bdlora push` cannot upload as an adapter: missing, not a directory, or a merged
    model (config.json and weights, no adapter_config.json). What read_adapter says about the rest stays its own."""
    path = Path(adapter_dir)
    if not path.exists():
        raise HubError(f"push: {adapter_dir} does not exist; pass the adapter directory of a run (e.g. runs/x/adapter)")
    if not path.is_dir():
        raise HubError(f"push: {adapter_dir} is not a directory; pass the adapter directory (e.g. runs/x/adapter)")
    if not (path / CONFIG_NAME).is_file() and (path / "config.json").is_file():
        if any((path / name).is_file() for name in _MODEL_WEIGHTS) or next(path.glob("model-*.safetensors"), None):
            raise HubError(
                f"push: {adapter_dir} is a merged model (config.json and weights, no {CONFIG_NAME}), not an adapter; "
                f"upload it with `hf upload REPO_ID {shlex.quote(str(adapter_dir))}`, or push the adapter it came from"
            )


def push_adapter(
    adapter_dir: str | Path,
    repo_id: str,
    card: Callable[[object], str],
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """One Hub commit of the adapter dir with the model card `card(adapter)` renders for it (`adapter`: the dir's
    `read_adapter`) as README.md; returns the commit URL.

    Everything is checked first (repo id, adapter files, token, whether the Hub answers), and the card is rendered
    after the checks; the local adapter directory is never modified: the card goes up as bytes next to the files
    (huggingface_hub's create_commit).
    """
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.constants import REPOCARD_NAME

    adapter_dir = Path(adapter_dir)
    check_repo_id(repo_id)
    check_adapter_dir(adapter_dir)
    adapter = read_adapter(adapter_dir)  # refuses dirs that are not a readable PEFT LoRA adapter
    require_token()
    retry = retry_command(adapter_dir, repo_id, private, revision)
    if (reason := reach.unreachable_reason()) is not None:
        raise HubError(
            f"push: the Hub at {reach.endpoint()} is unreachable ({reason}), nothing was uploaded to {repo_id}; "
            f"check the network (a proxy, HF_ENDPOINT); {RETRY}`{retry}`"
        )
    text = card(adapter).encode()
    files = [
        f for f in sorted(adapter_dir.iterdir())
        if f.is_file() and not f.name.startswith(".") and f.name != REPOCARD_NAME
    ]
    operations = [CommitOperationAdd(path_in_repo=f.name, path_or_fileobj=str(f)) for f in files]
    operations.append(CommitOperationAdd(path_in_repo=REPOCARD_NAME, path_or_fileobj=text))
    api = HfApi()  # token resolved by huggingface_hub from HF_TOKEN or the login, never passed around here
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.create_commit(
            repo_id=repo_id,
            repo_type="model",
            revision=revision,
            operations=operations,
            commit_message=commit_message or "Upload BD-LoRA adapter (bdlora-train)",
        )
    except _network_errors() as err:
        raise HubError(_hide_token(f"push: {repo_id}: {_what_to_do(err, repo_id)}; {RETRY}`{retry}`")) from None
    return str(getattr(commit, "commit_url", commit))


def _what_to_do(err: BaseException, repo_id: str) -> str:
    """What the Hub said (the status, its short message) and what the user can do about it."""
    response = getattr(err, "response", None)
    status = getattr(response, "status_code", None) if response is not None else None
    said = _server_said(err)
    if status == 401:
        return f"the Hub refused the token (401{said}); set HF_TOKEN to a valid token or run `hf auth login`"
    if status == 403:
        return (
            f"the token may not write to {repo_id} (403{said}); use a token with write access to "
            f"'{repo_id.split('/')[0]}', or push to a repo of your own namespace"
        )
    if status == 404:
        return f"the Hub does not know {repo_id} or the revision (404{said}); check --repo-id and --revision"
    if status == 409:
        return (
            f"the Hub reports a conflict (409{said}): {repo_id} exists with other content (another repo type, or "
            "a concurrent commit); push to another --repo-id (or --revision), or wait for the other commit"
        )
    if status == 429:
        return f"rate limited by the Hub (429{said}); wait a few minutes"
    if status is not None and status >= 500:
        return f"the Hub failed with a server error ({status}{said}); wait and check https://status.huggingface.co"
    if status is not None:
        return f"the Hub refused the upload ({status}{said}); check --repo-id and the token's write access"
    return (
        f"uploading failed ({type(err).__name__}: {first_line(err, 160)}); check the network and the token's "
        "write access"
    )


def _server_said(err: BaseException) -> str:
    message = getattr(err, "server_message", None)
    return f": {first_line(message, 100)}" if message else ""


def _hide_token(text: str) -> str:
    """A message never carries the token, whatever a server echoed back."""
    from huggingface_hub import get_token

    token = get_token()
    return text.replace(token, "<token>") if token else text


def _network_errors() -> tuple[type[BaseException], ...]:
    """What a Hub call raises when the network, the token or the Hub says no (core/boundary.py), and the ValueError
    huggingface_hub raises for a repo it refuses."""
    return (*network_errors(), ValueError)
