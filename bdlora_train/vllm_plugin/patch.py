"""The vLLM patches. Imported only by `register()`, i.e. inside vLLM's own processes.

Two symbols are wrapped, both in the worker process that loads adapters (vLLM loads every adapter in
`WorkerLoRAManager._load_adapter`, on each TP rank):

1. `vllm.lora.peft_helper.PEFTHelper.validate_legal` — vLLM refuses any config with `use_bdlora`
   (`_validate_features`: "vLLM does not support block-diagonal LoRA (BD-LoRA)."). While the wrapped
   `_load_adapter` below is loading a BD-LoRA adapter it has already checked, the helper is validated as the
   plain LoRA each rank will actually hold: `use_bdlora` dropped, rank r/TP (so `--max-lora-rank` bounds the
   per-rank rank). Any other call is untouched, so unchecked BD adapters are still refused by vLLM.
2. `vllm.lora.worker_manager.WorkerLoRAManager._load_adapter` — plain adapters go straight to vLLM. For a
   BD-LoRA adapter: check every BD module against the LoRA layer vLLM wrapped it in (one-line refusal naming
   module and fix for anything that cannot be served exactly), let vLLM load the tensors, then replace each
   BD module's factors by this rank's local LoRA (`sharding.local_factors`). From there on the adapter is an
   ordinary LoRA of rank r/TP to vLLM: its stacking into the `max_lora_rank`-wide buffers (zero-padded), its
   default per-rank slicing (`slice_lora_a` / `slice_lora_b` in `vllm/lora/layers/{column,row}_parallel_
   linear.py`) and its punica kernels are vLLM's own, so BD and plain adapters mix in one batch.

Nothing else changes: the base model, plain LoRA adapters and every forward pass run vLLM's code.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import json
import os

from vllm.logger import init_logger  # noqa: E402 - this module is only imported inside vLLM

from bdlora_train.core.roles import BD_A, BD_B, check_rank
from bdlora_train.vllm_plugin.sharding import BDConfig, BDLoraServeError, check_packed, local_factors

logger = init_logger("vllm.plugins.bdlora")  # under "vllm." so vLLM's log handler prints it

# Set while _load_adapter loads a BD adapter it has checked: (tp_size,). Read by the validate_legal wrapper.
_CHECKED_BD_LOAD: contextvars.ContextVar[int | None] = contextvars.ContextVar("bdlora_checked_load", default=None)

# vLLM 0.32 LoRA layer classes (exact type names: subclasses such as the S-LoRA `...WithShardedLoRA` ones
# shard differently and are not covered) -> (kind, segmented). Segmented layers get one LoRA per packed
# sub-module (q|k|v, gate|up), each sharded on its own.
_COVERED = {
    "ColumnParallelLinearWithLoRA": ("column", False),
    "MergedColumnParallelLinearWithLoRA": ("column", True),
    "MergedQKVParallelLinearWithLoRA": ("column", True),
    "RowParallelLinearWithLoRA": ("row", False),
}
_ROLE_KIND = {BD_B: "column", BD_A: "row"}
_FIX_DENSE = "or serve `bdlora export --to dense-lora` of it (every rank then computes the full rank)"


def _locate(manager, module_name: str):
    """The vLLM LoRA layer serving `module_name` (a checkpoint module such as ...self_attn.q_proj) and the
    index of its segment in a packed layer (None when the module is the layer itself)."""
    if module_name in manager.modules:
        return manager.modules[module_name], None
    parent, _, leaf = module_name.rpartition(".")
    for packed, subs in manager.packed_modules_mapping.items():
        if leaf in subs:
            full = f"{parent}.{packed}" if parent else packed
            if full in manager.modules:
                return manager.modules[full], subs.index(leaf)
    return None, None


def _check_module(name: str, role: str, layer, segment, nblocks: int, tp: int, lora_a, lora_b) -> None:
    """Refuse, in one line, a BD module whose blocks would not line up with the rank's shard."""
    cls = type(layer).__name__
    if tp == 1:
        return  # one rank holds everything: the dense LoRA is served by vLLM as is
    covered = _COVERED.get(cls)
    if covered is None:
        sharded = "Sharded" in cls
        fix = ("drop --fully-sharded-loras (BD-LoRA needs no S-LoRA collectives)" if sharded
               else f"serve at --tensor-parallel-size 1, {_FIX_DENSE}")
        raise BDLoraServeError(f"module {name}: vLLM wraps it in {cls}, which the BD-LoRA plugin does not cover; "
                               f"fix: {fix}.")
    kind, segmented = covered
    if _ROLE_KIND[role] != kind:
        raise BDLoraServeError(
            f"module {name}: {role} (block-diagonal {'A' if role == BD_A else 'B'}) on a {kind}-parallel layer "
            f"({cls}) has no rank-local form; fix: train with target_modules_bd_{'b' if kind == 'column' else 'a'} "
            f"for this module (roles follow the TP plan), {_FIX_DENSE}.")
    base = layer.base_layer
    if cls == "ColumnParallelLinearWithLoRA" and layer.is_merged_col_linear:
        raise BDLoraServeError(
            f"module {name}: one LoRA over a fused {type(base).__name__} (vLLM shards each segment separately, so "
            f"contiguous blocks straddle shards); fix: serve at --tensor-parallel-size 1, {_FIX_DENSE}.")
    if cls == "MergedQKVParallelLinearWithLoRA" and segment in (1, 2) and base.num_kv_head_replicas > 1:
        raise BDLoraServeError(
            f"module {name}: --tensor-parallel-size {tp} exceeds the {base.total_num_kv_heads} KV heads, so vLLM "
            f"replicates each KV head on {base.num_kv_head_replicas} ranks and a rank's K/V shard is not its "
            f"block; fix: serve at a tensor-parallel size <= {base.total_num_kv_heads} that divides {nblocks}, "
            f"{_FIX_DENSE}.")
    # Shard sizes must be the block-group sizes (d / TP), which vLLM's even head/column split gives; check it.
    if kind == "row":
        d_in, shard = lora_a.shape[1] * nblocks, layer.input_size
    else:
        d_in, shard = lora_b.shape[0], (layer.output_slices[segment] if segmented else layer.output_size)
    if shard * tp != d_in:
        raise BDLoraServeError(
            f"module {name}: this rank's {kind} shard is {shard} wide, not {d_in}/{tp}, so blocks do not line up "
            f"with shards; fix: {_FIX_DENSE}.")


def _read_config(lora_request) -> dict:
    from vllm.lora.utils import get_adapter_absolute_path

    path = get_adapter_absolute_path(lora_request.lora_path)
    with open(os.path.join(path, "adapter_config.json")) as f:
        return json.load(f)


def _tp_of(manager) -> tuple[int, int]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()


def _wrap_load_adapter(original):
    @functools.wraps(original)
    def _load_adapter(self, lora_request):
        try:
            bd = BDConfig.from_adapter_config(_read_config(lora_request))
        except FileNotFoundError:
            bd = None  # vLLM raises its own not-found error
        if bd is None:
            return original(self, lora_request)
        tp, tp_rank = _tp_of(self._adapter_manager)
        where = f"BD-LoRA adapter {lora_request.lora_name!r} ({lora_request.lora_path})"
        if bd.nblocks % tp:
            raise BDLoraServeError(
                f"{where}: nblocks {bd.nblocks} is not divisible by --tensor-parallel-size {tp}; fix: serve at a "
                f"tensor-parallel size that divides {bd.nblocks}, {_FIX_DENSE}.")
        token = _CHECKED_BD_LOAD.set(tp)
        try:
            lora = original(self, lora_request)
        finally:
            _CHECKED_BD_LOAD.reset(token)
        manager = self._adapter_manager
        n_bd = 0
        for name, weights in lora.loras.items():
            role = bd.role(name)
            if role is None or weights.lora_a is None or weights.lora_b is None:
                continue  # a plain LoRA module inside the adapter (match_strict=False): vLLM's usual path
            layer, segment = _locate(manager, name)
            if layer is None:
                continue  # not a module this deployment adapts (vLLM ignores its weights too)
            try:
                check_packed(name, role, weights.lora_a, weights.lora_b, bd.nblocks)
                _check_module(name, role, layer, segment, bd.nblocks, tp, weights.lora_a, weights.lora_b)
            except BDLoraServeError as e:
                raise BDLoraServeError(f"{where}: {e}") from None
            weights.lora_a, weights.lora_b = local_factors(role, weights.lora_a, weights.lora_b, bd.nblocks, tp,
                                                           tp_rank)
            weights.rank = weights.lora_a.shape[0]  # informational; scaling stays alpha / r of the full adapter
            n_bd += 1
        if tp_rank == 0:
            logger.info("bdlora: %s: %d block-diagonal modules, each rank holds rank %d of %d (TP %d, nblocks %d)",
                        where, n_bd, lora.rank // tp, lora.rank, tp, bd.nblocks)
        return lora

    _load_adapter.__bdlora_wrapped__ = original
    return _load_adapter


def _wrap_validate_legal(original):
    @functools.wraps(original)
    def validate_legal(self, lora_config):
        tp = _CHECKED_BD_LOAD.get()
        if not self.use_bdlora or tp is None:
            return original(self, lora_config)
        ranks = [self.r, *self.rank_pattern.values()]
        for r in ranks:  # each rank holds r/TP of every module's rank
            check_rank(r, tp, "BD-LoRA adapter", blocks="--tensor-parallel-size", error=BDLoraServeError)
        local_max = max(ranks) // tp
        if local_max > lora_config.max_lora_rank:
            raise BDLoraServeError(
                f"BD-LoRA rank {max(ranks)} at --tensor-parallel-size {tp} holds rank {local_max} per rank, above "
                f"--max-lora-rank {lora_config.max_lora_rank}; fix: --max-lora-rank >= {local_max}.")
        local = copy.copy(self)
        local.use_bdlora = None
        local.r = self.r // tp
        local.rank_pattern = {k: v // tp for k, v in self.rank_pattern.items()}
        return original(local, lora_config)

    validate_legal.__bdlora_wrapped__ = original
    return validate_legal


def apply() -> bool:
    """Install both wrappers (idempotent). Returns True if they were installed by this call."""
    from vllm.lora import peft_helper, worker_manager

    cls_m, cls_p = worker_manager.WorkerLoRAManager, peft_helper.PEFTHelper
    if hasattr(cls_m._load_adapter, "__bdlora_wrapped__"):
        return False
    cls_m._load_adapter = _wrap_load_adapter(cls_m._load_adapter)
    cls_p.validate_legal = _wrap_validate_legal(cls_p.validate_legal)
    return True
