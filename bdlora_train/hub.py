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

from bdlora_train.adapters import describe, module_table, read_adapter
from bdlora_train.errors import HubError
from bdlora_train.files import atomic_write_text
from bdlora_train.serving import serving_lines

TAGS = ["bdlora", "lora", "peft", "tensor-parallel"]
CARD_NAME = "README.md"


def _read_json(*candidates: Path) -> dict | None:
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text())
    return None


def _yaml_list(items) -> str:
    return "\n".join(f"- {item}" for item in items)


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
    front = ["---", "library_name: peft", f"base_model: {base}", "tags:", _yaml_list(TAGS)]
    front.append("---")
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
    return "\n".join(front + [""] + body) + "\n"


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


def push_adapter(
    adapter_dir: str | Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """create_repo + upload_folder of the adapter dir with a fresh card; returns the commit URL."""
    from huggingface_hub import HfApi

    adapter_dir = Path(adapter_dir)
    if "/" not in repo_id or repo_id.count("/") != 1:
        raise HubError(f"push: repo_id={repo_id!r} must look like 'user-or-org/name'")
    read_adapter(adapter_dir)  # refuses dirs that are not a PEFT LoRA adapter
    require_token()
    write_model_card(adapter_dir, repo_id=repo_id)
    api = HfApi()  # token resolved by huggingface_hub from HF_TOKEN or the login, never passed around here
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=str(adapter_dir),
        repo_type="model",
        revision=revision,
        commit_message=commit_message or "Upload BD-LoRA adapter (bdlora-train)",
        ignore_patterns=[".*", "**/.*", "checkpoint-*"],
    )
    return str(getattr(commit, "commit_url", commit))
