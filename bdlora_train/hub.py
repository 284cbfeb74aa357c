"""Model card and `bdlora push ADAPTER --repo-id me/name`: share an adapter on the Hugging Face Hub.

The card (README.md in the adapter dir) is what a user of the repo needs to load and serve the adapter:
PEFT metadata, nblocks and the role of every module kind, trainable params vs the matched LoRA budget, eval
results when an eval_results.json sits in or next to the adapter dir, and vLLM / dense-export instructions.
The token comes from HF_TOKEN or `hf auth login` and is never printed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from bdlora_train.adapters.describe import describe, module_table
from bdlora_train.adapters.reader import read_adapter
from bdlora_train.core.errors import HubError, first_line
from bdlora_train.core.files import atomic_write_text
from bdlora_train.serving.check import serving_lines

TAGS = ["bdlora", "lora", "peft", "tensor-parallel"]
CARD_NAME = "README.md"


def _read_json(*candidates: Path) -> dict | None:
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text())
    return None


def model_card(
    adapter_dir: str | Path, metrics: dict | None = None, eval_results: dict | None = None, repo_id: str | None = None
) -> str:
    """The card text for an adapter dir; metrics default to <adapter>/../metrics.json, eval results to
    eval_results.json in the adapter dir or its parent."""
    adapter_dir = Path(adapter_dir)
    adapter = read_adapter(adapter_dir)
    info = describe(adapter)
    metrics = metrics if metrics is not None else _read_json(adapter_dir.parent / "metrics.json") or {}
    if eval_results is None:
        eval_results = _read_json(adapter_dir / "eval_results.json", adapter_dir.parent / "eval_results.json")
    base = adapter.config.base_model_name_or_path or metrics.get("model") or "unknown"
    r = adapter.config.r
    nblocks = adapter.nblocks
    name = repo_id or "ADAPTER"
    method = "BD-LoRA (block-diagonal LoRA)" if adapter.is_bdlora else "LoRA"
    body = [
        f"# {name}",
        "",
        f"A {method} adapter for `{base}`, trained with "
        "[bdlora-train](https://arxiv.org/abs/2510.23346) on top of PEFT. It loads with stock PEFT (>= 0.20):",
        "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM",
        f'model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base}"), "{name}")',
        "```",
        "",
        "## Adapter",
        "",
        f"- rank r = {r}, lora_alpha = {adapter.config.lora_alpha:g}, rsLoRA = {bool(adapter.config.use_rslora)}",
        f"- nblocks = {nblocks}"
        + (" (= the tensor-parallel degree it is served at)" if adapter.is_bdlora else " (dense LoRA)"),
        f"- trainable params: {info['total_params']:,}",
    ]
    matched_rank, matched_params = metrics.get("matched_lora_rank"), metrics.get("matched_lora_params")
    if matched_rank and matched_params:
        body.append(
            f"- matched LoRA budget: LoRA r = {matched_rank} on the same modules has {matched_params:,} params; "
            f"this adapter has {info['total_params'] / matched_params:.2f}x that"
        )
    body += _lr_ratio_lines(metrics)
    for key, label in (("steps", "training steps"), ("final_loss", "final training loss"), ("dataset", "dataset")):
        value = metrics.get(key)
        if value is not None:
            body.append(f"- {label}: {value:.4f}" if isinstance(value, float) else f"- {label}: {value}")
    body += [
        "",
        "Roles per module kind (bd_b: column-parallel, block-diagonal B; bd_a: row-parallel, block-diagonal A):",
        "",
        *module_table(info),
        "",
    ]
    if eval_results:
        body += ["## Evaluation", "", "| metric | value |", "|---|---:|"]
        for key, value in _flatten(eval_results).items():
            body.append(f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |")
        body.append("")
    body += ["## Serving", ""] + serving_lines(base, name, r, nblocks, adapter.is_bdlora)
    data = card_data(base, nblocks if adapter.is_bdlora else None, eval_results, metrics.get("dataset"), repo_id)
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n"


def _lr_ratio_lines(metrics: dict) -> list[str]:
    """The learning-rate multipliers the adapter was trained with (train/optim.py), as metrics.json records them."""
    bd, loraplus = metrics.get("bd_lr_ratio"), metrics.get("loraplus_lr_ratio")
    lines = []
    if bd is not None:
        lines.append(f"- learning rate of the block-diagonal factors: {bd:g}x the base rate (bd_lr_ratio)")
    if loraplus not in (None, 1.0):
        lines.append(f"- learning rate of lora_B: {loraplus:g}x the base rate (LoRA+, loraplus_lr_ratio)")
    return lines


def card_data(base: str, nblocks: int | None, eval_results: dict | None, dataset: str | None, repo_id: str | None):
    """The card's YAML metadata through huggingface_hub (quoting, model-index): PEFT's `library_name`, the base
    model and its `base_model:adapter:` tag only when the base is a Hub id, eval results as `model-index`."""
    from huggingface_hub import EvalResult, ModelCardData

    hub_base = base if is_hub_id(base) else None
    tags = (
        list(TAGS)
        + ([f"nblocks-{nblocks}"] if nblocks else [])
        + ([f"base_model:adapter:{hub_base}"] if hub_base else [])
    )
    results = [
        EvalResult(
            task_type="text-generation",
            dataset_type=dataset or "custom",
            dataset_name=dataset or "custom",
            metric_type=key,
            metric_value=value,
        )
        for key, value in _flatten(eval_results or {}).items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    ]
    return ModelCardData(
        library_name="peft",
        base_model=hub_base,
        pipeline_tag="text-generation",
        tags=tags,
        model_name=repo_id or "bdlora-adapter",
        eval_results=results or None,
    )


def is_hub_id(name: str | None) -> bool:
    """A Hub model id ("org/name"), not a local path, a `tiny:` spec or "embedded"."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name or ":" in name or name.startswith((".", "/", "~")) or Path(name).exists() or name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "/"))
        elif isinstance(value, (int, float, str, bool)):
            out[name] = value
    return out


def write_model_card(adapter_dir: str | Path, metrics: dict | None = None, repo_id: str | None = None) -> Path:
    """Write README.md into the adapter dir (replacing PEFT's generic card), atomically."""
    adapter_dir = Path(adapter_dir)
    text = model_card(adapter_dir, metrics=metrics, repo_id=repo_id)
    atomic_write_text(adapter_dir / CARD_NAME, text)
    return adapter_dir / CARD_NAME


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
    read_adapter(adapter_dir)  # refuses dirs that are not a readable PEFT LoRA adapter
    require_token()
    card = model_card(adapter_dir, repo_id=repo_id).encode()
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
