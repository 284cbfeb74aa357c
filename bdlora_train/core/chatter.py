"""Library chatter that says nothing to a user of this toolkit, in one place.

Import chatter: lines optional libraries log while they are imported, filtered by message at the logger that logs
them (`filter_import_chatter`, installed by `import bdlora_train`), so importing this package from Python prints
nothing and every other line of those loggers still reaches the user. The commands quiet more
(`quiet_library_chatter`): every process the toolkit runs, the CLI and the ranks `tp-check` / `bench-tp` spawn
(before they import PEFT, which imports torchao).
"""

from __future__ import annotations

import logging
import re
import warnings

# Import-time logs of optional libraries: torchao's native kernels that have no CPU build, torch's pytree deprecation
# notes triggered by torchao's enums, bitsandbytes' hint to install `kernels` for a faster CPU 4-bit matmul (printed
# at import on CPUs with AVX512-BF16, before any quantized model is asked for).
QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes")

# logger -> the messages of import chatter it logs (a filter sees only the records of its own logger, so each is the
# logger the library module logs with)
IMPORT_CHATTER = {
    "torchao": re.compile(
        r"Failed to load .*torchao[/\\]_C\w*[.\w-]*\.so\b|Skipping import of cpp extensions due to incompatible torch"
    ),
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"),
    "bitsandbytes.backends.cpu.ops": re.compile(r"Failed to load CPU gemm_4bit_forward from kernels-community"),
}


class _ImportChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        pattern = IMPORT_CHATTER.get(record.name)
        if pattern is None or not pattern.search(record.getMessage()):
            return True
        if record.name == "torch.utils._pytree":  # only torchao's enums: a user's own registration keeps its note
            cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
            return not str(getattr(cls, "__module__", "")).startswith("torchao")
        return False


_FILTER = _ImportChatter()


def filter_import_chatter() -> None:
    """Drop the IMPORT_CHATTER lines at their loggers (idempotent: one filter object, added once)."""
    for name in IMPORT_CHATTER:
        logging.getLogger(name).addFilter(_FILTER)


class _UnusedPlanRules(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "match nothing in" not in record.getMessage()


_UNUSED_PLAN_RULES = _UnusedPlanRules()


def quiet_library_chatter() -> None:
    """Optional libraries' import logs; transformers' own v6 deprecation notes (raised inside PEFT / Trainer, not by
    anything the user wrote); torch.distributed deprecations that DeepSpeed's ZeRO triggers (not ours to change)."""
    filter_import_chatter()
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".* is deprecated and will be removed in v6", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    # transformers' FSDP2 (fsdp_size next to tp_size) wraps norms and lm_head whose outputs are views; the warning is
    # about an in-place op on them, which no transformers decoder does (residual adds are out of place): a TP x FSDP
    # run trains the single-process adapter (tests/test_tp_training.py)
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
    # DeepSeek's first layers); a model without such layers logs that those rules "match nothing", on every TP load
    logging.getLogger("transformers.distributed.mixin").addFilter(_UNUSED_PLAN_RULES)
