"""GRPO under N training processes with one rollout server (objectives/grpo.py, rl/rollouts.py, rl/ranks.py): two
DDP ranks on CPU (torchrun, gloo) against the stand-in for `vllm serve` (tests/rl/fake_vllm.py), which records every
request. The real server at TP 3 is tests/vllm/test_rl_rollouts.py's."""

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.exactness import assert_exact
from tests.launching import cli_env, free_port, torchrun
from tests.rl.fake_vllm import FakeVllm

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "tiny" / "grpo.yaml")
STEPS = 3

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny Llama and its tokenizer as a model directory (the rollout route refuses the `tiny:` specs, which vLLM
    cannot load; the stand-in serves any base)."""
    from bdlora_train.models import build_tiny_model, tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model("llama", seed=0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


LAUNCHES = {
    # torchrun, DDP over gloo
    "ddp": (lambda: torchrun(2), {"ACCELERATE_USE_CPU": "true"}, "ddp"),
    # accelerate launch with the ZeRO-3 recipe config: the adapter is partitioned, each sync gathers it
    "zero3": (lambda: [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                       str(ROOT / "recipes" / "accelerate" / "zero3.yaml"), "--num_processes", "2",
                       "--main_process_port", str(free_port())],
              {"DS_ACCELERATOR": "cpu"}, "deepspeed_zero3"),
    # torchrun, the tiny Llama sharded over TP 2 (tp_size=2 below): one TP group, whose rank 0 asks for both
    "tp2": (lambda: torchrun(2), {}, "tp2"),
}


def _launch(out: Path, url: str, model: Path, *overrides: str, how: str = "ddp",
            steps: int = STEPS) -> subprocess.CompletedProcess:
    launcher, env, _ = LAUNCHES[how]
    cmd = [*launcher(), "-m", "bdlora_train.train", RECIPE, f"output_dir={out}", f"model={model}",
           f"rollout_server={url}", f"max_steps={steps}", "save_steps=100", *overrides]
    if how == "tp2":
        cmd.append("tp_size=2")
    return subprocess.run(cmd, cwd=ROOT, env=cli_env(**env), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "how", [pytest.param(how, marks=[pytest.mark.slow] if how == "zero3" else []) for how in LAUNCHES]
)  # ZeRO-3: 80 s here (DeepSpeed's start), in make test-slow
def test_two_ranks_share_one_server_one_sync_per_version(tmp_path, tiny_dir, how):
    """Each version is written and loaded once (by the main process), both ranks sample under it with seeds of their
    own, the step's gap is recorded over both ranks, and the server holds nothing of the run at the end."""
    if how == "zero3":
        pytest.importorskip("deepspeed", reason="DeepSpeed is installed by `make install`")
    fake = FakeVllm(base=str(tiny_dir))
    out = tmp_path / "run"
    with fake as url:
        # the stand-in's log-probs are not the tiny model's: the gap bound is lifted, the gap itself still recorded
        proc = _launch(out, url, tiny_dir, "rollout_max_logprob_diff=1e6", how=how)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["parallelism"] == LAUNCHES[how][2]

    # (the preflight's load without a name asks whether run-time loading is on)
    loads = [body["lora_name"] for _, path, body in fake.requests
             if path == "/v1/load_lora_adapter" and body["lora_name"]]
    versions = [name.rsplit("-v", 1)[1] for name in loads]
    assert versions == ["-1", *map(str, range(STEPS))], loads  # the check's, then one per step: never twice
    assert len({name.rsplit("-v", 1)[0] for name in loads}) == 1  # one prefix: both ranks use the main's names
    completions = [body for _, path, body in fake.requests if path == "/v1/completions"]
    per_version = Counter(body["model"] for body in completions if body["model"].startswith(loads[0][:-2]))
    samplers = 1 if how == "tp2" else 2  # the ranks of a TP group share one request; data-parallel ranks ask apart
    # each step: one request per prompt, two prompts per sampling rank, four completions each
    assert sorted(per_version.values()) == [2 * samplers] * STEPS
    assert all(b["n"] == 4 for b in completions if "n" in b)
    seeds = sorted(body["seed"] for body in completions if body["model"] in per_version)
    # seed 0 + (step x samplers + sampler) x 8 completions + prompt x 4: no two completions of the run share a seed
    assert seeds == list(range(0, samplers * STEPS * 8, 4)), seeds

    rollout = metrics["rollout"]
    assert [s["step"] for s in rollout["steps"]] == list(range(STEPS))
    assert [s["step"] for s in rollout["syncs"]] == list(range(STEPS))
    assert all(s["completions"] == 8 for s in rollout["steps"])  # the main process's own (a TP group's: shared)
    assert rollout["max_abs_logprob_diff"] > 0  # measured, not skipped, on the non-main rank too (below)
    assert fake.adapters == {} and not (out / "rollout-adapters").exists()
    # every version whole (a ZeRO-3 partition saved as is holds empty tensors): at least the final adapter's tensors
    tensors = (out / "adapter" / "adapter_model.safetensors").stat().st_size
    assert all(s["bytes"] > tensors for s in rollout["syncs"]), (tensors, rollout["syncs"])


def test_a_server_refused_by_the_main_process_stops_every_rank_in_one_line(tmp_path, tiny_dir):
    """The server check runs on the main process; its refusal (here the stand-in's log-probs are another base's)
    stops the other rank at the same point (the run ends instead of waiting for it) and leaves no adapter version."""
    fake = FakeVllm(base=str(tiny_dir))
    out = tmp_path / "refused"
    with fake as url:
        proc = _launch(out, url, tiny_dir)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("bdlora train: error:")]
    refusal = [e for e in errors if "serves another base model" in e and url in e]
    # the other rank stops too (its line, when torchrun has not ended it first, points to the main's)
    pointers = [e for e in errors if "another training process's rollouts failed (its error is above)" in e]
    assert len(refusal) == 1 and len(refusal) + len(pointers) == len(errors), proc.stderr[-3000:]
    assert not (out / "rollout-adapters").exists() and not list(out.glob("checkpoint-*"))
    # the preflight's probe of the base, and nothing sampled under an adapter
    assert {body["model"] for _, p, body in fake.requests if p == "/v1/completions"} == {str(tiny_dir)}


def test_the_server_failing_mid_run_stops_both_ranks_with_one_checkpoint_and_the_same_command_resumes(
    tmp_path, tiny_dir
):
    """The engine dies after a few steps: both ranks stop at the same step, the checkpoint of the last completed step
    is written once (a collective save both ranks reach), and the same command, the server well again, resumes from it
    and finishes."""
    fake = FakeVllm(base=str(tiny_dir))
    out = tmp_path / "fault"
    args = ("rollout_max_logprob_diff=1e6", "max_steps=6")
    with fake as url:
        launcher, env, _ = LAUNCHES["ddp"]
        cmd = [*launcher(), "-m", "bdlora_train.train", RECIPE, f"output_dir={out}", f"model={tiny_dir}",
               f"rollout_server={url}", "save_steps=100", *args]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        deadline = time.time() + 300
        while not any(name.endswith("-v2") for name in fake.adapters):  # step 2's version loaded
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        fake.engine_dead = True
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode != 0
        errors = [ln for ln in stderr.splitlines() if ln.startswith("bdlora train: error:")]
        assert errors and all("rollout server" in e for e in errors), stderr[-3000:]
        kept = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
        assert len(kept) == 1 and kept[0] in (2, 3), kept  # save_steps=100 saves none: the fault's, of its last step
        fake.engine_dead = False
        again = _launch(out, url, tiny_dir, *args[:1], how="ddp", steps=6)
    assert again.returncode == 0, again.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["resumed_from"].endswith(f"checkpoint-{kept[0]}") and metrics["steps"] == 6
    assert [s["step"] for s in metrics["rollout"]["steps"]] == list(range(kept[0], 6))


# ------------------------------------------------------------------ model parallelism, the trainer generating

DENSE_REWARD = '''
def chars(prompts, completions, **kwargs):
    """A dense reward for a random model (exact_match is always 0 on it): the share of digits and spaces."""
    return [sum(ch.isdigit() or ch == " " for ch in c) / max(len(c), 1) for c in completions]
'''


def _exact_run(out: Path, recipe: str, nproc: int, reward: Path, *overrides: str, ddp: bool = False) -> dict:
    """A float64 GRPO run (tests/exactness.py) with the dense reward, every step logged: one process, or `nproc`
    ranks by torchrun (gloo DDP with `ddp`)."""
    args = ["-m", "bdlora_train.train", str(ROOT / "recipes" / "tiny" / recipe), f"output_dir={out}",
            "torch_dtype=float64", "logging_steps=1", f"rewards=[{reward}:chars]", *overrides]
    launcher = [sys.executable] if nproc == 1 else torchrun(nproc)
    env = cli_env(ACCELERATE_USE_CPU="true") if ddp else cli_env()
    proc = subprocess.run([*launcher, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture
def reward(tmp_path) -> Path:
    path = tmp_path / "dense_reward.py"
    path.write_text(DENSE_REWARD)
    return path


def _assert_same_run(got: tuple[Path, dict], ref: tuple[Path, dict]) -> None:
    """The adapters agree to float64 rounding and every step's reward, KL and update norms (each factor kind's, the
    whole factor's: a TP rank's shard counted with its peers') agree to the 6-8 digits metrics.json keeps."""
    (out, metrics), (ref_out, ref_metrics) = got, ref
    assert_exact(load_file(str(out / "adapter" / "adapter_model.safetensors")),
                 load_file(str(ref_out / "adapter" / "adapter_model.safetensors")))
    steps, ref_steps = metrics["per_step"], ref_metrics["per_step"]
    assert len(steps) == len(ref_steps) == metrics["steps"]
    for step, ref_step in zip(steps, ref_steps, strict=True):
        assert step["reward"] == pytest.approx(ref_step["reward"], abs=2e-6), (step, ref_step)
        assert step["kl_to_base"] == pytest.approx(ref_step["kl_to_base"], abs=2e-6), (step, ref_step)
        assert step["update_norm"].keys() == ref_step["update_norm"].keys()
        for kind, norm in ref_step["update_norm"].items():
            assert step["update_norm"][kind] == pytest.approx(norm, abs=2e-8), (kind, step, ref_step)
    assert any(s["reward"] != steps[0]["reward"] for s in steps)  # the reward moved: there was a signal to follow


def test_tp2_grpo_trains_the_one_process_adapter(tmp_path, reward):
    """TP 2, the trainer generating under TP: both ranks of the group sample the same completions (the sampling
    generator seeded per replica) and train their blocks; with gradient accumulation 2 (TRL's prompt chunks sized for
    the TP group: each chunk's prompts are generated once and split over the two micro-steps) the run is the
    one-process run, in float64."""
    common = ("gradient_accumulation_steps=2", "per_device_train_batch_size=4")
    tp = _exact_run(tmp_path / "tp", "grpo_tp2.yaml", 2, reward, *common)
    one = _exact_run(tmp_path / "one", "grpo_tp2.yaml", 1, reward, "tp_size=1", *common)
    assert tp["parallelism"] == "tp2" and tp["world_size"] == 2 and one["parallelism"] == "single"
    _assert_same_run((tmp_path / "tp", tp), (tmp_path / "one", one))


def test_moe_under_expert_parallelism_trains_the_data_parallel_adapter(tmp_path, reward):
    """The tiny Qwen3-MoE over 2 ranks, experts split by EP and the rest by FSDP (each rank its own prompts, the
    generation stepping every token together), against plain DDP on 2 ranks, which samples the same completions
    (one sampling generator per data-parallel rank in both): the same adapter in float64. The router's load-balancing
    loss is off: transformers computes it with a float32 buffer that the float64 twin of the model cannot scatter
    into (models/float64.py), on one process as on two."""
    common = ("router_aux_loss_coef=0.0",)
    ep = _exact_run(tmp_path / "ep", "grpo_moe_ep2.yaml", 2, reward, *common)
    ddp = _exact_run(tmp_path / "ddp", "grpo_moe_ep2.yaml", 2, reward, "fsdp_size=1", "ep_size=1", *common, ddp=True)
    assert ep["parallelism"] == "ep2 x fsdp2" and ddp["parallelism"] == "ddp"
    _assert_same_run((tmp_path / "ep", ep), (tmp_path / "ddp", ddp))


@pytest.mark.slow
@pytest.mark.parametrize(("size", "parallelism"), [("fsdp_size=2", "tp2 x fsdp2"),
                                                   ("dp_replicate_size=2", "tp2 x dp_replicate2")])
def test_tp2_x_data_parallel_grpo_trains_the_data_parallel_adapter(tmp_path, reward, size, parallelism):
    """Four ranks, two TP groups of two over FSDP 2 (or 2 replicas): each group generates its own prompts' completions
    (seeded as data rank 0 and 1 of a DDP run), FSDP's ranks stepping generation together: plain DDP's adapter on 2
    ranks (measured 3.0e-14 both ways)."""
    both = _exact_run(tmp_path / "tp-dp", "grpo_tp2.yaml", 4, reward, size)
    ddp = _exact_run(tmp_path / "ddp", "grpo_tp2.yaml", 2, reward, "tp_size=1", ddp=True)
    assert both["parallelism"] == parallelism and ddp["parallelism"] == "ddp"
    _assert_same_run((tmp_path / "tp-dp", both), (tmp_path / "ddp", ddp))


def test_moe_expert_factors_with_a_rollout_server_are_refused_in_one_line(tmp_path, capsys):
    from bdlora_train.cli import main

    out = tmp_path / "moe"
    assert main(["train", RECIPE, "model=tiny:qwen3_moe", f"output_dir={out}", "rollout_server=http://127.0.0.1:1",
                 "max_steps=1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("bdlora train: error: recipe: rollout_server=http://127.0.0.1:1: 2 expert factors "), err
    assert "train with experts=False" in err[-1] and "drop rollout_server to let the trainer generate" in err[-1]
    assert not out.exists()


# ------------------------------------------------------------------ docs/rl.md's launch lines, as printed

LAUNCHED = {  # what each documented line runs, by its position in the block
    0: ("single", 1), 1: ("ddp", 2), 2: ("deepspeed_zero3", 2), 3: ("tp2", 2), 4: ("tp2 x fsdp2", 4),
    5: ("ep2 x fsdp2", 2),
}


def _documented_launches() -> list[str]:
    text = (ROOT / "docs" / "rl.md").read_text()
    section = text.split("## Launches: processes, parallelism and where rollouts run", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.slow  # six launches, one of four processes: 3-5 min here (make test-slow)
def test_the_documented_launch_lines_run_as_printed(tmp_path):
    """Every line of docs/rl.md's launch block, run by bash as printed (its environment assignments included) with one
    step added: the parallelism and process count each one's row says."""
    lines = _documented_launches()
    assert len(lines) == len(LAUNCHED)
    if "deepspeed" not in sys.modules:
        pytest.importorskip("deepspeed", reason="DeepSpeed is installed by `make install`")
    env = cli_env(PATH=f"{Path(sys.executable).parent}:{cli_env()['PATH']}")
    for i, line in enumerate(lines):
        out = tmp_path / f"run{i}"
        proc = subprocess.run(["bash", "-c", f"{line} output_dir={out} max_steps=1 save_steps=0"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (line, proc.stderr[-3000:])
        metrics = json.loads((out / "metrics.json").read_text())
        assert (metrics["parallelism"], metrics["world_size"]) == LAUNCHED[i], line


def test_a_tp_batch_that_splits_a_group_is_refused_in_one_line(tmp_path):
    """TRL cuts the gathered rewards into groups in rank order, where a TP group's copies stand side by side: a batch
    of 2 with 4 completions per prompt would mix copies into one group. Refused before training, nothing written."""
    out = tmp_path / "split"
    cmd = [*torchrun(2), "-m", "bdlora_train.train", str(ROOT / "recipes" / "tiny" / "grpo_tp2.yaml"),
           f"output_dir={out}", "per_device_train_batch_size=2", "max_steps=1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = {ln for ln in proc.stderr.splitlines() if ln.startswith("bdlora train: error:")}
    assert errors == {"bdlora train: error: recipe: per_device_train_batch_size=2 with tp_size=2 and objective=grpo: "
                      "each TP group must hold whole groups of num_generations=4 completions (TRL would cut a group "
                      "across the TP copies); use a multiple of 4"}, proc.stderr[-2000:]
    assert not out.exists()
