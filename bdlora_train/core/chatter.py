"""Library chatter that says nothing to a user of this toolkit, in one place.

Library chatter: lines optional libraries log or warn while they are imported or while PEFT and TRL use them, on
every run, about nothing the user wrote. `filter_library_chatter`, installed by `import bdlora_train`, drops each at
the logger that logs it or by its exact warning text and the module that warns it, so every other line of those
loggers and modules still reaches the user:
  - import: torchao's CUDA-only native kernels on a CPU torch, torch's pytree notes on torchao's enums, bitsandbytes'
    hint to install `kernels` (on CPUs with AVX512-BF16), all printed while PEFT's and transformers' own imports load
    the quantization extras; with `kernels` installed (transformers >= 5.25) and the Hub offline, the note that
    bitsandbytes' kernel repository's publisher goes unchecked, at the same import;
  - use: DeepSpeed's "Setting accelerator to CPU" where torch has no CUDA (accelerate imports DeepSpeed at every
    save); transformers 5's deprecation of the model methods `is_gradient_checkpointing`,
    `gradient_checkpointing_enable` / `_disable`, which PEFT's PeftModel and TRL's trainers call on every run (a
    script's own call goes unwarned too while the toolkit is imported; pyproject caps transformers below v6, which
    removes them); PEFT's "Could not find a config file in tiny:<family>" at every adapter save (a tiny model is
    built from a config that no directory or Hub repo holds, so PEFT cannot look for a resized vocabulary, which no
    tiny model has).
A script that imports peft before bdlora_train gets the import lines before this module runs: `make install` puts
`STARTUP_PTH` in the environment's site-packages, which Python runs at startup (`install_startup_filter`).
The commands quiet more (`quiet_library_chatter`): every process the toolkit runs, the CLI and the ranks
`tp-check` / `bench-tp` spawn (before they import PEFT, which imports torchao).
"""

from __future__ import annotations

# The standard library only: Python runs this file at startup (STARTUP_CODE), before any package is importable.
import logging
import re
import sys
import warnings
from pathlib import Path

# Import-time logs of optional libraries: torchao's native kernels that have no CPU build, torch's pytree deprecation
# notes triggered by torchao's enums, bitsandbytes' hint to install `kernels` for a faster CPU 4-bit matmul (printed
# at import on CPUs with AVX512-BF16, before any quantized model is asked for).
QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes")

# logger -> the messages of library chatter it logs (a filter sees only the records of its own logger, so each is the
# logger the library module logs with)
LOGGED_CHATTER = {
    "torchao": re.compile(
        r"Failed to load .*torchao[/\\]_C\w*[.\w-]*\.so\b|Skipping import of cpp extensions due to incompatible torch"
    ),
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"),
    "bitsandbytes.backends.cpu.ops": re.compile(r"Failed to load CPU gemm_4bit_forward from kernels-community"),
    # the same import where `kernels` is installed (transformers >= 5.25 requires it) and the Hub is offline: only
    # bitsandbytes' own kernel repository, so a user's own kernel loads keep the line
    "kernels._internals.hf_hub": re.compile(
        r"Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' because"
    ),
    "DeepSpeed": re.compile(r"Setting accelerator to CPU\. If you have GPU or other accelerator"),
    # TRL imports vLLM where it is installed (an RL run beside the rollout server), and vLLM's CPU build says this at
    # import: the trainer never runs vLLM's kernels
    "vllm.triton_utils.importing": re.compile(r"Triton is installed, but doesn't include CPU backend"),
}

# (message, category, module that warns): warnings.filterwarnings' fields, each message matched from its start
WARNED_CHATTER = (
    (
        r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)` is deprecated and "
        r"will be removed in v6",
        FutureWarning,
        r"transformers\.modeling_utils",
    ),
    (r"Could not find a config file in tiny:[\w.-]+ - will assume", UserWarning, r"peft\.utils\.save_and_load"),
    # TRL checks the installed vLLM against the versions its own vLLM modes support, on import, in any environment
    # that has vLLM (an RL run beside the rollout server): the toolkit never uses those modes (use_vllm is refused;
    # rollouts go through rl/vllm_server.py, docs/rl.md)
    (r"TRL currently supports vLLM versions from", UserWarning, r"trl(\.|$)"),
)

# What Python runs at startup from site-packages (`import` lines of a .pth file run; see the `site` module): this file
# alone (it imports nothing but the standard library), loaded under a name of its own, so the filter is in place
# before any import and the package itself is not imported (a stock-PEFT process stays free of it). Inert once the
# toolkit is uninstalled: find_spec finds no package.
STARTUP_PTH = "bdlora_train-quiet.pth"
STARTUP_CODE = """\
import importlib.util, os
spec = importlib.util.find_spec("bdlora_train")
path = os.path.join(spec.submodule_search_locations[0], "core", "chatter.py") if spec else ""
if os.path.isfile(path):
    spec = importlib.util.spec_from_file_location("_bdlora_train_startup_chatter", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.filter_library_chatter()
"""
STARTUP_LINE = f"import sys; exec({STARTUP_CODE!r})\n"


class _LibraryChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        pattern = LOGGED_CHATTER.get(record.name)
        if pattern is None or not pattern.search(record.getMessage()):
            return True
        if record.name == "torch.utils._pytree":  # only torchao's enums: a user's own registration keeps its note
            cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
            return not str(getattr(cls, "__module__", "")).startswith("torchao")
        if record.name == "DeepSpeed":  # a torch with CUDA that DeepSpeed did not find: that line matters
            torch = sys.modules.get("torch")
            return torch is not None and torch.cuda.is_available()
        return False


_FILTER = _LibraryChatter()


def filter_library_chatter() -> None:
    """Drop the LOGGED_CHATTER lines at their loggers and the WARNED_CHATTER warnings (idempotent: one filter object,
    added once; warnings.filterwarnings replaces an equal filter)."""
    for name in LOGGED_CHATTER:
        logging.getLogger(name).addFilter(_FILTER)
    for message, category, module in WARNED_CHATTER:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def install_startup_filter(site_packages: str | Path | None = None) -> Path:
    """Write STARTUP_PTH into an environment's site-packages (this interpreter's by default): from then on every
    Python of that environment starts with `filter_library_chatter` in place, whichever module it imports first."""
    if site_packages is None:
        import sysconfig

        site_packages = sysconfig.get_path("purelib")
    path = Path(site_packages) / STARTUP_PTH
    path.write_text(STARTUP_LINE)
    return path


class _PlanNotes(logging.Filter):
    """transformers' notes about its own TP plans (below), not about anything the user wrote."""

    MESSAGES = re.compile(r"match nothing in|The `moe_tp_experts` parallel style has been deprecated")

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.MESSAGES.search(record.getMessage())


_PLAN_MESSAGES = _PlanNotes()


def quiet_library_chatter() -> None:
    """Optional libraries' import logs; transformers' own v6 deprecation notes (raised inside PEFT / Trainer, not by
    anything the user wrote); torch.distributed deprecations that DeepSpeed's ZeRO triggers (not ours to change)."""
    filter_library_chatter()
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".* is deprecated and will be removed in v6", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    # transformers' FSDP2 (fsdp_size next to tp_size) wraps norms and lm_head whose outputs are views; the warning is
    # about an in-place op on them, which no transformers decoder does (residual adds are out of place): a TP x FSDP
    # run trains the single-process adapter (tests/tp_runtime/test_tp_training.py)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    # PEFT's own transformers-5 MoE conversion gives a packed gate|up expert parameter a rank per projection through
    # rank_pattern / alpha_pattern, applies it to the ParamWrapper, then warns that the key matched no targeted module
    # (its check looks at modules only): plain LoRA on any MoE expert prints it, untrue, on every run
    warnings.filterwarnings(
        "ignore",
        message=r"The following (rank|alpha)_pattern keys did not match any targeted module and were ignored: "
        r"\['\.\*\\\\\.gate_up_proj'\]",
        category=RuntimeWarning,
    )
    # transformers' MoE plans name the dense MLP a family may have in some layers (Qwen3-MoE's `mlp_only_layers`,
    # DeepSeek's first layers); a model without such layers logs that those rules "match nothing", on every TP load.
    # transformers 5.25 deprecates the `moe_tp_experts` style that its own Llama-4 plan still uses, and says so on
    # every Llama-4 TP load (pyproject caps transformers below 5.26; 5.28 removes the style)
    logging.getLogger("transformers.distributed.mixin").addFilter(_PLAN_MESSAGES)
    logging.getLogger("transformers.distributed.utils").addFilter(_PLAN_MESSAGES)
