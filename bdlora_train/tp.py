"""Tensor-parallel BD-LoRA on PyTorch's own TP API: shard, count collectives, compare with S-LoRA sharding.

The base model is sharded with DTensor `parallelize_module`, ColwiseParallel / RowwiseParallel taken from the
model's TP plan (gloo on CPU, NCCL on GPUs). Each adapted Linear becomes a `TPLoraLinear`, which adds its LoRA
shard to the local output *inside* the layer, i.e. before RowwiseParallel's output hook issues the base
all-reduce. `CommDebugMode` then sees exactly the collectives the forward issues:

  BD-LoRA (NOTES §1)  column-parallel: rank i holds A_i (r/N × d_in) and B_ii; x A_i B_ii is its output shard.
                      row-parallel: rank i holds A_ii and B_i (d_out × r/N); x_i A_ii B_i is a partial sum the
                      base all-reduce adds up. No collective of its own.
  S-LoRA (baseline)   column-parallel: A sharded along the rank, one all-gather of the (tokens × r) A output
                      per group of sibling layers (q|k|v, gate|up); row-parallel: A sharded along d_in, one
                      all-reduce after A, B sharded along d_out (zero-padded into the base partial sum).

`bdlora tp-check` and `bdlora bench-tp` spawn N gloo ranks themselves (torch.multiprocessing) and assert the
world size.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bdlora_train.adapters import Adapter, ModuleFactors, read_adapter
from bdlora_train.files import atomic_write_text
from bdlora_train.roles import BD_A, BD_B, plan_role, tp_plan

MODES = ("base", "bdlora", "slora")
COLWISE, ROWWISE = "colwise", "rowwise"
TOLERANCE = 1e-4  # max relative error (fp32) for "sharded == unsharded"
# A Llama-shaped random model with real layer widths (NOTES §7: 1024 -> 2816) for latency; small vocab so the
# replicated lm_head does not dominate.
BENCH_DIMS = dict(
    hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
    num_key_value_heads=8, head_dim=64, vocab_size=1024, max_position_embeddings=4096,
)


# Library chatter that says nothing about the check: CommDebugMode's module tracker on ModelOutput objects,
# PEFT looking for a config.json of a "tiny:" spec, transformers deprecations reached through PEFT.
_QUIET = ("For backward hooks to be called", "Could not find a config file", "`is_gradient_checkpointing` is deprecated")


def _quiet_warnings() -> None:
    for message in _QUIET:
        warnings.filterwarnings("ignore", message=message)


class TPError(ValueError):
    """A model / adapter / TP degree combination that cannot be sharded."""


# --------------------------------------------------------------------------------------------- sharded layers


class TPLoraLinear(nn.Linear):
    """A Linear that ColwiseParallel / RowwiseParallel shard as usual, plus this rank's LoRA shard.

    Subclassing nn.Linear keeps PyTorch's own styles applicable; the LoRA term is accumulated into the local
    output and re-wrapped with the same placement (Shard(-1) or Partial), so it rides on the base layer's
    existing communication.
    """

    def __init__(self, linear: nn.Linear, style: str):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.style = style
        self.mode = "base"
        self.group: SiblingGroup | None = None  # column-parallel layers fed the same input share x·A

    def set_factors(self, factors: ModuleFactors, rank: int, world: int) -> None:
        """Cut this rank's BD-LoRA and S-LoRA shards out of the dense factors (A: r × d_in, B: d_out × r)."""
        A = factors.dense_A().to(self.weight)
        B = factors.dense_B().to(self.weight) * factors.scaling  # scaling folded in: one pass less
        r, d_in, d_out = A.shape[0], self.in_features, self.out_features
        rs, ins, outs = (slice(rank * n // world, (rank + 1) * n // world) for n in (r, d_in, d_out))
        # plain attributes, not buffers: distribute_module would turn buffers into replicated DTensors
        if self.style == COLWISE:
            self.bd_A = A[rs].contiguous()  # A_i: r/N × d_in
            self.bd_B = B[outs, rs].contiguous()  # B_ii: d_out/N × r/N
            self.sl_A = A[rs].contiguous()  # A_i, its output all-gathered
            self.sl_B = B[outs].contiguous()  # d_out/N × r
        else:
            self.bd_A = A[rs, ins].contiguous()  # A_ii: r/N × d_in/N
            self.bd_B = B[:, rs].contiguous()  # B_i: d_out × r/N
            self.sl_A = A[:, ins].contiguous()  # r × d_in/N, its output all-reduced
            self.sl_B = B[outs].contiguous()  # d_out/N × r
        self.out_slice = outs

    def forward(self, x):
        from torch.distributed.tensor import DTensor

        y = super().forward(x)  # DTensor: Shard(-1) (colwise) or Partial (rowwise)
        if self.mode == "base" or not hasattr(self, "bd_A"):
            return y
        x_local = x.to_local() if isinstance(x, DTensor) else x
        out = self._bdlora(x_local, y) if self.mode == "bdlora" else self._slora(x_local, y)
        return DTensor.from_local(out, y.device_mesh, y.placements, run_check=False)

    def _bdlora(self, x, y):
        xa = self.group.project(self, x, y.device_mesh) if self.group else x @ self.bd_A.T
        return _addmm(y.to_local(), xa, self.bd_B)

    def _slora(self, x, y):
        from torch.distributed.tensor import DTensor, Partial, Replicate

        if self.style == COLWISE:
            return _addmm(y.to_local(), self.group.project(self, x, y.device_mesh), self.sl_B)
        xa = DTensor.from_local(x @ self.sl_A.T, y.device_mesh, [Partial()], run_check=False)
        xa = xa.redistribute(y.device_mesh, [Replicate()]).to_local()  # the S-LoRA all-reduce after A
        # B is sharded along d_out: this rank's slice goes into the base partial sum, which the base all-reduce
        # completes (S-LoRA fuses its final gather into that all-reduce).
        out = y.to_local().clone()
        rows = out.view(-1, self.out_features)[:, self.out_slice]
        rows.addmm_(xa.reshape(-1, xa.shape[-1]), self.sl_B.T)
        return out


def _addmm(y, xa, B):
    """y + xa·Bᵀ in one kernel (no separate pass for the add)."""
    return torch.addmm(y.reshape(-1, y.shape[-1]), xa.reshape(-1, xa.shape[-1]), B.T).view(y.shape)


def _all_gather_last(t, mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(t, mesh, [Shard(t.dim() - 1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


class SiblingGroup:
    """Column-parallel siblings fed the same input (q|k|v, gate|up) share one x·A product.

    BD-LoRA and S-LoRA both compute x·[A_q; A_k; A_v] as one matmul (one pass over x). For S-LoRA that product
    is what must be all-gathered, so the group also issues one all-gather instead of one per layer. The first
    member called computes it for everyone; a member that sees a different input (or comes back twice)
    triggers a fresh product, so results are always right and only the counts depend on the model calling
    siblings together.
    """

    def __init__(self, members: list[TPLoraLinear]):
        self.members = members
        self.A = {"bdlora": torch.cat([m.bd_A for m in members]), "slora": torch.cat([m.sl_A for m in members])}
        self.widths = {mode: [getattr(m, attr).shape[0] for m in members] for mode, attr in (("bdlora", "bd_A"), ("slora", "sl_A"))}
        self.cache: dict[int, torch.Tensor] = {}
        self.key = None

    def project(self, member: TPLoraLinear, x, mesh):
        mode = member.mode
        key = (mode, x.data_ptr(), tuple(x.shape), tuple(x.stride()))
        if key != self.key or id(member) not in self.cache:
            widths = self.widths[mode]
            local = x @ self.A[mode].T  # tokens × Σ r_m (BD-LoRA) or Σ r_m/N (S-LoRA)
            if mode == "slora":
                full = _all_gather_last(local, mesh)  # tokens × N·Σ r_m/N, laid out rank by rank
                world = full.shape[-1] // sum(widths)
                parts = [part.flatten(-2) for part in full.unflatten(-1, (world, sum(widths))).split(widths, dim=-1)]
            else:
                parts = local.split(widths, dim=-1)
            self.cache = {id(m): part for m, part in zip(self.members, parts)}
            self.key = key
        return self.cache.pop(id(member))


# --------------------------------------------------------------------------------------------- sharding plan


def tp_styles(model, tp: int, adapter: Adapter | None = None) -> dict[str, str]:
    """{module name: "colwise"|"rowwise"} for the model's TP plan, after every check that sharding at `tp` needs.

    Works on meta-device models, so the parent process validates before spawning ranks.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    plan = tp_plan(model.config)
    if not plan:
        raise TPError(f"tp: model_type={config.model_type!r} has no tensor-parallel plan; use a Llama/Qwen2/Mistral-style decoder")
    if adapter is not None:
        _check_blocks(adapter, tp)
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    for label, value in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if value % tp:
            ok = [d for d in range(1, kv + 1) if kv % d == 0 and heads % d == 0]
            raise TPError(f"tp: --tp {tp} does not divide {label}={value} of {config.model_type}; use --tp in {ok}")
    styles = {}
    for name, module in model.named_modules():
        raw = _plan_style(name, plan) if isinstance(module, nn.Linear) else None
        if raw is None or plan_role(name, plan) is None:
            continue
        if raw not in (COLWISE, ROWWISE):  # packed / gathered / local styles shard differently from Megatron TP
            raise TPError(f"tp: {name} has TP style {raw!r}; only plain 'colwise' / 'rowwise' Linear layers are supported")
        style = raw
        split = module.out_features if style == COLWISE else module.in_features
        if split % tp:
            raise TPError(f"tp: {name} ({style}) has {split} features along the split, not divisible by --tp {tp}")
        styles[name] = style
    if adapter is not None:
        _check_roles(adapter, styles, tp)
    return styles


def _plan_style(name: str, plan: dict[str, str]) -> str | None:
    """The raw TP-plan style of a module (roles.plan_role gives only the role it implies)."""
    return next((style for pattern, style in plan.items() if plan_role(name, {pattern: style})), None)


def _check_blocks(adapter: Adapter, tp: int) -> None:
    if not adapter.is_bdlora:
        raise TPError(
            f"tp: {adapter.path} is a plain LoRA adapter (no use_bdlora): BD-LoRA sharding needs block-diagonal factors; "
            "train with BlockDiagLoraConfig(nblocks=TP)"
        )
    if adapter.nblocks % tp:
        raise TPError(
            f"tp: adapter nblocks={adapter.nblocks} is not a multiple of --tp {tp}: blocks would straddle TP shards; "
            f"use --tp in {adapter.tp_degrees()}"
        )


def _check_roles(adapter: Adapter, styles: dict[str, str], tp: int) -> None:
    expected = {COLWISE: BD_B, ROWWISE: BD_A}
    for name, module in adapter.modules.items():
        if name not in styles:
            raise TPError(f"tp: adapter module {name} is not a column- or row-parallel Linear of the base model's TP plan")
        if module.role != expected[styles[name]]:
            raise TPError(
                f"tp: {name} is {styles[name]}-parallel but the adapter stores role {module.role!r} "
                f"(needs {expected[styles[name]]!r}); its blocks do not follow the TP shards"
            )
        if module.r % tp:
            raise TPError(f"tp: {name} has rank r={module.r}, not divisible by --tp {tp}")


def shard_model(model, mesh, adapter: Adapter | None = None) -> list[TPLoraLinear]:
    """Shard `model` in place over `mesh` (its TP plan) and attach this rank's LoRA shards; returns the LoRA layers."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world, rank = mesh.size(), mesh.get_local_rank()
    styles = tp_styles(model, world, adapter)
    layers = []
    for name, factors in (adapter.modules if adapter else {}).items():
        parent_name, _, leaf = name.rpartition(".")
        layer = TPLoraLinear(model.get_submodule(name), styles[name])
        layer.set_factors(factors, rank, world)
        setattr(model.get_submodule(parent_name), leaf, layer)
        layers.append((name, layer))
    plan = {name: ColwiseParallel() if style == COLWISE else RowwiseParallel() for name, style in styles.items()}
    # Every rank already holds the full weights (same seed / same files): slice locally, no scatter.
    parallelize_module(model, mesh, plan, src_data_rank=None)
    siblings: dict[str, list[TPLoraLinear]] = {}  # by parent module: q|k|v under self_attn, gate|up under mlp
    for name, layer in layers:
        if layer.style == COLWISE:
            siblings.setdefault(name.rpartition(".")[0], []).append(layer)
    for members in siblings.values():
        group = SiblingGroup(members)
        for layer in members:
            layer.group = group
    return [layer for _, layer in layers]


def set_mode(layers: list[TPLoraLinear], mode: str) -> None:
    if mode not in MODES:
        raise TPError(f"tp: mode={mode!r}; use one of {MODES}")
    for layer in layers:
        layer.mode = mode


# --------------------------------------------------------------------------------------------- counting


def comm_counter():
    """CommDebugMode that also sums the bytes handed to each collective (CommDebugMode counts calls only)."""
    from torch.distributed.tensor.debug import CommDebugMode

    class ByteCountingCommMode(CommDebugMode):
        def __init__(self):
            super().__init__()
            self.comm_bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            packet = getattr(func, "_overloadpacket", None)
            if out is not NotImplemented and packet is not None and (packet in self.comm_registry or func.namespace == "c10d"):
                # the collective's input buffer on this rank (funcol ops take it first; c10d ops a list of tensors)
                first = args[0] if args else None
                tensors = first if isinstance(first, (list, tuple)) else [first]
                self.comm_bytes += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            return out

    return ByteCountingCommMode()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: elementwise ratios blow up near zero logits."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


# --------------------------------------------------------------------------------------------- rank workers


def _load_base(job: dict):
    from bdlora_train.models import build_tiny_model, load_model

    if job.get("overrides"):
        model = build_tiny_model(job["base"].split(":", 1)[1], seed=0, **job["overrides"])
    else:
        model = load_model(job["base"])[0]
    return model.to(job.get("device", "cpu")).eval()  # load_model and build_tiny_model give fp32 already


def _check_job(job: dict, mesh) -> dict:
    """One model + adapter: unsharded PEFT reference, then the sharded forward in each mode, counted."""
    from bdlora_train.adapters import load_adapter

    model = _load_base(job)
    adapter = read_adapter(job["adapter"])
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (2, job["tokens"]), generator=generator)
    ids = ids.to(model.device)
    with torch.no_grad():
        base_ref = model(ids, use_cache=False).logits
        peft_model = load_adapter(copy.deepcopy(model), job["adapter"]).eval()
        ref = peft_model(ids, use_cache=False).logits
        del peft_model
        layers = shard_model(model, mesh, adapter)
        result = dict(model=job["base"], adapter="random" if job.get("random") else str(job["adapter"]),
                      nblocks=adapter.nblocks, r=adapter.config.r, tokens=job["tokens"],
                      world_size=dist.get_world_size(), adapter_effect=rel_err(ref, base_ref))
        for mode in MODES:
            set_mode(layers, mode)
            with comm_counter() as comm:
                logits = model(ids, use_cache=False).logits
            result[f"{mode}_collectives"] = comm.get_total_counts()
            result[f"{mode}_bytes"] = comm.comm_bytes
            result[f"{mode}_ops"] = {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items()}
            result[f"{mode}_rel_err"] = rel_err(logits, base_ref if mode == "base" else ref)
    result["max_rel_err"] = result["bdlora_rel_err"]
    return result


def _bench_job(job: dict, mesh) -> dict:
    """Median TP forward latency per mode and token count; modes interleaved so drift hits all alike."""
    model = _load_base(job)
    layers = shard_model(model, mesh, read_adapter(job["adapter"]))
    vocab = model.config.get_text_config().vocab_size
    rows = []
    for tokens in job["token_counts"]:
        ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens)).to(model.device)
        sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)  # GPU kernels are asynchronous
        times = {mode: [] for mode in MODES}
        cpu = {mode: [] for mode in MODES}  # this process's CPU time: less disturbed by other load than wall time
        counts = {}
        with torch.no_grad():
            for mode in MODES:  # warm-up, and one counted forward
                set_mode(layers, mode)
                with comm_counter() as comm:
                    model(ids, use_cache=False)
                counts[mode] = (comm.get_total_counts(), comm.comm_bytes)
            for _ in range(job["repeats"]):
                for mode in MODES:
                    set_mode(layers, mode)
                    dist.barrier()
                    sync()
                    start, start_cpu = time.perf_counter(), time.process_time()
                    model(ids, use_cache=False)
                    sync()
                    times[mode].append(time.perf_counter() - start)
                    cpu[mode].append(time.process_time() - start_cpu)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (times, cpu))  # after timing: a forward's time is its slowest rank's
        row = dict(tokens=tokens)
        for mode in MODES:
            per_iter = [max(rank[0][mode][i] for rank in everyone) for i in range(job["repeats"])]
            per_iter_cpu = [max(rank[1][mode][i] for rank in everyone) for i in range(job["repeats"])]
            row[f"{mode}_ms"] = 1000 * statistics.median(per_iter)
            row[f"{mode}_min_ms"] = 1000 * min(per_iter)
            row[f"{mode}_cpu_ms"] = 1000 * statistics.median(per_iter_cpu)
            row[f"{mode}_collectives"], row[f"{mode}_bytes"] = counts[mode]
        for mode in ("bdlora", "slora"):
            row[f"{mode}_ratio"] = row[f"{mode}_ms"] / row["base_ms"]
            row[f"{mode}_cpu_ratio"] = row[f"{mode}_cpu_ms"] / row["base_cpu_ms"]
        rows.append(row)
    return dict(world_size=dist.get_world_size(), rows=rows)


def _rank_main(rank: int, world: int, init_file: str, kind: str, jobs: list[dict], out_dir: str, device: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    _quiet_warnings()
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(minutes=10))
    try:
        if dist.get_world_size() != world:
            raise RuntimeError(f"tp: world size {dist.get_world_size()} != --tp {world}")
        mesh = init_device_mesh(device, (world,))
        run = _check_job if kind == "check" else _bench_job
        results = [run({**job, "device": device}, mesh) for job in jobs]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def launch(kind: str, jobs: list[dict], tp: int, device: str = "cpu") -> list[dict]:
    """Spawn `tp` ranks (gloo on CPU, NCCL with one GPU each) that run `jobs`; rank 0's results once all reported."""
    import torch.multiprocessing as mp

    if device not in ("cpu", "cuda"):
        raise TPError(f"tp: --device {device!r}; use 'cpu' (gloo) or 'cuda' (NCCL, one GPU per rank)")
    if device == "cuda" and torch.cuda.device_count() < tp:
        raise TPError(f"tp: --device cuda needs {tp} GPUs for --tp {tp}, found {torch.cuda.device_count()}; use --device cpu")

    with tempfile.TemporaryDirectory(prefix="bdlora-tp-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        try:
            mp.start_processes(_rank_main, args=(tp, init_file, kind, jobs, tmp, device), nprocs=tp, join=True,
                               start_method="spawn")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            raise RuntimeError(f"tp: a rank failed (run from a script? guard it with `if __name__ == '__main__':`):\n{err}") from None
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(tp)]
    for results in per_rank:
        for result in results:
            if result["world_size"] != tp:
                raise RuntimeError(f"tp: a rank ran with world size {result['world_size']}, expected {tp}")
    if kind == "check":
        for i, result in enumerate(per_rank[0]):
            for key in ("base_collectives", "bdlora_collectives", "slora_collectives"):
                values = {results[i][key] for results in per_rank}
                if len(values) > 1:
                    raise RuntimeError(f"tp: ranks disagree on {key}: {sorted(values)}")
            for key in ("max_rel_err", "slora_rel_err", "base_rel_err"):
                result[key] = max(results[i][key] for results in per_rank)
    return per_rank[0]


# --------------------------------------------------------------------------------------------- jobs from the CLI


def base_spec(adapter: Adapter, base: str | None) -> str:
    spec = base or adapter.config.base_model_name_or_path
    if not spec:
        raise TPError(f"tp: {adapter.path} names no base_model_name_or_path; pass --base MODEL")
    from bdlora_train.models import base_spec as spec_of

    return spec_of(spec)


def _tiny_overrides(base: str, tp: int) -> dict:
    """A built-in tiny model gets enough heads for --tp (its default 4 heads / 2 KV heads fit TP 1 and 2)."""
    if 2 % tp == 0:
        return {}
    return dict(hidden_size=32 * tp, num_attention_heads=2 * tp, num_key_value_heads=tp,
                intermediate_size=128 if 128 % tp == 0 else 48 * tp)


def random_adapter(out_dir, base: str = "tiny:llama", tp: int = 2, r: int | None = None, overrides: dict | None = None,
                   seed: int = 0, b_std: float = 0.05):
    """Save a BD-LoRA adapter (nblocks = tp) with random, non-zero A *and* B on a base model; returns its path."""
    from peft import get_peft_model

    from bdlora_train.config import BlockDiagLoraConfig
    from bdlora_train.models import build_tiny_model, load_model

    r = r or tp * math.ceil(8 / tp)
    _quiet_warnings()
    model = build_tiny_model(base.split(":", 1)[1], seed=0, **overrides) if overrides else load_model(base)[0]
    peft_model = get_peft_model(model, BlockDiagLoraConfig(r=r, lora_alpha=2 * r, nblocks=tp))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero; a zero adapter would prove nothing
                param.copy_(torch.randn(param.shape, generator=generator) * b_std)
    peft_model.peft_config["default"].base_model_name_or_path = base
    peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)


def _prepare(adapter_path, tp: int, base: str | None, workdir: str, r: int | None = None) -> dict:
    """A job dict for the ranks: with no adapter, a tiny random Llama (or --base) with a random BD-LoRA adapter."""
    from bdlora_train.models import load_config, meta_model, tiny_config

    if tp < 1:
        raise TPError(f"tp: --tp {tp}; use a positive TP degree such as 2")
    if adapter_path is None:
        spec = base or "tiny:llama"
        overrides = _tiny_overrides(spec, tp) if spec.startswith("tiny:") else {}
        config = tiny_config(spec.split(":", 1)[1], **overrides) if overrides else load_config(spec)
        tp_styles(meta_model(config), tp)
        adapter_path = random_adapter(Path(workdir, "adapter"), spec, tp, r=r, overrides=overrides)
        return dict(base=spec, overrides=overrides, adapter=str(adapter_path), random=True)
    adapter = read_adapter(adapter_path)
    spec = base_spec(adapter, base)
    tp_styles(meta_model(load_config(spec)), tp, adapter)
    return dict(base=spec, overrides={}, adapter=str(adapter_path))


def tp_check(adapter=None, tp: int = 2, base: str | None = None, tokens: int = 16, extra_bases: list[str] = (),
             device: str = "cpu") -> list[dict]:
    """Run the TP check for an adapter (or random adapters on `base` and each of `extra_bases`) in one spawn."""
    with tempfile.TemporaryDirectory(prefix="bdlora-tpcheck-") as workdir:
        jobs = [_prepare(adapter, tp, base, workdir)]
        for i, extra in enumerate(extra_bases):
            jobs.append(_prepare(None, tp, extra, os.path.join(workdir, f"extra{i}")))
        for job in jobs:
            job["tokens"] = tokens
        results = launch("check", jobs, tp, device)
    for result in results:
        result["ok"] = (
            result["bdlora_collectives"] == result["base_collectives"]
            and result["slora_collectives"] > result["base_collectives"]
            and result["max_rel_err"] < TOLERANCE
            and result["slora_rel_err"] < TOLERANCE
        )
    return results


def bench_tp(tp: int = 2, token_counts=(16, 256, 2048), base: str = "bench", r: int = 16, repeats: int = 5,
             device: str = "cpu") -> dict:
    """TP forward latency of base, BD-LoRA and S-LoRA sharding (same weights, same adapter values)."""
    if repeats < 1 or any(t < 1 for t in token_counts):
        raise TPError(f"bench-tp: --repeats {repeats} and --tokens {list(token_counts)} must be positive")
    with tempfile.TemporaryDirectory(prefix="bdlora-bench-") as workdir:
        if base == "bench":
            job = dict(base="tiny:llama", overrides=dict(BENCH_DIMS), adapter=str(random_adapter(
                Path(workdir, "adapter"), "tiny:llama", tp, r=r, overrides=dict(BENCH_DIMS))))
            from bdlora_train.models import meta_model, tiny_config

            tp_styles(meta_model(tiny_config("llama", **BENCH_DIMS)), tp)
        else:
            job = _prepare(None, tp, base, workdir, r=r)
        job.update(token_counts=list(token_counts), repeats=repeats)
        result = launch("bench", [job], tp, device)[0]
    result.update(model=base, r=r, repeats=repeats, device=device, threads_per_rank=max(1, (os.cpu_count() or 1) // tp),
                  torch=torch.__version__, cpu_count=os.cpu_count(),
                  load_average=[round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None)
    return result


# --------------------------------------------------------------------------------------------- CLI


def format_check(result: dict) -> str:
    lines = [
        f"model {result['model']}  adapter {result['adapter']}  nblocks {result['nblocks']}  r {result['r']}  "
        f"world size {result['world_size']}  tokens {result['tokens']} x 2",
        "",
        "| sharding | collectives / forward | bytes / forward | ops | rel. err vs unsharded |",
        "|---|---:|---:|---|---:|",
    ]
    for mode, label in (("base", "base model"), ("bdlora", "BD-LoRA"), ("slora", "S-LoRA")):
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(result[f"{mode}_ops"].items())) or "-"
        lines.append(f"| {label} | {result[f'{mode}_collectives']} | {result[f'{mode}_bytes']:,} | {ops} | "
                     f"{result[f'{mode}_rel_err']:.2e} |")
    verdict = "OK" if result["ok"] else "FAILED"
    lines += ["", f"{verdict}: BD-LoRA adds {result['bdlora_collectives'] - result['base_collectives']} collectives, "
              f"S-LoRA adds {result['slora_collectives'] - result['base_collectives']}; "
              f"max rel. err {result['max_rel_err']:.2e} (tolerance {TOLERANCE:g}); "
              f"adapter changes the logits by {result['adapter_effect']:.2e}"]
    return "\n".join(lines)


def check_cli(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bdlora tp-check", description="Shard a BD-LoRA adapter over N gloo ranks, "
                                     "compare with the unsharded PEFT model and count collectives (base, BD-LoRA, S-LoRA).")
    parser.add_argument("adapter", nargs="?", help="adapter directory; omitted: a tiny random Llama with a random BD-LoRA adapter")
    parser.add_argument("--tp", type=int, required=True, help="number of ranks (TP degree)")
    parser.add_argument("--base", help="base model spec (default: the adapter's base_model_name_or_path, or tiny:llama)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per sequence (batch of 2)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu: gloo ranks (default); cuda: NCCL, one GPU per rank (not yet run on GPUs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        raise TPError(f"tp-check: --tokens {args.tokens}; use a positive count")
    result = tp_check(args.adapter, args.tp, args.base, args.tokens, device=args.device)[0]
    print(format_check(result))
    if args.json:
        print(json.dumps(result))
    return 0 if result["ok"] else 1


def format_bench(result: dict) -> str:
    lines = [
        f"bench-tp: {result['model']}  world size {result['world_size']}  r {result['r']}  "
        f"{result['threads_per_rank']} thread(s) per rank  median of {result['repeats']}  torch {result['torch']}  "
        f"{result['cpu_count']} CPUs, load average {result['load_average']}",
        "",
        "| tokens | base ms | BD-LoRA ms | BD-LoRA / base | S-LoRA ms | S-LoRA / base | min ms base / BD / S "
        "| CPU ms base / BD / S | CPU BD / base | CPU S / base | collectives base / BD / S |",
        "|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['tokens']} | {row['base_ms']:.2f} | {row['bdlora_ms']:.2f} | {row['bdlora_ratio']:.3f} | "
            f"{row['slora_ms']:.2f} | {row['slora_ratio']:.3f} | {row['base_min_ms']:.1f} / {row['bdlora_min_ms']:.1f} / "
            f"{row['slora_min_ms']:.1f} | {row['base_cpu_ms']:.1f} / {row['bdlora_cpu_ms']:.1f} / {row['slora_cpu_ms']:.1f} | "
            f"{row['bdlora_cpu_ratio']:.3f} | {row['slora_cpu_ratio']:.3f} | "
            f"{row['base_collectives']} / {row['bdlora_collectives']} / {row['slora_collectives']} |"
        )
    return "\n".join(lines)


def bench_cli(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bdlora bench-tp", description="TP forward latency: base vs BD-LoRA vs "
                                     "S-LoRA sharding, medians and ratios to base.")
    parser.add_argument("--tp", type=int, default=2, help="number of ranks (TP degree)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 256, 2048], help="token counts (batch 1)")
    parser.add_argument("--base", default="bench", help="'bench' (random Llama, hidden 1024, MLP 2816, 4 layers) or a model spec")
    parser.add_argument("--rank", type=int, default=16, help="adapter rank r (a multiple of --tp)")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per mode and token count")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu: gloo ranks (default); cuda: NCCL, one GPU per rank (not yet run on GPUs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--out", help="also write the JSON result to this file (atomically)")
    args = parser.parse_args(argv)
    if args.rank % args.tp:
        raise TPError(f"bench-tp: --rank {args.rank} is not a multiple of --tp {args.tp}")
    result = bench_tp(args.tp, args.tokens, args.base, args.rank, args.repeats, device=args.device)
    print(format_bench(result))
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(check_cli())
