"""Whether the Hugging Face Hub answers, asked once per process with a short timeout.

huggingface_hub retries a connection error 5 times (sleeping 1+2+4+8+8 s) and its session has no timeout, so every
lookup of a Hub id on a machine without the Hub took half a minute or more, with a "Retrying in ..." line per try.
Here one HEAD request to the endpoint (huggingface_hub's own session, so its proxy and certificate settings apply)
decides: any HTTP answer means reachable; an error or no answer within `PROBE_TIMEOUT_S` means not, and the lookups
of models/specs.py then run cache-only (`local_files_only=True`). HF_HUB_OFFLINE=1 answers "not reachable" without
a request.
"""

from __future__ import annotations

import os

from bdlora_train.core.boundary import network_errors
from bdlora_train.core.errors import first_line

PROBE_TIMEOUT_S = 3.0
_OFFLINE_VALUES = ("1", "true", "yes", "on")
_answers: dict[str, str | None] = {}  # endpoint -> None (it answered) or why not, once per process


def endpoint() -> str:
    """The Hub endpoint huggingface_hub talks to (HF_ENDPOINT, read by huggingface_hub at import)."""
    from huggingface_hub import constants

    return constants.ENDPOINT


def offline_mode() -> bool:
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").lower() in _OFFLINE_VALUES or bool(constants.HF_HUB_OFFLINE)


def unreachable_reason() -> str | None:
    """None when the Hub endpoint answers (any HTTP status), else why not: "HF_HUB_OFFLINE=1 is set" or the
    connection error. The probe runs once per endpoint and process."""
    if offline_mode():
        return "HF_HUB_OFFLINE=1 is set"
    url = endpoint()
    if url not in _answers:
        _answers[url] = _probe(url)
    return _answers[url]


def hub_reachable() -> bool:
    return unreachable_reason() is None


def forget() -> None:
    """Ask again on the next call (tests; a process that changed HF_ENDPOINT)."""
    _answers.clear()


def _probe(url: str) -> str | None:
    from huggingface_hub import get_session

    try:
        get_session().request("HEAD", url, timeout=PROBE_TIMEOUT_S, follow_redirects=False)
    except network_errors() as err:
        if "timeout" in type(err).__name__.lower():  # httpx2 / httpx ReadTimeout, ConnectTimeout
            return f"no answer within {PROBE_TIMEOUT_S:g} s"
        return f"{type(err).__name__}: {first_line(err, 120)}"
    return None


def looks_like_hub_id(spec: str) -> bool:
    """`org/name` (or a bare legacy name) that is not a local path: what transformers would look up on the Hub."""
    from pathlib import Path

    if spec.startswith(("tiny:", ".", "/", "~")) or spec == "embedded" or spec.endswith(".json"):
        return False
    return spec.count("/") <= 1 and not Path(spec).exists()


def cache_only(spec: str) -> dict:
    """Keyword arguments for a transformers `from_pretrained` of `spec`: `local_files_only=True` for a Hub id while
    the Hub does not answer (no retries, no waiting), nothing otherwise."""
    return {"local_files_only": True} if looks_like_hub_id(spec) and not hub_reachable() else {}


def not_cached_message(spec: str, what: str = "model") -> str:
    """The one line for a Hub id that is neither reachable nor in the local cache, with the fix."""
    reason = unreachable_reason() or "it did not answer"
    fix = (
        "unset HF_HUB_OFFLINE"
        if reason.startswith("HF_HUB_OFFLINE")
        else "check the network, a proxy or HF_ENDPOINT"
    )
    return (
        f"--model {spec}: the Hub at {endpoint()} is unreachable ({reason}) and the {what} is not in the local "
        f"Hugging Face cache; {fix}, or run `hf download {spec}` where the Hub is reachable (same HF_HOME), "
        "or pass a local directory"
    )
