"""Model cards: the README.md of an adapter dir (and of a merged export), rendered from what the caller knows.

The card is what a user of the repo needs to load and serve the adapter: PEFT metadata, nblocks and the role of every
module kind, trainable params vs the matched LoRA budget, eval results when an eval_results.json sits in or next to
the adapter dir, and the serving section, which the caller hands in (serving/plan.py `serving_lines`, worked out once
per run): rendering a card runs no check. Composing the card for the Hub is train/push.py, the upload hub.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub.constants import REPOCARD_NAME

from bdlora_train.adapters.describe import describe, module_table
from bdlora_train.adapters.reader import read_adapter
from bdlora_train.core.files import atomic_write_text
from bdlora_train.models import base_spec
from bdlora_train.models.embedded import EMBEDDED
from bdlora_train.objectives import objective_named
from bdlora_train.quant.quantized import SIDE_FILE

TAGS = ["bdlora", "lora", "peft", "tensor-parallel"]
MERGED_TAGS = ["bdlora", "lora", "merged"]
CARD_NAME = REPOCARD_NAME  # README.md: the file the Hub shows as a repo's card (hub.py uploads it under that name)


def _read_json(*candidates: Path) -> dict | None:
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text())
    return None


PAPER = "Wang et al., [arXiv 2510.23346](https://arxiv.org/abs/2510.23346)"


def model_card(
    adapter_dir: str | Path,
    serving: list[str],
    metrics: dict | None = None,
    eval_results: dict | None = None,
    repo_id: str | None = None,
    note: str | None = None,
    adapter=None,
) -> str:
    """The card text for an adapter dir; metrics default to <adapter>/../metrics.json, eval results to
    eval_results.json in the adapter dir or its parent. The card names the adapter as a user loads it: `repo_id`
    for a card made for the Hub, else the directory's absolute path, so its snippet and commands run as printed.
    `note` (e.g. what an export made this adapter from) follows the first paragraph. `serving` is the serving section
    (serving/plan.py `serving_lines` for this adapter at that name). `adapter`: the dir's `read_adapter`, when the
    caller has read it already."""
    adapter_dir = Path(adapter_dir)
    adapter = adapter if adapter is not None else read_adapter(adapter_dir)
    info = describe(adapter)
    metrics = metrics if metrics is not None else run_metrics(adapter_dir)
    if eval_results is None:
        eval_results = _read_json(adapter_dir / "eval_results.json", adapter_dir.parent / "eval_results.json")
    base = card_base(adapter, metrics)
    r = adapter.config.r
    nblocks = adapter.nblocks
    name = repo_id or str(adapter_dir.resolve())
    method = "BD-LoRA" if adapter.is_bdlora else "LoRA"
    title = repo_id or f"{method} adapter for {base}"
    quantized = (adapter_dir / SIDE_FILE).is_file()
    body = [
        f"# {title}",
        "",
        f"A {'BD-LoRA (block-diagonal LoRA; ' + PAPER + ')' if adapter.is_bdlora else 'LoRA'} adapter for `{base}`, "
        "made with bdlora-train on top of PEFT.",
        "",
        *([note, ""] if note else []),
        "It loads with stock PEFT (>= 0.20)"
        + (f"; it was trained on a quantized base, as {SIDE_FILE} records:" if quantized else ":"),
        "",
        "```python",
        *load_snippet(base, name, metrics.get("seed"), quantized=quantized and repo_id is None),
        "```",
        "",
        "## Adapter",
        "",
        f"- rank r = {r}, lora_alpha = {adapter.config.lora_alpha:g}, rsLoRA = {bool(adapter.config.use_rslora)}",
        f"- nblocks = {nblocks}"
        + (" (= the tensor-parallel degree it is served at)" if adapter.is_bdlora else " (dense LoRA)"),
        f"- {'trainable params' if note is None else 'params as stored'}: {info['total_params']:,}",
    ]
    matched_rank, matched_params = metrics.get("matched_lora_rank"), metrics.get("matched_lora_params")
    if matched_rank and matched_params:
        body.append(
            f"- matched LoRA budget: LoRA r = {matched_rank} on the same modules has {matched_params:,} params; "
            f"this adapter has {info['total_params'] / matched_params:.2f}x that"
        )
    body += training_lines(metrics)
    roles = (
        "Roles per module kind (bd_b: column-parallel, block-diagonal B; bd_a: row-parallel, block-diagonal A):"
        if adapter.has_structure
        else "Modules (plain LoRA: dense A and B):"
    )
    body += ["", roles, "", *module_table(info), ""]
    if eval_results:
        body += ["## Evaluation", "", "| metric | value |", "|---|---:|"]
        for key, value in _flatten(eval_results).items():
            body.append(f"| {key} | {value:.4g} |" if isinstance(value, float) else f"| {key} | {value} |")
        body.append("")
    body += ["## Serving", ""] + list(serving)
    data = card_data(
        base, nblocks if adapter.is_bdlora else None, eval_results, metrics.get("dataset"), repo_id, title,
        objective=metrics.get("objective"),
    )
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n"


def card_base(adapter, metrics: dict | None = None) -> str:
    """The base a card (and its serving section) names: the adapter config's, else the run's `model`."""
    return adapter.config.base_model_name_or_path or (metrics or {}).get("model") or "unknown"


def training_lines(metrics: dict) -> list[str]:
    """The card's lines on how the adapter was trained: the objective's own (objectives/: a GRPO run's rewards and how
    its mean reward moved), the learning-rate multipliers (trainer/optim.py), then what metrics.json has of the
    objective's closing keys (steps, final loss, dataset)."""
    objective = objective_named(metrics.get("objective"))
    bd, loraplus = metrics.get("bd_lr_ratio"), metrics.get("loraplus_lr_ratio")
    lines = objective.card_lines(metrics)
    if bd is not None:
        lines.append(f"- learning rate of the block-diagonal factors: {bd:g}x the base rate (bd_lr_ratio)")
    if loraplus not in (None, 1.0):
        lines.append(f"- learning rate of lora_B: {loraplus:g}x the base rate (LoRA+, loraplus_lr_ratio)")
    for key, label in objective.card_keys():
        value = metrics.get(key)
        if value is not None:
            lines.append(f"- {label}: {value:.4f}" if isinstance(value, float) else f"- {label}: {value}")
    return lines


def run_metrics(adapter_dir: str | Path) -> dict:
    """metrics.json of the run that trained the adapter (`bdlora train` writes it beside adapter/), or {}."""
    return _read_json(Path(adapter_dir).parent / "metrics.json") or {}


def merged_card(out_dir: str | Path, adapter, metrics: dict, quantized: bool) -> str:
    """The card of `bdlora export --to merged`: a plain transformers model, the adapter's delta in its weights."""
    out_dir = Path(out_dir)
    base = card_base(adapter, metrics)
    method = "BD-LoRA" if adapter.has_structure else "LoRA"
    title = f"{base} with a {method} adapter merged in"
    how = (
        "merged into the dequantized weights of the quantized base it was trained on, saved in float"
        if quantized
        else "added to its weights in float32"
    )
    body = [
        f"# {title}",
        "",
        f"The base model `{base}` with the {method} adapter `{adapter.path.resolve()}` merged in by bdlora-train's "
        f"`bdlora export --to merged`: W + s·B·A for every adapted module, {how}. A plain transformers model: it "
        "loads and serves without PEFT and without adapter support, at any tensor-parallel degree.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        f"model = AutoModelForCausalLM.from_pretrained({str(out_dir.resolve())!r})",
        "```",
        "",
        "## Merged adapter",
        "",
        f"- rank r = {adapter.config.r}, lora_alpha = {adapter.config.lora_alpha:g}, "
        f"rsLoRA = {bool(adapter.config.use_rslora)}, nblocks = {adapter.bd_nblocks}",
        f"- adapted modules: {len(adapter.modules)}, adapter params: {adapter.params:,}",
    ]
    body += training_lines(metrics)
    data = card_data(base, None, None, metrics.get("dataset"), None, title, library="transformers")
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n"


def load_snippet(base: str, adapter: str, seed: int | None = None, quantized: bool = False) -> list[str]:
    """Python that loads the adapter on its base, runnable as printed: transformers for a Hub id or a local
    directory, bdlora-train's own loader for the bases it builds (`tiny:<type>`, whose random weights follow the
    run's seed, and `embedded`, the dequantized GGUF it ships)."""
    spec = base_spec(base)
    lines = ["from peft import PeftModel"]
    if quantized:  # the base as the adapter was trained on it: quantized as base_quantization.json records
        lines += [
            "from bdlora_train.models import load_trained_base",
            f"base, tokenizer = load_trained_base({_local(spec)!r}, {adapter!r})",
        ]
    elif spec == EMBEDDED or spec.startswith("tiny:"):
        seeded = f", seed={seed}" if spec.startswith("tiny:") and seed is not None else ""
        lines += [
            "from bdlora_train.models import load_model",
            f"base, tokenizer = load_model({spec!r}{seeded})  # built by bdlora-train, no download",
        ]
    else:
        lines += [
            "from transformers import AutoModelForCausalLM",
            f"base = AutoModelForCausalLM.from_pretrained({_local(spec)!r})",
        ]
    return lines + [f"model = PeftModel.from_pretrained(base, {adapter!r})"]


def _local(spec: str) -> str:
    """A base that is a local path, as an absolute path (the snippet runs from anywhere); a Hub id as it is."""
    return str(Path(spec).resolve()) if Path(spec).exists() else spec


def card_data(
    base: str,
    nblocks: int | None,
    eval_results: dict | None,
    dataset: str | None,
    repo_id: str | None,
    title: str | None = None,
    library: str = "peft",
    objective: str | None = None,
):
    """The card's YAML metadata through huggingface_hub (quoting, model-index): `library_name` (PEFT's for an
    adapter), the base model and its `base_model:adapter:` tag only when the base is a Hub id and `library` is
    PEFT, eval results as `model-index`."""
    from huggingface_hub import EvalResult, ModelCardData

    hub_base = base if is_hub_id(base) else None
    tags = (
        list(TAGS if library == "peft" else MERGED_TAGS)
        + ([f"nblocks-{nblocks}"] if nblocks else [])
        + objective_named(objective).card_tags()
        + ([f"base_model:adapter:{hub_base}"] if hub_base and library == "peft" else [])
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
        library_name=library,
        base_model=hub_base,
        pipeline_tag="text-generation",
        tags=tags,
        model_name=repo_id or title or "bdlora-adapter",
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


def write_model_card(
    adapter_dir: str | Path,
    serving: list[str],
    metrics: dict | None = None,
    repo_id: str | None = None,
    note: str | None = None,
    adapter=None,
) -> Path:
    """Write README.md into the adapter dir (replacing PEFT's generic card), atomically. Called on the adapter in
    its final place: the card names that path. `adapter`: its `read_adapter`, when the caller has read it already."""
    adapter_dir = Path(adapter_dir)
    text = model_card(adapter_dir, serving, metrics=metrics, repo_id=repo_id, note=note, adapter=adapter)
    atomic_write_text(adapter_dir / CARD_NAME, text)
    return adapter_dir / CARD_NAME
