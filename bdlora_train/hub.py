"""`bdlora push ADAPTER --repo-id me/name`: share an adapter on the Hugging Face Hub, with its model card (cards.py).

The token comes from HF_TOKEN or `hf auth login` and is never printed.
"""

from __future__ import annotations

import os
from pathlib import Path

from bdlora_train.adapters.reader import read_adapter
from bdlora_train.cards import CARD_NAME, card_base, model_card
from bdlora_train.core.errors import HubError, first_line
from bdlora_train.serving.plan import serving_lines


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


def push_adapter(
    adapter_dir: str | Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """One Hub commit of the adapter dir with a model card for `repo_id`; returns the commit URL.

    Everything is checked first (repo id, adapter files, token); the local adapter directory is never modified:
    the card goes up as bytes next to the files (huggingface_hub's create_commit).
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    adapter_dir = Path(adapter_dir)
    check_repo_id(repo_id)
    adapter = read_adapter(adapter_dir)  # refuses dirs that are not a readable PEFT LoRA adapter
    require_token()
    serving = serving_lines(adapter, card_base(adapter), repo_id, hub=True)
    card = model_card(adapter_dir, serving, repo_id=repo_id).encode()
    files = [
        f for f in sorted(adapter_dir.iterdir()) if f.is_file() and not f.name.startswith(".") and f.name != CARD_NAME
    ]
    operations = [CommitOperationAdd(path_in_repo=f.name, path_or_fileobj=str(f)) for f in files]
    operations.append(CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card))
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
    except _network_errors() as err:  # HTTP / connection errors of huggingface_hub and httpx, one line
        raise HubError(
            f"push: uploading {adapter_dir} to {repo_id} failed ({type(err).__name__}: {first_line(err)}); "
            "check the network and the token's write access, then retry "
            f"`bdlora push {adapter_dir} --repo-id {repo_id}`"
        ) from None
    return str(getattr(commit, "commit_url", commit))


def _network_errors() -> tuple[type[BaseException], ...]:
    """What a Hub call raises when the network, the token or the Hub says no (huggingface_hub's HfHubHTTPError is
    an OSError; httpx's transport errors are not)."""
    import httpx

    return (OSError, ValueError, httpx.HTTPError)
