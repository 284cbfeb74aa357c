"""Two real ranks on CPU: DDP and DeepSpeed ZeRO-2/3 through torchrun (and accelerate launch), gloo; FSDP on GPUs.

Measured with accelerate 1.15: `accelerate launch --cpu --num_processes 2` silently runs ONE process, so every run here
asserts world_size == 2 from metrics.json, and `parallelism` records what actually ran.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.exactness import assert_float32_rounding_only
from tests.launching import cli_env, free_port, torchrun

ROOT = Path(__file__).resolve().parents[2]
TINY = "recipes/tiny/bdlora.yaml"
SGD = ("optim=sgd", "learning_rate=0.1")  # float32 comparisons step with SGD (tests/exactness.py)
pytest.importorskip(
    "deepspeed", reason="DeepSpeed is installed by `make install` (DS_BUILD_OPS=0 pip install deepspeed)"
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny Llama and its tokenizer saved as a local model dir: every launch mode loads the same weights
    (a random init under ZeRO-3's partitioned construction would differ from a plain one)."""
    from bdlora_train.models import build_tiny_model, tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model("llama", seed=0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def launch(
    out: Path,
    *overrides,
    mode: str = "ddp",
    launcher: str = "torchrun",
    timeout: int = 400,
    expect_error: str | None = None,
) -> dict:
    env = cli_env(
        TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".venv" / "torch_extensions"))
    )
    if mode == "ddp" and not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "true"  # gloo DDP on CPU
    elif mode == "deepspeed" and not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator; ACCELERATE_USE_CPU would drop DeepSpeed
    port = str(free_port())
    if launcher == "torchrun":
        cmd = torchrun(2, port=port)
    else:  # accelerate launch with a recipe config (ranks started by torchrun underneath)
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            launcher,
            "--num_processes",
            "2",
            "--main_process_port",
            port,
        ]
    # a key given twice is an error (tests/test_bad_inputs.py), so the test's overrides replace these defaults
    settings = {"max_steps": "16", "save_steps": "8", **dict(o.split("=", 1) for o in overrides)}
    cmd += ["-m", "bdlora_train.train", TINY, f"output_dir={out}", *(f"{k}={v}" for k, v in settings.items())]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if expect_error:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("bdlora train: error:")]
        assert proc.returncode != 0 and errors and expect_error in errors[0], proc.stderr[-3000:]
        return {}
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["_summary_lines"] = [line for line in proc.stdout.splitlines() if line.startswith("bdlora train:")]
    return metrics


def tensors(out: Path) -> dict:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, tiny_dir):
    out = tmp_path_factory.mktemp("ddp") / "run"
    return out, launch(out, f"model={tiny_dir}", mode="ddp")


@pytest.fixture(scope="module")
def ddp_sgd(tmp_path_factory, tiny_dir):
    """DDP stepping with SGD, in float32 (the yardstick) and in float64 (the exact run): what the ZeRO / FSDP runs are
    held to (tests/exactness.py)."""
    runs = []
    for dtype in ("float32", "float64"):
        out = tmp_path_factory.mktemp(f"ddp-sgd-{dtype}") / "run"
        launch(out, f"model={tiny_dir}", f"torch_dtype={dtype}", *SGD, mode="ddp")
        runs.append(tensors(out))
    return runs


def assert_ddp_up_to_rounding(out: Path, ddp_sgd: list) -> None:
    """Same data, same math as DDP (another reduction order, DeepSpeed's own optimizer step): the adapter is the
    float64 DDP run's up to float32 rounding of the size DDP's float32 run carries."""
    assert_float32_rounding_only(tensors(out), *ddp_sgd)


@pytest.fixture(scope="module")
def single_adapter(tmp_path_factory, tiny_dir):
    """The same recipe in one process: the reference for adapter completeness."""
    from bdlora_train.train import load_recipe, train

    out = tmp_path_factory.mktemp("single") / "run"
    train(load_recipe(str(ROOT / TINY), [f"output_dir={out}", f"model={tiny_dir}", "max_steps=2", "save_steps=0"]))
    return tensors(out)


def assert_complete(out: Path, reference: dict):
    """Every tensor of the single-process adapter is there, non-empty, same shape (ZeRO-3 used to save empties)."""
    got = tensors(out)
    assert got.keys() == reference.keys()
    for key, ref in reference.items():
        assert got[key].numel() > 0 and got[key].shape == ref.shape, key
    assert any(got[k].abs().sum() > 0 for k in got if "lora_B" in k)  # B starts at zero: it trained


def test_ddp_two_ranks(ddp_run, single_adapter):
    out, metrics = ddp_run
    assert metrics["world_size"] == 2 and metrics["parallelism"] == "ddp"
    assert len(metrics["_summary_lines"]) == 1  # main process only
    assert metrics["steps"] == 16 and (out / "checkpoint-16" / "trainer_state.json").is_file()
    assert_complete(out, single_adapter)


def test_deepspeed_zero3_two_ranks_saves_a_complete_adapter(tmp_path, tiny_dir, single_adapter, ddp_sgd):
    out = tmp_path / "zero3"
    metrics = launch(out, f"model={tiny_dir}", "deepspeed=recipes/accelerate/zero3.json", *SGD, mode="deepspeed")
    assert metrics["world_size"] == 2 and metrics["parallelism"] == "deepspeed_zero3"
    assert list((out / "checkpoint-16").glob("global_step16/zero_pp_rank_1_*"))  # rank 1 wrote its own shard
    assert_complete(out, single_adapter)
    assert_ddp_up_to_rounding(out, ddp_sgd)


@pytest.mark.slow
def test_deepspeed_zero2_two_ranks(tmp_path, tiny_dir, single_adapter, ddp_sgd):
    out = tmp_path / "zero2"
    metrics = launch(out, f"model={tiny_dir}", "deepspeed=recipes/accelerate/zero2.json", *SGD, mode="deepspeed")
    assert metrics["world_size"] == 2 and metrics["parallelism"] == "deepspeed_zero2"
    assert_complete(out, single_adapter)
    assert_ddp_up_to_rounding(out, ddp_sgd)


@pytest.mark.slow
def test_accelerate_launch_with_the_zero3_recipe_config(tmp_path, tiny_dir, single_adapter):
    out = tmp_path / "acc-zero3"
    metrics = launch(
        out, f"model={tiny_dir}", mode="deepspeed", launcher=str(ROOT / "recipes" / "accelerate" / "zero3.yaml")
    )
    assert metrics["world_size"] == 2 and metrics["parallelism"] == "deepspeed_zero3"
    assert_complete(out, single_adapter)


def test_float64_under_deepspeed_is_refused_in_one_line(tmp_path, tiny_dir):
    """DeepSpeed's engine casts the model to float32: a float64 recipe would train float32 and say float64."""
    refusal = "torch_dtype=float64 with DeepSpeed: its engine trains in float32"
    ds = "deepspeed=recipes/accelerate/zero3.json"
    launch(tmp_path / "ds64", f"model={tiny_dir}", "torch_dtype=float64", ds, mode="deepspeed", expect_error=refusal)
    assert not (tmp_path / "ds64" / "adapter").exists()


def test_fsdp_in_one_process_is_refused(tmp_path, tiny_dir):
    from bdlora_train.train import load_recipe, train

    recipe = load_recipe(str(ROOT / TINY), [f"output_dir={tmp_path}", f"model={tiny_dir}", "fsdp=full_shard auto_wrap"])
    with pytest.raises(ValueError, match="fsdp only works in distributed training"):  # transformers' own check
        train(recipe)
    assert "ACCELERATE_USE_FSDP" not in os.environ  # accelerate's flag must not leak into the next train() call
    assert not (tmp_path / "adapter").exists() and not list(tmp_path.glob("checkpoint-*"))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_fsdp_on_two_cpu_ranks_is_refused_instead_of_silently_running_ddp(tmp_path, tiny_dir):
    """accelerate enables FSDP only for GPU-type process groups; on CPU ranks it would quietly run plain DDP."""
    launch(
        tmp_path / "fsdp-cpu",
        f"model={tiny_dir}",
        "fsdp=full_shard auto_wrap",
        mode="ddp",
        expect_error="FSDP was requested but accelerate did not enable it",
    )
    assert not (tmp_path / "fsdp-cpu" / "adapter").exists()


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="accelerate enables FSDP only on GPUs (not CPU/gloo); needs 2 GPUs"
)
def test_fsdp2_two_ranks(tmp_path, tiny_dir, single_adapter, ddp_sgd):
    out = tmp_path / "fsdp"
    metrics = launch(
        out,
        f"model={tiny_dir}",
        "fsdp=full_shard auto_wrap",
        "fsdp_config={version: 2, transformer_layer_cls_to_wrap: [LlamaDecoderLayer], "
        "state_dict_type: FULL_STATE_DICT}",
        *SGD,
        mode="fsdp",
    )
    assert metrics["world_size"] == 2 and metrics["parallelism"] == "fsdp2"
    assert_complete(out, single_adapter)
    assert_ddp_up_to_rounding(out, ddp_sgd)


@pytest.mark.slow
def test_deepspeed_zero3_resume_after_kill(tmp_path):
    """Resume goes through DeepSpeed's own checkpoint loader: a rerun continues from the last checkpoint."""
    out = tmp_path / "resume"
    launch(out, "deepspeed=recipes/accelerate/zero3.json", "max_steps=8", mode="deepspeed")
    metrics = launch(out, "deepspeed=recipes/accelerate/zero3.json", mode="deepspeed")  # now 16 steps
    assert (
        metrics["resumed_from"].endswith("checkpoint-8") and metrics["steps_this_run"] == 8 and metrics["steps"] == 16
    )
