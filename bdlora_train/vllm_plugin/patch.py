"""The vLLM patches. Imported only by `register()`, i.e. inside vLLM's own processes.

Two symbols are wrapped, both in the worker process that loads adapters (vLLM loads every adapter in
`WorkerLoRAManager._load_adapter`, on each TP rank), and the CPU LoRA ops are guarded (cpu_ops.py):

1. `vllm.lora.peft_helper.PEFTHelper.validate_legal` — vLLM refuses any config with `use_bdlora`
   (`_validate_features`: "vLLM does not support block-diagonal LoRA (BD-LoRA)."). While the wrapped
   `_load_adapter` below is loading a BD-LoRA adapter it has already checked, the helper is validated as the
   plain LoRA each rank will actually hold: `use_bdlora` dropped, rank r/TP (so `--max-lora-rank` bounds the
   per-rank rank). Any other call is untouched, so unchecked BD adapters are still refused by vLLM.
2. `vllm.lora.worker_manager.WorkerLoRAManager._load_adapter` — for a BD-LoRA adapter (PEFT's `use_bdlora` and/or
   `bdlora_layout.json`): check nblocks against TP and refuse expert factors, let vLLM load the tensors, then
   replace each block-diagonal module's factors by this rank's local LoRA (`sharding.local_factors` for PEFT's
   packed blocks, `sharding.dense_local_factors` for the densely stored segment-aware blocks of fused projections).
   A packed module the rank cannot hold locally is refused in one line naming module and fix; a densely stored one
   is served as the exact dense LoRA it is stored as, and the load line says so. Fused checkpoint projections that
   the model class loads only as their parts (GLM-4's `gate_up_proj`, engines.VLLM_SPLIT_FUSED) are split into
   them first (the parts share A: exact), for plain LoRA adapters too; stock vLLM refuses them.
   From there on the adapter is an ordinary LoRA to vLLM: its stacking into the `max_lora_rank`-wide buffers
   (zero-padded), its default per-rank slicing (`slice_lora_a` / `slice_lora_b` in `vllm/lora/layers/{column,row}_
   parallel_linear.py`) and its kernels are vLLM's own, so BD and plain adapters mix in one batch.

Nothing else changes: the base model, plain LoRA adapters and every forward pass run vLLM's code.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import json
import os

from vllm.logger import init_logger  # noqa: E402 - this module is only imported inside vLLM

from bdlora_train.core.degrees import per_rank_rank, servable_degrees
from bdlora_train.core.layout import COLUMN, ROW
from bdlora_train.core.roles import BD_B, Role
from bdlora_train.serving.rules import (
    dense_export,
    experts_refusal,
    fused_blocks_refusal,
    kv_heads_refusal,
    max_rank_refusal,
    nblocks_refusal,
    parts_refusal,
    rank_split_refusal,
    serve_dense,
    shard_width_refusal,
    side_refusal,
    split_rank,
    uncovered_refusal,
)
from bdlora_train.vllm_plugin.sharding import (
    BDConfig,
    BlockDiagLoraServeError,
    check_packed,
    dense_local_factors,
    local_factors,
    split_fused,
)

logger = init_logger("vllm.plugins.bdlora")  # under "vllm." so vLLM's log handler prints it

# Set while _load_adapter loads a BD adapter it has checked: (tp_size, nblocks). Read by the validate_legal wrapper.
_CHECKED_BD_LOAD: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "bdlora_checked_load", default=None
)

# vLLM 0.32 LoRA layer classes (exact type names: subclasses such as the S-LoRA `...WithShardedLoRA` ones
# shard differently and are not covered) -> the side TP splits. `_vllm_segments` says how each slices.
_COVERED = {
    "ColumnParallelLinearWithLoRA": COLUMN,
    "MergedColumnParallelLinearWithLoRA": COLUMN,
    "MergedQKVParallelLinearWithLoRA": COLUMN,
    "QKVParallelLinearWithLoRA": COLUMN,
    "RowParallelLinearWithLoRA": ROW,
}


_PEFT_PREFIX = "base_model.model."  # PEFT's prefix of every tensor key (vLLM strips it too)


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


def _vllm_segments(layer, segment, tp: int) -> tuple[int, ...]:
    """The segments (full sizes along the split dimension) of which vLLM gives rank i the i-th 1/TP: what its
    `slice_lora_b` (column) / `slice_lora_a` (row) keeps of one module on this layer."""
    cls = type(layer).__name__
    if cls == "RowParallelLinearWithLoRA":
        return (layer.input_size * tp,)
    if cls == "QKVParallelLinearWithLoRA":  # one LoRA over a fused [q | k | v] (Phi-3's qkv_proj)
        return (layer.q_proj_shard_size * tp, layer.kv_proj_shard_size * tp, layer.kv_proj_shard_size * tp)
    if cls == "ColumnParallelLinearWithLoRA":  # merged: one LoRA over a fused [gate | up] (Phi-3's gate_up_proj)
        return (layer.output_size * tp // 2,) * 2 if layer.is_merged_col_linear else (layer.output_size * tp,)
    return (layer.output_slices[segment] * tp,)  # merged layers: one module per segment


def _check_module(name: str, role: Role, layer, segment, nblocks: int, tp: int, segments: tuple[int, ...],
                  dense_fix: str) -> None:
    """Refuse, in one line, a BD module whose blocks would not line up with the rank's shard. `segments`: the
    module's own segments along its split dimension (one for PEFT's contiguous blocks); `dense_fix`: serve_dense's
    text for the adapter."""
    cls = type(layer).__name__
    if tp == 1:
        return  # one rank holds everything: the dense LoRA is served by vLLM as is
    where = f"module {name}"
    side = _COVERED.get(cls)
    if side is None:
        raise BlockDiagLoraServeError(uncovered_refusal(name, cls, dense_fix))
    base = layer.base_layer
    kv = cls == "QKVParallelLinearWithLoRA" or (cls == "MergedQKVParallelLinearWithLoRA" and segment in (1, 2))
    refusal = side_refusal(f"{where} ({cls})", role, side, dense_fix) or (
        kv_heads_refusal(where, tp, base.total_num_kv_heads, nblocks, dense_fix) if kv else None)
    if refusal:
        raise BlockDiagLoraServeError(refusal)
    shards = _vllm_segments(layer, segment, tp)
    if tuple(segments) == shards:
        return
    if len(shards) > 1 and len(segments) == 1:
        raise BlockDiagLoraServeError(fused_blocks_refusal(name, type(base).__name__, len(shards), dense_fix))
    raise BlockDiagLoraServeError(shard_width_refusal(name, side, list(shards), list(segments), tp, dense_fix))


def _read_adapter(path: str) -> tuple[dict, dict | None]:
    """adapter_config.json and bdlora_layout.json (None when absent) of an adapter directory."""
    from bdlora_train.peft_integration.storage import read_layout

    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    try:
        return config, read_layout(path)
    except ValueError as err:  # AdapterError: one line naming the file
        raise BlockDiagLoraServeError(str(err)) from None


def _tp_of(manager) -> tuple[int, int]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()


def _fused_splits(manager, path: str) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """Adapter modules (names without PEFT's prefix) on a fused projection that this model class loads only as its
    parts (`packed_modules_mapping` maps it to other names) -> (part names, part sizes from vLLM's layer)."""
    weights = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        return {}  # a .bin adapter: vLLM reads it as is (and refuses unexpected modules itself)
    from safetensors import safe_open

    with safe_open(weights, framework="pt") as f:
        modules = {k.removeprefix(_PEFT_PREFIX).rpartition(".lora_A")[0] for k in f.keys() if ".lora_A." in k}
    splits = {}
    for module in sorted(modules):
        leaf = module.rpartition(".")[2]
        parts = tuple(manager.packed_modules_mapping.get(leaf, ()))
        if not parts or leaf in parts or module not in manager.modules:
            continue
        splits[module] = (parts, tuple(manager.modules[module].base_layer.output_sizes))
    return splits


@contextlib.contextmanager
def _split_copy(lora_request, path: str, splits: dict):
    """`lora_request` itself, or (when modules need splitting) a request for a temporary copy of the adapter in which
    each such module is written as its parts."""
    if not splits:
        yield lora_request
        return
    import shutil
    import tempfile

    import msgspec
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    for module, (parts, sizes) in splits.items():
        split_fused(tensors, _PEFT_PREFIX + module, parts, sizes)
    with tempfile.TemporaryDirectory(prefix="bdlora-split-") as tmp:
        shutil.copy(os.path.join(path, "adapter_config.json"), tmp)
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        yield msgspec.structs.replace(lora_request, lora_path=tmp)


def _split_targets(bd: BDConfig | None, splits: dict, where: str, dense_fix: str) -> BDConfig | None:
    """The BD config after splitting fused modules: a densely stored target becomes one target per part; PEFT's
    packed (contiguous) blocks over a fused projection have no per-part form and are refused."""
    if bd is None or not splits:
        return bd
    dense = dict(bd.dense)
    for module, (parts, sizes) in splits.items():
        if bd.role(module):
            raise BlockDiagLoraServeError(f"{where}: {parts_refusal(module, list(parts), dense_fix)}")
        if module in dense:
            try:
                dense.update(dense.pop(module).parts(parts, sizes, dense_fix))
            except BlockDiagLoraServeError as err:
                raise BlockDiagLoraServeError(f"{where}: {err}") from None
    return dataclasses.replace(bd, dense=dense)


def _summary(kinds: dict) -> str:
    """{"qkv_proj": 2, ...} -> "qkv_proj x2, ..."."""
    return ", ".join(f"{kind} x{n}" for kind, n in sorted(kinds.items()))


def _split_summary(splits: dict) -> str:
    fused: dict = {}
    for module, (parts, _) in splits.items():
        key = f"{module.rpartition('.')[2]} -> {' + '.join(parts)}"
        fused[key] = fused.get(key, 0) + 1
    return _summary(fused)


def _wrap_load_adapter(original):
    @functools.wraps(original)
    def _load_adapter(self, lora_request):
        from vllm.lora.utils import get_adapter_absolute_path

        path = get_adapter_absolute_path(lora_request.lora_path)
        try:
            config, layout = _read_adapter(path)
        except FileNotFoundError:
            return original(self, lora_request)  # vLLM raises its own not-found error
        bd = BDConfig.from_adapter(config, layout)
        manager = self._adapter_manager
        where = f"{'BD-LoRA' if bd else 'LoRA'} adapter {lora_request.lora_name!r} ({lora_request.lora_path})"
        splits = _fused_splits(manager, path)
        if bd is None and not splits:
            return original(self, lora_request)
        tp, tp_rank = _tp_of(manager)
        if bd is not None:
            refusal = experts_refusal(bd.experts) or nblocks_refusal(
                tp, bd.nblocks, servable_degrees(bd.nblocks), dense_export(path)
            )
            if refusal:
                raise BlockDiagLoraServeError(f"{where}: {refusal}")
        dense_fix = serve_dense(path)
        bd = _split_targets(bd, splits, where, dense_fix)
        with _split_copy(lora_request, path, splits) as request:
            token = _CHECKED_BD_LOAD.set((tp, bd.nblocks)) if bd is not None else None
            try:
                lora = original(self, request)
            finally:
                if token is not None:
                    _CHECKED_BD_LOAD.reset(token)
        if bd is None:
            if tp_rank == 0:
                logger.info("bdlora: %s: fused modules split at load: %s", where, _split_summary(splits))
            return lora
        _localize(lora, bd, manager, tp, tp_rank, where, dense_fix, splits)
        return lora

    _load_adapter.__bdlora_wrapped__ = original
    return _load_adapter


def _localize(lora, bd: BDConfig, manager, tp: int, tp_rank: int, where: str, dense_fix: str,
              splits: dict | None = None) -> None:
    """Replace every block-diagonal module's factors by this rank's local LoRA; log one line (rank 0)."""
    local, kept, plain, reasons, local_r = {}, {}, {}, [], 0
    for name, weights in lora.loras.items():
        if weights.lora_a is None or weights.lora_b is None:
            continue
        layer, segment = _locate(manager, name)
        if layer is None:
            continue  # not a module this deployment adapts (vLLM ignores its weights too)
        kind = name.rpartition(".")[2]
        role, dense = bd.role(name), bd.dense.get(name)
        try:
            if role is not None:  # PEFT's packed blocks: rank-local, or refused
                check_packed(name, role, weights.lora_a, weights.lora_b, bd.nblocks)
                split = weights.lora_b.shape[0] if role == BD_B else weights.lora_a.shape[1] * bd.nblocks
                _check_module(name, role, layer, segment, bd.nblocks, tp, (split,), dense_fix)
                weights.lora_a, weights.lora_b = local_factors(role, weights.lora_a, weights.lora_b, bd.nblocks,
                                                               tp, tp_rank)
            elif dense is not None:  # densely stored blocks: rank-local where the layer allows, else kept dense
                try:
                    _check_module(name, dense.role, layer, segment, dense.nblocks, tp, dense.segments, dense_fix)
                except BlockDiagLoraServeError as err:
                    kept[kind] = kept.get(kind, 0) + 1
                    reasons.append(str(err).split("; fix:")[0])
                    continue
                weights.lora_a, weights.lora_b = dense_local_factors(dense, weights.lora_a, weights.lora_b, tp,
                                                                     tp_rank)
            else:
                plain[kind] = plain.get(kind, 0) + 1
                continue
        except BlockDiagLoraServeError as e:
            raise BlockDiagLoraServeError(f"{where}: {e}") from None
        weights.rank = local_r = weights.lora_a.shape[0]  # informational; scaling stays alpha / r of the adapter
        local[kind] = local.get(kind, 0) + 1
    held = {name: w.lora_a.shape[0] for name, w in lora.loras.items() if w.lora_a is not None}
    limit = manager.lora_config.max_lora_rank
    over = sorted((r, name) for name, r in held.items() if r > limit)
    if over:
        r, name = over[-1]
        why = f"{len(over)} modules served as dense LoRA, e.g. {name}"
        raise BlockDiagLoraServeError(f"{where}: {max_rank_refusal(r, limit, why)}")
    if tp_rank == 0:
        n = sum(local.values()) + sum(kept.values()) + sum(plain.values())
        line = (f"bdlora: {where}: {sum(local.values())} of {n} adapted modules block-diagonal and rank-local "
                f"({_summary(local)}): each rank holds rank {local_r} of {lora.rank} (TP {tp}, nblocks {bd.nblocks})")
        if kept:
            line += (f"; kept as dense LoRA, every rank computing their full rank: {_summary(kept)} "
                     f"({reasons[0]})")
        if plain:
            line += f"; plain LoRA modules: {_summary(plain)}"
        if splits:
            line += f"; fused modules split at load: {_split_summary(splits)}"
        logger.info("%s", line)


def _wrap_validate_legal(original):
    @functools.wraps(original)
    def validate_legal(self, lora_config):
        checked = _CHECKED_BD_LOAD.get()
        if checked is None:
            return original(self, lora_config)
        tp, nblocks = checked
        ranks = {"modules without a rank_pattern entry": self.r}
        ranks.update({f"modules matching rank_pattern {k!r}": r for k, r in self.rank_pattern.items()})
        refusal = next(filter(None, (rank_split_refusal(where, r, tp, nblocks) for where, r in ranks.items())), None)
        # each rank holds exactly r/TP of every module's rank
        refusal = refusal or max_rank_refusal(
            per_rank_rank(max(ranks.values()), tp), lora_config.max_lora_rank, split_rank(max(ranks.values()), tp)
        )
        if refusal:
            raise BlockDiagLoraServeError(refusal)
        local = copy.copy(self)
        local.use_bdlora = None
        local.r = per_rank_rank(self.r, tp)
        local.rank_pattern = {k: per_rank_rank(v, tp) for k, v in self.rank_pattern.items()}
        return original(local, lora_config)

    validate_legal.__bdlora_wrapped__ = original
    return validate_legal


def apply() -> bool:
    """Install both wrappers, the fused CPU LoRA linear method and the grouped CPU LoRA ops (or, on unverified ops,
    the slot -1 guard); idempotent.
    Returns True if the wrappers were installed by this call."""
    from vllm.lora import peft_helper, worker_manager
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    from bdlora_train.vllm_plugin import cpu_ops, cpu_punica

    if cpu_punica.install(punica_cpu):
        logger.info("bdlora: vLLM's CPU LoRA linear layers computed per layer (the batch grouped by adapter slot once "
                    "per step, every slice of a layer on one gather of its input)")
    installed = cpu_ops.install(lora_ops, torch_ops, punica_cpu)
    if installed == "grouped":
        logger.info("bdlora: vLLM's CPU LoRA ops replaced by grouped ones (one GEMM per adapter slot in the batch, "
                    "not a weight copy per token; a base token's slot -1 selects no adapter)")
    elif installed == "guarded":
        logger.info("bdlora: guarded vLLM's CPU LoRA ops: a base token's slot -1 no longer selects the last "
                    "adapter slot (the fix of vLLM 0.33.0's lora_ops.py)")
    cls_m, cls_p = worker_manager.WorkerLoRAManager, peft_helper.PEFTHelper
    if hasattr(cls_m._load_adapter, "__bdlora_wrapped__"):
        return False
    cls_m._load_adapter = _wrap_load_adapter(cls_m._load_adapter)
    cls_p.validate_legal = _wrap_validate_legal(cls_p.validate_legal)
    return True
