"""Training under tensor parallelism on CPU (gloo): `torchrun --nproc_per_node 2 -m bdlora_train.train` with the tiny
TP recipe against the same recipe in one process; kill -9 and resume; two torchrun agents rendezvousing on this
machine; every refusal before the weights load; `tp-check --train` and its analytic traffic.

How exactness is proven (tests/exactness.py: bounds that hold on any CPU): every TP / EP run is compared with the
one-process run in float64, to 1e-10 (measured <= 4e-14), and a planted sharding bug shows at O(1)
(`test_a_planted_sharding_bug_fails_the_float64_comparison`); one float32 run per family is then within twice the
one-process float32 run's own distance to the float64 run.
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bdlora_train import cli
from bdlora_train.core.errors import RecipeError, TPError
from bdlora_train.tp_runtime.preflight import check_tp_training
from bdlora_train.train import load_recipe, train
from bdlora_train.train.rundir import LOCK_NAME
from tests.exactness import EXACT, EXACT_BOUND, assert_exact, assert_float32_rounding_only, worst_rel_err
from tests.launching import ROOT, cli_env, free_port, stock_peft, torchrun

RECIPE = "recipes/tiny/bdlora_tp2.yaml"
DDP_RECIPE = "recipes/tiny/bdlora.yaml"
STEPS = 24  # checkpoints at 8, 16, 24 (save_total_limit 2 keeps 16 and 24)
SGD = {"optim": "sgd", "learning_rate": 0.1}  # the float32 checks' optimizer (`check_float32`)

pytestmark = pytest.mark.usefixtures("one_thread")


def train_cmd(recipe: str, out: Path, overrides: dict) -> list[str]:
    return ["-m", "bdlora_train.train", recipe, f"output_dir={out}", *(f"{k}={v}" for k, v in overrides.items())]


def run_torchrun(out: Path, *, recipe: str = RECIPE, accelerate: bool = False, timeout: int = 400, **overrides) -> dict:
    """One node, 2 ranks started by torchrun (or by `accelerate launch` with the shipped TP launch config), in float64
    unless `torch_dtype` says otherwise; the run's metrics.json, with its stderr and the rank-0 summary lines."""
    settings = {**EXACT, "max_steps": STEPS, "save_steps": 8, "logging_steps": 1, **overrides}
    launcher = torchrun(2)
    if accelerate:
        config = ["--config_file", "recipes/accelerate/tp.yaml", "--num_processes", "2"]
        launcher = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            *config,
            "--main_process_port",
            str(free_port()),
        ]
    proc = subprocess.run(
        [*launcher, *train_cmd(recipe, out, settings)],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return _metrics(out, proc.stdout, proc.stderr)


def run_two_agents(out: Path, nproc_per_node: int, *, recipe: str, timeout: int = 400, **overrides) -> dict:
    """Two torchrun agents on this machine, as on two nodes: the documented multi-node launch line with the
    rendezvous endpoint on 127.0.0.1 (c10d numbers the nodes)."""
    port = free_port()
    settings = {**EXACT, "save_steps": 0, "logging_steps": 1, **overrides}
    cmd = [*torchrun(nproc_per_node, nodes=2, port=port, job=out.name), *train_cmd(recipe, out, settings)]
    env = cli_env(ACCELERATE_USE_CPU="true") if recipe == DDP_RECIPE else cli_env()  # gloo DDP on CPU
    agents = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [agent.communicate(timeout=timeout) for agent in agents]
    for agent, (stdout, stderr) in zip(agents, outputs):
        assert agent.returncode == 0, (stdout[-2000:], stderr[-4000:])
    return _metrics(out, "".join(o[0] for o in outputs), "".join(o[1] for o in outputs))


def _metrics(out: Path, stdout: str, stderr: str) -> dict:
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["_summary"] = [line for line in stdout.splitlines() if line.startswith("bdlora train:")]
    metrics["_stderr"] = stderr
    return metrics


def run_single(out: Path, recipe: str = RECIPE, **overrides) -> dict:
    """The same recipe in this process, without TP (tp_size=1), in float64 unless `torch_dtype` says otherwise: the
    reference."""
    settings = {**EXACT, "tp_size": 1, "max_steps": STEPS, "save_steps": 8, "logging_steps": 1, **overrides}
    train(load_recipe(str(ROOT / recipe), [f"output_dir={out}", *(f"{k}={v}" for k, v in settings.items())]))
    return json.loads((out / "metrics.json").read_text())


def adapter(out: Path) -> dict:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def losses(out: Path, step: int) -> list[float]:
    """The logged loss of every step, from the last checkpoint's trainer_state.json (written by Trainer)."""
    history = json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def assert_same_adapter(got: dict, ref: dict) -> None:
    """Two float64 runs' adapters agree to EXACT_BOUND (tests/exactness.py), and it trained."""
    assert_exact(got, ref)
    assert any(v.abs().sum() > 0 for k, v in got.items() if "lora_B" in k)  # B starts at zero: it trained


def no_library_warnings(stderr: str) -> None:
    noisy = [line for line in stderr.splitlines() if "Warning" in line or "warn(" in line or "[transformers]" in line]
    assert not noisy, noisy[:5]


@pytest.fixture(scope="module")
def tp_bdlora(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2-bdlora") / "run"
    return out, run_torchrun(out)


@pytest.fixture(scope="module")
def single_bdlora(tmp_path_factory):
    out = tmp_path_factory.mktemp("single-bdlora") / "run"
    return out, run_single(out)


# ------------------------------------------------------------------------------------- exactness at TP 2


def test_tp2_bdlora_trains_the_single_process_adapter(tp_bdlora, single_bdlora):
    (out, metrics), (ref_out, ref) = tp_bdlora, single_bdlora
    assert metrics["world_size"] == 2 and metrics["parallelism"] == "tp2" and ref["parallelism"] == "single"
    assert metrics["nblocks"] == 2 and metrics["steps"] == STEPS
    assert metrics["trainable_params"] == ref["trainable_params"]  # the global adapter, not one rank's shards
    assert metrics["tokens_seen"] == ref["tokens_seen"]  # the two ranks of a TP group read the same batch
    assert len(metrics["_summary"]) == 1  # rank 0 only
    no_library_warnings(metrics["_stderr"])
    assert_same_adapter(adapter(out), adapter(ref_out))
    tp_losses, ref_losses = losses(out, STEPS), losses(ref_out, STEPS)
    assert len(tp_losses) == STEPS
    torch.testing.assert_close(torch.tensor(tp_losses), torch.tensor(ref_losses), rtol=EXACT_BOUND, atol=0)
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config == json.loads((ref_out / "adapter" / "adapter_config.json").read_text())


def check_float32(out: Path, recipe: str = RECIPE, one_process: dict | None = None, **common) -> None:
    """The float32 check of one family (tests/exactness.py): the TP (or EP) run, the one-process run and the
    one-process float64 run, stepping with SGD (Adam's normalised steps turn a rounding difference on a near-zero
    gradient into a step of about the learning rate: measured, the TP-to-one-process ratio of distances then spread
    0.70-1.57 over families; with SGD 0.999-1.011)."""
    common = {**common, **SGD, "save_steps": 0}
    one = one_process or {}
    run_torchrun(out / "tp32", recipe=recipe, torch_dtype="float32", **common)
    run_single(out / "single32", recipe=recipe, torch_dtype="float32", **common, **one)
    run_single(out / "single64", recipe=recipe, **common, **one)
    assert_float32_rounding_only(adapter(out / "tp32"), adapter(out / "single32"), adapter(out / "single64"))


def test_tp2_bdlora_in_float32_is_the_single_process_adapter_up_to_its_rounding(tmp_path):
    check_float32(tmp_path)


FAULTS = [
    # (the bug planted in the TP runtime (tests/tp_fault.py), the recipe's method)
    pytest.param("slice", "bdlora", id="a-block-slice-off-by-one"),
    pytest.param("reduction", "lora", id="a-missed-gradient-reduction"),
]


@pytest.mark.parametrize(("fault", "method"), FAULTS)
def test_a_planted_sharding_bug_fails_the_float64_comparison(tmp_path, single_bdlora, fault, method):
    """What the float64 comparisons catch: one bug in the TP runtime moves the adapter by O(1), not by rounding."""
    common = dict(method=method, max_steps=12, save_steps=0)
    proc = subprocess.run(
        [*torchrun(2), "-m", "tests.tp_fault", fault, *train_cmd(RECIPE, tmp_path / "tp", {**EXACT, **common})[2:]],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]  # a wrong shard is no crash: only the comparison sees it
    run_single(tmp_path / "single", **common)
    err = worst_rel_err(adapter(tmp_path / "tp"), adapter(tmp_path / "single"))
    assert err > 1e-2, err  # O(1): measured 1.9 (the slice) and 0.17 (the reduction), 12 steps
    with pytest.raises(AssertionError, match="rel. err"):
        assert_same_adapter(adapter(tmp_path / "tp"), adapter(tmp_path / "single"))


def test_tp2_checkpoints_are_complete_gathered_adapters(tp_bdlora, single_bdlora):
    """A checkpoint is PEFT's full adapter plus the optimizer state of every shard, not one rank's slice."""
    out, _ = tp_bdlora
    ref_out, _ = single_bdlora
    ckpt, ref_ckpt = out / "checkpoint-16", ref_out / "checkpoint-16"
    assert_same_adapter(
        load_file(str(ckpt / "adapter_model.safetensors")), load_file(str(ref_ckpt / "adapter_model.safetensors"))
    )
    assert (ckpt / "optimizer.pt").is_file() and (ckpt / "scheduler.pt").is_file()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-16", "checkpoint-24"]
    assert not list(out.glob(".tmp-*"))


def test_tp_adapter_loads_in_stock_peft(tp_bdlora, single_bdlora):
    """A fresh interpreter with transformers + PEFT alone loads the TP run's adapter and computes what PEFT computes
    with the single-process run's adapter."""
    from peft import PeftModel

    from bdlora_train.models import build_tiny_model

    stock = stock_peft(tp_bdlora[0] / "adapter")
    assert stock["bd_variant"] and not stock["bdlora_imported"]
    torch.manual_seed(0)
    reference = PeftModel.from_pretrained(build_tiny_model("llama", seed=0), str(single_bdlora[0] / "adapter"))
    with torch.no_grad():
        expected = reference.eval()(input_ids=torch.arange(3, 40).view(1, -1)).logits[0, -1]
    torch.testing.assert_close(torch.tensor(stock["logits"]), expected, rtol=1e-4, atol=1e-4)


def test_tp2_plain_lora_trains_the_single_process_adapter(tmp_path):
    """The baseline under TP: PEFT's LoRA layout (lora_A replicated on column layers), its extra collectives paid.
    Started by `accelerate launch` with recipes/accelerate/tp.yaml, and with gradient checkpointing (as the 70B TP
    recipe trains): the adapter is still the one-process run's, trained without it."""
    metrics = run_torchrun(
        tmp_path / "tp", accelerate=True, method="lora", max_steps=12, save_steps=0, gradient_checkpointing="true"
    )
    ref = run_single(tmp_path / "single", method="lora", max_steps=12, save_steps=12)
    assert metrics["world_size"] == 2 and metrics["parallelism"] == "tp2" and metrics["method"] == "lora"
    assert_same_adapter(adapter(tmp_path / "tp"), adapter(tmp_path / "single"))
    assert metrics["trainable_params"] == ref["trainable_params"]
    assert abs(metrics["final_loss"] - ref["final_loss"]) <= EXACT_BOUND * abs(ref["final_loss"])


def test_tp2_with_two_blocks_per_rank(tmp_path):
    """nblocks = 2 x tp_size (an adapter served at TP 4, trained at TP 2): each rank trains two whole blocks; the
    block-diagonal factors at their own learning rate (bd_lr_ratio auto = 4), the rank-local DTensors in its group."""
    from bdlora_train.models import build_tiny_model, tiny_tokenizer

    model_dir = tmp_path / "model"  # 8 heads / 4 KV heads: nblocks 4 lines up with them
    build_tiny_model("llama", seed=0, num_attention_heads=8, num_key_value_heads=4).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    common = dict(model=model_dir, nblocks=4, max_steps=6, save_steps=0, bd_lr_ratio="auto")
    metrics = run_torchrun(tmp_path / "tp", **common)
    run_single(tmp_path / "single", **common)
    assert metrics["nblocks"] == 4 and metrics["parallelism"] == "tp2" and metrics["bd_lr_ratio"] == 4
    assert_same_adapter(adapter(tmp_path / "tp"), adapter(tmp_path / "single"))


DEEPSEEK_TARGETS = "[q_b_proj, kv_b_proj, o_proj, experts.gate_up_proj, experts.down_proj]"  # its tp_size=1 fix
FAMILIES = [
    # (family, recipe overrides): MoE experts (packed gate|up, row-parallel down), dense-stored Linear factors, fused
    # projections (Phi-3 qkv|gate_up, GLM-4 gate_up), layers the plan leaves replicated (Qwen2-MoE's shared expert,
    # DeepSeek's MLA projections)
    pytest.param("qwen3_moe", {}, id="qwen3_moe"),
    pytest.param("phi3", {}, id="phi3"),
    pytest.param("mixtral", {}, id="mixtral", marks=pytest.mark.slow),
    pytest.param("qwen2_moe", {}, id="qwen2_moe", marks=pytest.mark.slow),
    pytest.param("glm4", {}, id="glm4", marks=pytest.mark.slow),
    # Llama-4: transposed experts, a shared expert whose TP output its MoE adds into in place (copied:
    # tp_runtime/dispatch.py
    # MODIFIED_IN_PLACE)
    pytest.param("llama4", {}, id="llama4", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("family", "overrides"), FAMILIES)
def test_moe_and_fused_families_train_the_single_process_adapter_under_tp(tmp_path, family, overrides):
    """The default targets (experts included) at TP 2: each rank holds its pieces of every factor, and the saved
    adapter, its layout record and its parameter count are the one-process run's: exactly in float64, up to the
    one-process run's own rounding in float32."""
    common = dict(model=f"tiny:{family}", max_steps=6, save_steps=0, **overrides)
    metrics = run_torchrun(tmp_path / "tp", **common)
    ref = run_single(tmp_path / "single", **common)
    no_library_warnings(metrics["_stderr"])
    assert metrics["parallelism"] == "tp2" and metrics["trainable_params"] == ref["trainable_params"]
    got, want = adapter(tmp_path / "tp"), adapter(tmp_path / "single")
    assert_same_adapter(got, want)
    check_float32(tmp_path, model=f"tiny:{family}", max_steps=6, **overrides)
    layout = "bdlora_layout.json"
    assert (tmp_path / "tp" / "adapter" / layout).read_text() == (tmp_path / "single" / "adapter" / layout).read_text()
    if family not in ("phi3", "glm4"):  # dense: fused projections only
        assert any(".experts." in key for key in got)  # the expert factors trained under TP
        # the experts split over the ranks (transformers 5.25's plans leave them whole; arch/scope.py split_experts):
        # with whole experts a rank would hold them all and at least half of the rest, and with split ones it holds
        # at most half of them and all of the rest
        from bdlora_train.models import build_tiny_model

        params = build_tiny_model(family, seed=0, dtype=torch.float64).named_parameters()
        sizes = [(p.numel() * 8, ".experts." in name) for name, p in params]
        whole, experts = sum(n for n, _ in sizes), sum(n for n, is_expert in sizes if is_expert)
        ranks = metrics["per_rank_parameter_bytes"]
        assert len(ranks) == 2, ranks
        assert all(r["base"] <= whole - experts / 2 and r["base"] < experts + (whole - experts) / 2 for r in ranks), (
            ranks, whole, experts)
        assert ref["per_rank_parameter_bytes"] is None  # one process


@pytest.mark.slow  # the EP resume test below runs the same piece <-> PEFT conversions in the fast suite
def test_moe_tp_run_resumes_from_a_checkpoint_to_the_uninterrupted_adapter(tmp_path):
    """A checkpoint of a TP MoE run holds the expert factors and their optimizer state in PEFT's layout; a run
    resuming from it ends with the uninterrupted run's adapter."""
    common = dict(model="tiny:qwen3_moe", max_steps=6, save_steps=3, save_total_limit=3)
    run_torchrun(tmp_path / "full", **common)
    state = torch.load(tmp_path / "full" / "checkpoint-3" / "optimizer.pt", weights_only=True)["state"]
    saved = load_file(str(tmp_path / "full" / "checkpoint-3" / "adapter_model.safetensors"))
    experts = [key for key in state if ".experts." in key and "lora_B" in key]
    assert experts and all(state[key]["exp_avg"].dim() == 2 for key in experts)  # PEFT's 2-D tensors, not pieces
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-3", resumed / "checkpoint-3")
    metrics = run_torchrun(resumed, **common)
    assert metrics["resumed_from"] and metrics["steps_this_run"] == 3
    assert_same_adapter(adapter(resumed), adapter(tmp_path / "full"))
    assert any(".experts." in key for key in saved)


# ------------------------------------------------------------------------------------- expert parallelism

EP_RECIPE = "recipes/tiny/bdlora_moe_ep2.yaml"  # tiny Qwen3-MoE, fsdp_size 2 x ep_size 2: 2 whole experts per rank
ONE_PROCESS = dict(tp_size=1, fsdp_size=1, ep_size=1, per_device_train_batch_size=8)  # both EP ranks' batches


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep2") / "run"
    return out, run_torchrun(out, recipe=EP_RECIPE, max_steps=6, save_steps=3, save_total_limit=3)


def test_expert_parallel_trains_the_single_process_adapter(tmp_path, ep_run):
    """EP 2 x FSDP 2: each rank holds two of the four experts with their whole factors and reads half of the
    one-process batch; the adapter is the one-process run's (exactly in float64, up to its rounding in float32)."""
    out, metrics = ep_run
    no_library_warnings(metrics["_stderr"])
    ref = run_single(tmp_path / "single", recipe=EP_RECIPE, max_steps=6, save_steps=0, **ONE_PROCESS)
    assert metrics["parallelism"] == "ep2 x fsdp2" and metrics["trainable_params"] == ref["trainable_params"]
    got, got_single = adapter(out), adapter(tmp_path / "single")
    assert_same_adapter(got, got_single)
    assert any(".experts." in key for key in got)
    layout = "bdlora_layout.json"  # the record inspect, the exports and check-serving read: the one-process run's
    assert (out / "adapter" / layout).read_text() == (tmp_path / "single" / "adapter" / layout).read_text()
    check_float32(tmp_path, recipe=EP_RECIPE, one_process=ONE_PROCESS, max_steps=6)


def test_expert_parallel_run_resumes_from_a_checkpoint_to_the_uninterrupted_adapter(tmp_path, ep_run):
    """An EP checkpoint holds every expert's factors and optimizer state in PEFT's layout (gathered from the ranks
    that own them); a run resuming from it ends with the uninterrupted run's adapter."""
    out, _ = ep_run
    state = torch.load(out / "checkpoint-3" / "optimizer.pt", weights_only=True)["state"]
    experts = [key for key in state if ".experts." in key and "lora_A" in key]
    assert experts and all(state[key]["exp_avg"].dim() == 2 for key in experts)  # PEFT's 2-D tensors, not pieces
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-3", resumed / "checkpoint-3")
    metrics = run_torchrun(resumed, recipe=EP_RECIPE, max_steps=6, save_steps=3, save_total_limit=3)
    assert metrics["resumed_from"] and metrics["steps_this_run"] == 3
    assert_same_adapter(adapter(resumed), adapter(out))


EP_CASES = [
    # (recipe overrides, the one-process run's): TP attention with EP experts on the same 2 ranks (one shared batch);
    # plain LoRA (a rank per projection on the packed gate|up); families with shared experts, MLA, dense first layers
    pytest.param(dict(tp_size=2, fsdp_size=1, per_device_train_batch_size=8), {}, id="tp2-ep2"),
    pytest.param(dict(method="lora"), {"method": "lora"}, id="lora"),
    pytest.param(dict(model="tiny:mixtral"), {"model": "tiny:mixtral"}, id="mixtral"),
    pytest.param(dict(model="tiny:qwen2_moe"), {"model": "tiny:qwen2_moe"}, id="qwen2_moe"),
    pytest.param(
        dict(model="tiny:deepseek_v3", lora_target_modules=DEEPSEEK_TARGETS),
        dict(model="tiny:deepseek_v3", lora_target_modules=DEEPSEEK_TARGETS),
        id="deepseek_v3",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "single"), EP_CASES)
def test_more_expert_parallel_layouts_train_the_single_process_adapter(tmp_path, overrides, single):
    common = dict(max_steps=6, save_steps=0)
    metrics = run_torchrun(tmp_path / "ep", recipe=EP_RECIPE, **common, **overrides)
    no_library_warnings(metrics["_stderr"])
    run_single(tmp_path / "single", recipe=EP_RECIPE, **common, **{**ONE_PROCESS, **single})
    assert_same_adapter(adapter(tmp_path / "ep"), adapter(tmp_path / "single"))


# ------------------------------------------------------------------------------------- kill -9 and resume


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (torchrun starts each rank in a session of its own, so a process-group kill
    would miss them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_at_first_checkpoint(out: Path, recipe: str) -> None:
    """Start the recipe under torchrun (STEPS steps, a checkpoint every 8) and kill -9 every rank and the agent once
    checkpoint-8 exists, as a node failure would."""
    settings = {**EXACT, "max_steps": STEPS, "save_steps": 8, "logging_steps": 1}
    cmd = [*torchrun(2), *train_cmd(recipe, out, settings)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoint-8").is_dir():
            assert proc.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.02)
        for pid in [*_descendants(proc.pid), proc.pid]:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (out / "adapter").exists(), "the run finished before the kill; the test needs a slower run"


def test_tp_run_killed_with_9_resumes_to_the_uninterrupted_adapter(tmp_path, tp_bdlora):
    out = tmp_path / "killed"
    _kill_at_first_checkpoint(out, RECIPE)
    metrics = run_torchrun(out)  # the very same command again
    assert metrics["resumed_from"] and 0 < metrics["steps_this_run"] < STEPS and metrics["steps"] == STEPS
    assert_same_adapter(adapter(out), adapter(tp_bdlora[0]))


@pytest.mark.slow
def test_expert_parallel_run_killed_with_9_resumes_to_the_uninterrupted_adapter(tmp_path):
    run_torchrun(tmp_path / "full", recipe=EP_RECIPE)
    out = tmp_path / "killed"
    _kill_at_first_checkpoint(out, EP_RECIPE)
    metrics = run_torchrun(out, recipe=EP_RECIPE)
    assert metrics["resumed_from"] and 0 < metrics["steps_this_run"] < STEPS and metrics["steps"] == STEPS
    assert_same_adapter(adapter(out), adapter(tmp_path / "full"))


# ------------------------------------------------------------------------------------- two agents ("nodes")


def test_two_agents_data_parallel_train_the_one_process_adapter(tmp_path):
    """TP 1 x data-parallel 2 over two torchrun agents (one rank each) = one process with the doubled batch."""
    metrics = run_two_agents(tmp_path / "dp2", 1, recipe=DDP_RECIPE, max_steps=6, per_device_train_batch_size=4)
    assert metrics["world_size"] == 2 and metrics["parallelism"] == "ddp"
    run_single(tmp_path / "single", recipe=DDP_RECIPE, tp_size=1, max_steps=6, save_steps=0)
    assert_same_adapter(adapter(tmp_path / "dp2"), adapter(tmp_path / "single"))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny:llama", "tiny:qwen3_moe"])
def test_two_agents_tp2_x_fsdp2_train_the_one_process_adapter(tmp_path, model):
    """TP 2 x FSDP 2: four ranks over two agents; each FSDP replica reads half of the one-process batch (a MoE's
    expert pieces too: FSDP2 manages only the frozen base)."""
    metrics = run_two_agents(tmp_path / "tpfsdp", 2, recipe=RECIPE, fsdp_size=2, max_steps=6,
                             per_device_train_batch_size=4, model=model)  # fmt: skip
    assert metrics["world_size"] == 4 and metrics["parallelism"] == "tp2 x fsdp2"
    no_library_warnings(metrics["_stderr"])
    run_single(tmp_path / "single", max_steps=6, save_steps=0, model=model)
    assert_same_adapter(adapter(tmp_path / "tpfsdp"), adapter(tmp_path / "single"))


# ------------------------------------------------------------------------------------- refused before loading

REFUSALS = [
    # (overrides, WORLD_SIZE the launcher would set, error type, what the one line says)
    (["nblocks=3"], 2, RecipeError, "nblocks=3 is not a multiple of tp_size=2"),
    ([], 1, RecipeError, "needs 2 processes but the launcher started 1; launch with `torchrun --nproc_per_node 2"),
    (["tp_size=4"], 4, TPError, "tp_size=4 does not divide num_key_value_heads=2"),
    (["model=tiny:opt"], 2, TPError, "transformers ships no tensor-parallel plan for opt"),
    (["load_in_4bit=true"], 2, RecipeError, "load_in_4bit=true with tp_size=2"),
    (["deepspeed=recipes/accelerate/zero3.json"], 2, RecipeError, "deepspeed with tp_size=2"),
    (["method=peft-bdlora"], 2, RecipeError, "method=peft-bdlora with tp_size=2"),
    (["tp_size=1", "fsdp_size=2"], 2, RecipeError, "fsdp_size=2 with tp_size=1"),
    (["model=tiny:phi3", "fsdp_size=2"], 4, TPError, "gate_up_proj is a fused projection [128, 128]: its rank re-cuts"),
    # expert parallelism (ep_size): every expert on one rank, a family with an EP plan, whole experts per rank
    (["tp_size=1", "fsdp_size=4", "ep_size=2"], 4, RecipeError, "ep_size must be tp_size x fsdp_size"),
    (["ep_size=2", "dp_replicate_size=2"], 4, RecipeError, "use dp_replicate_size=1 fsdp_size=2 ep_size=4"),
    (["tp_size=1", "fsdp_size=2", "ep_size=2"], 2, TPError, "no expert-parallel plan for llama"),
    (["model=tiny:qwen3_moe", "tp_size=1", "fsdp_size=3", "ep_size=3"], 3, TPError, "does not divide the 4 experts"),
    (
        ["model=tiny:qwen3_moe", "tp_size=1", "fsdp_size=2", "ep_size=2", "lora_target_modules=[q_proj,v_proj]"],
        2,
        TPError,
        "ep_size=2 but the adapter adapts no expert parameter",
    ),
    (
        ["model=tiny:deepseek_v3", f"lora_target_modules={DEEPSEEK_TARGETS}"],
        2,
        TPError,
        "deepseek_v3 under TP (tp_size=2) does not yet train the one-process adapter",
    ),
]


@pytest.mark.parametrize(("overrides", "world", "error", "message"), REFUSALS, ids=[" ".join(r[0]) for r in REFUSALS])
def test_tp_recipe_refused_in_one_line_before_the_weights_load(tmp_path, monkeypatch, overrides, world, error, message):
    import bdlora_train.train.setup as run

    def load_model(*args, **kwargs):
        raise AssertionError("the weights were loaded before the refusal")

    monkeypatch.setattr(run, "load_model", load_model)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    out = tmp_path / "run"
    with pytest.raises(error) as caught:
        train(load_recipe(str(ROOT / RECIPE), [f"output_dir={out}", *overrides]))
    assert message in str(caught.value) and "\n" not in str(caught.value)
    written = [p.name for p in out.iterdir()] if out.exists() else []
    assert set(written) <= {LOCK_NAME}  # nothing but the run's lock


def test_a_size_the_installed_transformers_lacks_is_refused(tmp_path, monkeypatch):
    """transformers 5.19's DistributedConfig has tp_size and fsdp_size but no dp_replicate_size (5.24 has all)."""
    import transformers.distributed

    class OldDistributedConfig:  # the 5.19 signature
        def __init__(self, tp_size=None, tp_plan=None, fsdp_size=None):
            pass

    monkeypatch.setattr(transformers.distributed, "DistributedConfig", OldDistributedConfig)
    monkeypatch.setenv("WORLD_SIZE", "4")
    recipe = load_recipe(str(ROOT / RECIPE), [f"output_dir={tmp_path / 'run'}", "dp_replicate_size=2"])
    with pytest.raises(RecipeError, match=r"dp_replicate_size=2: transformers .*'s DistributedConfig has no "):
        train(recipe)


# ------------------------------------------------------------------------------------- tp-check --train


def test_tp_check_train_counts_zero_extra_collectives_for_bdlora(capsys):
    from peft import LoraConfig

    from bdlora_train.core.roles import DEFAULT_TARGET_MODULES
    from bdlora_train.models import meta_model, tiny_config
    from bdlora_train.peft_integration.resolve import resolve
    from bdlora_train.tp_diagnostics.traffic import training_step_traffic

    assert cli.main(["tp-check", "--train", "--tp", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] and result["world_size"] == 2
    assert result["bdlora"]["extra_collectives"] == 0 and result["bdlora"]["extra_bytes"] == 0
    assert result["bdlora"]["grad_rel_err"] < result["tolerance"]
    assert result["lora"]["grad_rel_err"] < result["tolerance"]
    # PEFT's layout under TP: one all-reduce per adapted projection (lora_A's gradient on the 5 column-parallel
    # ones, x A^T on the 2 row-parallel ones) in each of the tiny Llama's 2 layers
    assert result["lora"]["extra_collectives"] == 2 * 7
    # the analytic count the docs quote for Llama-3.1-8B / 70B, on the same model, in fp32, equals the counted one
    meta = meta_model(tiny_config("llama"))
    targets = resolve(meta, LoraConfig(r=result["r_lora"], target_modules=list(DEFAULT_TARGET_MODULES)), 1)
    tokens = result["batch"] * result["tokens"]
    styles = check_tp_training(meta, targets, 2, block_diagonal=False)
    worked_out = training_step_traffic(targets, styles, tokens, activation_bytes=4, grad_bytes=4)
    assert worked_out["lora"] == {"collectives": result["lora"]["extra_collectives"],
                                  "bytes": result["lora"]["extra_bytes"]}  # fmt: skip


def test_tp_check_train_on_a_moe_model_counts_zero_extra_collectives_for_bdlora(capsys):
    """Mixtral's default targets, experts included: BD-LoRA rides on the base's own all-reduces; plain LoRA on the
    same modules pays one all-reduce per adapted projection, and per expert parameter: the experts are split over the
    ranks (transformers' plan through 5.24; from 5.25, whose plans leave them whole, the entries the toolkit adds:
    arch/scope.py split_experts)."""
    from bdlora_train.arch.scope import split_experts
    from bdlora_train.budget import lora_baseline
    from bdlora_train.models import meta_model, tiny_config
    from bdlora_train.peft_integration.resolve import resolve
    from bdlora_train.tp_diagnostics.traffic import training_step_traffic

    assert cli.main(["tp-check", "--train", "--tp", "2", "--model", "tiny:mixtral", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] and result["bdlora"]["extra_collectives"] == 0 and result["bdlora"]["extra_bytes"] == 0
    assert max(result[m]["grad_rel_err"] for m in ("bdlora", "lora")) < result["tolerance"]
    # 2 layers x (q, k, v, o [+ gate_up, down]): A's gradient (column side) or B's (row side) all-reduced, x A^T on o
    assert result["lora"]["extra_collectives"] == 2 * 6
    # the analytic traffic (tp_diagnostics/traffic.py) on the same meta model, in fp32, equals the counted one: per
    # layer, hidden 64, 4 experts of intermediate 64, r 8, 2 x 16 tokens, 4-byte elements: lora_A's gradient (8 x 64)
    # on q, k, v, x A^T (32 x 8) on o [, lora_A's gradient (8*4 x 64) on gate_up, lora_B's (64 x 8*4) on down]
    assert result["r_lora"] == 8 and result["batch"] * result["tokens"] == 32
    expert_bytes = 8 * 4 * 64 * 4 + 64 * 8 * 4 * 4
    assert result["lora"]["extra_bytes"] == 2 * (3 * 8 * 64 * 4 + 32 * 8 * 4 + expert_bytes)
    meta = meta_model(tiny_config("mixtral"))
    split_experts(meta)
    targets = resolve(meta, lora_baseline(meta, result["r_lora"], 1), 1)  # the modules and expert params BD-LoRA adapts
    styles = check_tp_training(meta, targets, 2, block_diagonal=False)
    worked_out = training_step_traffic(targets, styles, 32, activation_bytes=4, grad_bytes=4)
    assert worked_out["lora"] == {"collectives": result["lora"]["extra_collectives"],
                                  "bytes": result["lora"]["extra_bytes"]}  # fmt: skip
    # the base's own on the adapted projections (q, k, v input gradients, o's [and the experts'] partial output [, the
    # experts' input gradient]: 32 x 64 each) is what the formula gives; the counted base adds once the embedding's
    # output (32 x 64), the lm_head's gathered logits shard (32 x 256/2) and its input gradient (32 x 64), and per
    # layer the routing weights' gradient (32 x top_k 2)
    per_layer = 6
    assert worked_out["base"] == {"collectives": 2 * per_layer, "bytes": 2 * per_layer * 32 * 64 * 4}
    routing = (2, 2 * 32 * 2 * 4)
    assert result["base"]["collectives"] == worked_out["base"]["collectives"] + routing[0] + 3
    assert result["base"]["bytes"] == worked_out["base"]["bytes"] + routing[1] + (32 * 64 + 32 * 128 + 32 * 64) * 4


def test_tp_check_train_on_llama4_counts_zero_extra_collectives_for_bdlora(capsys):
    """Llama-4's frozen base is differentiated under TP too: the shared expert's output is copied before its MoE adds
    into it in place, in every mode, so the base's own step runs and BD-LoRA adds nothing to it."""
    assert cli.main(["tp-check", "--train", "--tp", "2", "--model", "tiny:llama4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] and result["bdlora"]["extra_collectives"] == 0 and result["bdlora"]["extra_bytes"] == 0


def test_tp_check_train_with_expert_parallelism_counts_zero_extra_collectives(capsys):
    """Qwen3-MoE's attention by TP and its experts by EP over the same 2 ranks: the frozen base's own collectives
    include the experts' token dispatch and combine (all-to-all); BD-LoRA adds none, and neither does plain LoRA on the
    experts (whole experts per rank), only on attention."""
    assert cli.main(["tp-check", "--train", "--tp", "2", "--model", "tiny:qwen3_moe", "--ep", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] and result["ep_size"] == 2 and result["base"]["ops"]["all_to_all_single"] > 0
    assert result["bdlora"]["extra_collectives"] == 0 and result["bdlora"]["ops"] == result["base"]["ops"]
    # 2 layers x q, k, v (lora_A's gradient) and o (x A^T before B); the adapted attention moves the router's
    # choices, so the all-to-all bytes (not their count) follow the routing in every mode
    assert result["lora"]["extra_collectives"] == 2 * 4
    assert max(result[m]["grad_rel_err"] for m in ("bdlora", "lora")) < result["tolerance"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", [[], ["--dtype", "bf16-autocast", "--lora-dropout", "0.05"]])
def test_bench_tp_train_small(tmp_path, capsys, precision):
    out = tmp_path / "bench.json"
    argv = ["bench-tp", "--train", "--tp", "2", "--tokens", "8", "--repeats", "1", "--model", "tiny:llama"]
    assert cli.main([*argv, "--rank", "8", "--out", str(out), *precision]) == 0
    text = capsys.readouterr().out
    assert "BD / LoRA" in text
    assert ("bf16-autocast  lora_dropout 0.05" if precision else "fp32  lora_dropout 0.0") in text.splitlines()[0]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["bdlora_collectives"] == row["base_collectives"] < row["lora_collectives"]
    assert all(row[f"{mode}_ms"] > 0 for mode in ("base", "bdlora", "lora")) and row["bdlora_vs_lora"] > 0
    assert all(row[f"{mode}_min_ms"] <= row[f"{mode}_ms"] for mode in ("base", "bdlora", "lora"))
    # the adapters' parameters, gradients and saved activations sit on top of the frozen base's
    assert 0 < row["base_peak_mib"] < row["bdlora_peak_mib"] and row["base_peak_mib"] < row["lora_peak_mib"]
    # each adapter's optimizer step, in both AdamW implementations, timed apart from the step: one collective (the
    # clipping's gradient norm, as tp-check --train counts it), none from AdamW itself
    for method in ("bdlora", "lora"):
        assert row[f"{method}_fused_collectives"] == row[f"{method}_adamw_collectives"] == 1
        assert row[f"{method}_fused_ms"] > 0 and row[f"{method}_adamw_ms"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lora-dropout", "0.05"], "--lora-dropout 0.05 times a training step; add --train"),
        (["--dtype", "bf16-autocast"], "--dtype bf16-autocast times a training step; add --train"),
        (["--train", "--lora-dropout", "1.5"], "--lora-dropout 1.5; use a probability in [0, 1)"),
    ],
)
def test_bench_tp_precision_options_refused_in_one_line(argv, message, capsys):
    assert cli.main(["bench-tp", "--model", "tiny:llama", *argv]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bdlora bench-tp: error: ") and message in lines[0], lines


def test_the_documented_gpu_benchmark_lines_parse_and_are_refused_in_one_line_without_the_gpus(capsys):
    """docs/tp.md's GPU lines of bench-tp --train, run as written: on a machine with fewer GPUs than --tp, one line
    before any model is built (the 8B-shaped model would take minutes to write)."""
    docs = (ROOT / "docs" / "tp.md").read_text()
    gpu_line = "bdlora bench-tp --train --device cuda"
    lines = [line.strip() for line in docs.splitlines() if line.strip().startswith(gpu_line)]
    assert len(lines) == 4 and all(" --model bench-8b" in line for line in lines)
    assert sum("--dtype bf16-autocast --lora-dropout 0.05" in line for line in lines) == 1
    for line in lines:
        argv = shlex.split(line)[1:]
        if torch.cuda.device_count() >= int(argv[argv.index("--tp") + 1]):
            pytest.skip("this machine has the GPUs: the line would run the benchmark")
        assert cli.main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "--device cuda needs" in err and "use --device cpu" in err, err


def test_flop_floor_of_the_bench_model_by_hand(tmp_path):
    """bench-tp --train's FLOP floor on its default model (hidden 1024, MLP 2816, 16 heads of 64, 8 KV heads) at
    TP 2, worked out by hand per layer and per rank. Base: q and o 1,048,576 each, k and v 524,288, gate, up and
    down 2,883,584: 11,796,480 forward (twice that with the input gradient). BD-LoRA r 22, nblocks 2: q 2*22*(512 +
    256), k and v 2*22*(512 + 128), gate and up 2*22*(512 + 704), o 2*22*(256 + 512), down 2*22*(704 + 512):
    284,416, three times over. LoRA r 16: q and o 2*16*(1024 + 512) and 2*16*(512 + 1024) (the replicated factor's
    product on every rank), k and v 2*16*(1024 + 256), gate and up 2*16*(1024 + 1408), down 2*16*(1408 + 1024):
    413,696."""
    from bdlora_train.models import tiny_config
    from bdlora_train.tp_diagnostics.harness import BENCH_DIMS
    from bdlora_train.tp_diagnostics.train_check import flop_floor

    tiny_config("llama", **BENCH_DIMS).save_pretrained(tmp_path)
    assert flop_floor(str(tmp_path), "bdlora", 22, 2, 2) == pytest.approx(1 + 3 * 284_416 / (2 * 11_796_480))
    assert flop_floor(str(tmp_path), "lora", 16, 1, 2) == pytest.approx(1 + 3 * 413_696 / (2 * 11_796_480))


def test_tp_traffic_for_llama_3_1_8b_at_tp8(capsys):
    """Worked out from the bundled config (offline): BD-LoRA adds nothing, LoRA one all-reduce per projection."""
    argv = ["tp-check", "--train", "--traffic", "--model", "meta-llama/Llama-3.1-8B", "--tp", "8", "--json"]
    assert cli.main([*argv, "--tokens", "16", "--rank", "8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bdlora"] == {"collectives": 0, "bytes": 0} and result["r_bd"] % 8 == 0
    assert result["layers"] == 32 * 7 and result["lora"]["collectives"] == result["base"]["collectives"] == 32 * 7
    # per layer, hidden 4096, 16 tokens, bf16 activations, fp32 gradients: LoRA's lora_A gradient (8 x 4096) on q, k,
    # v, gate, up and x A^T (16 x 8) on o, down; the base's input gradient (16 x 4096) on the five column layers and
    # output partial sums (16 x 4096) on the two row layers
    assert result["lora"]["bytes"] == 32 * (5 * 8 * 4096 * 4 + 2 * 16 * 8 * 2)
    assert result["base"]["bytes"] == 32 * 7 * 16 * 4096 * 2


def test_tp_traffic_for_mixtral_8x7b_at_tp8(capsys):
    """Worked out from the bundled config (offline), experts included: BD-LoRA adds nothing; LoRA one all-reduce per
    projection and per expert parameter (lora_A's or lora_B's gradient, replicated across ranks): the experts are
    split over the ranks as `bdlora train` loads them (transformers' plan through 5.24, the toolkit's entries from
    5.25: arch/scope.py split_experts)."""
    argv = ["tp-check", "--train", "--traffic", "--model", "mistralai/Mixtral-8x7B-v0.1", "--tp", "8", "--json"]
    assert cli.main([*argv, "--tokens", "16", "--rank", "8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bdlora"] == {"collectives": 0, "bytes": 0} and result["r_bd"] % 8 == 0
    assert result["layers"] == 32 * 6 and result["expert_params"] == 32 * 2 and result["experts"] == 8
    assert result["replicated"] == 0
    per_layer = 6
    assert result["lora"]["collectives"] == result["base"]["collectives"] == 32 * per_layer
    # per layer, hidden 4096, 8 experts of intermediate 14336, 16 tokens, r 8, bf16 activations, fp32 gradients:
    # lora_A's gradient (8 x 4096) on q, k, v; x A^T (16 x 8) on o; lora_A's gradient (8*8 x 4096) on the experts'
    # gate_up; lora_B's gradient (4096 x 8*8) on their down
    expert_bytes = 8 * 8 * 4096 * 4 + 4096 * 8 * 8 * 4
    assert result["lora"]["bytes"] == 32 * (3 * 8 * 4096 * 4 + 16 * 8 * 2 + expert_bytes)
    # the base: input gradients (16 x 4096) of q, k, v and the experts, partial outputs (16 x 4096) of o and the
    # experts (on every token of the step, not only the routed ones)
    assert result["base"]["bytes"] == 32 * per_layer * 16 * 4096 * 2
    assert cli.main([*argv[:-1]]) == 0  # the table, with the expert count in its header
    table = capsys.readouterr().out
    assert "192 adapted projections (64 of them expert parameters, 8 experts each)" in table
    assert "whole on every rank" not in table


def test_tp_traffic_refuses_a_degree_the_run_refuses(capsys):
    """Qwen3-30B-A3B has 4 KV heads: TP 8 is refused in one line, as `bdlora train` refuses it; TP 4 is worked out."""
    argv = ["tp-check", "--train", "--traffic", "--model", "Qwen/Qwen3-30B-A3B", "--json"]
    assert cli.main([*argv, "--tp", "8"]) == 1
    captured = capsys.readouterr()
    assert not captured.out and "tp_size=8 does not divide num_key_value_heads=4" in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    assert cli.main([*argv, "--tp", "4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["layers"] == 48 * 6 and result["experts"] == 128 and result["bdlora"]["collectives"] == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tp-check", "--ep"], "error: --ep goes with --train"),
        (["tp-check", "--train", "--traffic", "--ep"], "works out TP's traffic only; drop --ep"),
        (["tp-check", "--train", "--ep", "--model", "tiny:llama"], "no expert-parallel plan for llama"),
    ],
)
def test_tp_check_ep_refused_in_one_line(argv, message, capsys):
    assert cli.main([*argv, "--tp", "2"]) == 1
    captured = capsys.readouterr()
    assert not captured.out and message in captured.err and len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["tp-check"],
        ["tp-check", "--train"],
        ["tp-check", "--train", "--traffic"],
        ["bench-tp"],
        ["bench-tp", "--train"],
    ],  # fmt: skip
)
def test_one_rank_is_refused_in_one_line(argv, capsys):
    assert cli.main([*argv, "--tp", "1"]) == 1
    captured = capsys.readouterr()
    assert not captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "--tp 1: with one rank nothing is sharded" in lines[0] and "--tp 2" in lines[0]


# Row-parallel inputs are sharded, so a rank's dropout there draws its own mask and no single process draws the same;
# column-parallel inputs are whole on every rank and draw the single process's masks from the same seed. The proof
# below drops out on the column-parallel targets only (Identity on o / down) and compares to 1 process exactly.
ROW_PARALLEL = ("o_proj", "down_proj")


def _computed_by(grad_fn, depth: int = 4) -> str:
    """The toolkit's layer node an adapted layer's output comes from, within `depth` autograd nodes (a row-parallel
    layer's output is its all-reduce's), else the node the output comes from."""
    frontier = [grad_fn]
    for _ in range(depth):
        for node in frontier:
            if type(node).__name__ == "_ShardedLinearFnBackward":
                return type(node).__name__
        frontier = [nxt for node in frontier if node is not None for nxt, _ in node.next_functions if nxt is not None]
    return type(grad_fn).__name__


def _one_node_dropout_autocast_job(job: dict, mesh) -> dict:
    """One step of BD-LoRA with dropout at TP 2 and in one process, in `job["precision"]`: fp32, or the shipped
    recipes' bf16 base with fp32 adapter weights under bf16 autocast. Which autograd node each adapted layer's output
    came from, the gradients' and the loss's relative error."""
    import torch.distributed as dist
    from torch import nn

    from bdlora_train.tp_diagnostics.ranks import rel_err, token_ids
    from bdlora_train.tp_diagnostics.train_step import PRECISIONS, adapted, gathered_grads, load_base, plan_styles, step
    from bdlora_train.tp_runtime.dispatch import adapted_layers

    precision, path, r, nblocks = job["precision"], job["base"], job["r"], job["nblocks"]
    ids = token_ids(load_base(path, None).config, 2, 16, seed=7)
    results = {}
    for name, tp in (("tp", mesh.size()), ("ref", None)):
        plan = plan_styles(path, "bdlora", r, nblocks, tp) if tp else None
        base = load_base(path, tp, dtype=precision)
        model, pieces = adapted(base, "bdlora", r, nblocks, plan, precision, dropout=0.2)
        nodes = {}
        for lname, layer in adapted_layers(model).items():
            if lname.endswith(ROW_PARALLEL):
                layer.lora_dropout["default"] = nn.Identity()
            layer.register_forward_hook(lambda m, a, out, n=lname: nodes.update({n: _computed_by(out.grad_fn)}))
        torch.manual_seed(123)  # the same masks on both ranks and in the single process
        loss = step(model, ids, PRECISIONS[precision][2])
        dtypes = {("adapter" if "lora_" in n else "base", str(p.dtype)) for n, p in model.named_parameters()}
        results[name] = dict(loss=loss.float(), grads=gathered_grads(model, pieces), nodes=nodes, dtypes=dtypes)
    got, want = results["tp"]["grads"], results["ref"]["grads"]
    assert got.keys() == want.keys()
    return dict(
        world_size=dist.get_world_size(),
        nodes=sorted(set(results["tp"]["nodes"].values())),
        layers=len(results["tp"]["nodes"]),
        dtypes=sorted(results["tp"]["dtypes"]),
        grad_rel_err=max(rel_err(got[k].float(), want[k].float()) for k in got),
        loss_rel_err=rel_err(results["tp"]["loss"], results["ref"]["loss"]),
    )


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-4), ("bf16-autocast", 5e-2)])
def test_dropout_and_a_bf16_base_under_autocast_take_the_one_node_tp_layer(tmp_path, precision, tolerance):
    """The shipped TP recipe's step (lora_dropout > 0; a bf16 base, fp32 adapter weights, bf16 autocast) runs every
    adapted layer as the one `_ShardedLinearFn` node, and its gradients are the single process's: to fp32 rounding
    in fp32, to bf16 rounding under autocast."""
    from bdlora_train.tp_diagnostics.ranks import launch
    from bdlora_train.tp_diagnostics.train_check import _base_checkpoint

    job = dict(base=_base_checkpoint("tiny:llama", 2, str(tmp_path)), r=8, nblocks=2, precision=precision)
    per_rank = launch(_one_node_dropout_autocast_job, [job], 2)
    for (result,) in per_rank:
        assert result["nodes"] == ["_ShardedLinearFnBackward"] and result["layers"] == 14  # 2 layers x 7 projections
        base = "torch.float32" if precision == "fp32" else "torch.bfloat16"
        assert result["dtypes"] == [["adapter", "torch.float32"], ["base", base]], result["dtypes"]
        assert result["grad_rel_err"] < tolerance and result["loss_rel_err"] < tolerance, result
