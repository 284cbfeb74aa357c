"""What the tests that start real processes share: the offline environment, a free port, torchrun command lines
(one node, or two rendezvousing agents on this machine), the stock-PEFT check run in a fresh interpreter, and a run
killed with SIGKILL at a given point."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli_env(**extra) -> dict:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("ACCELERATE_USE_CPU", None)
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(nproc: int, *, nodes: int = 1, port: int | None = None, job: str = "bdlora-test") -> list[str]:
    """`torchrun` for one node (a fresh master port), or for one of `nodes` agents meeting at a c10d rendezvous on
    127.0.0.1:`port` (every agent gets the same line: c10d assigns the node ranks)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    if nodes == 1:
        return [*cmd, "--master_port", str(port or free_port())]
    return [*cmd, "--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", job]  # fmt: skip


STOCK_PEFT_CHECK = textwrap.dedent("""
    import json, sys, torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from peft import PeftModel
    from peft.tuners.lora.variants import BdLoraLinearVariant
    dims = json.loads(sys.argv[2])
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **dims))
    model = PeftModel.from_pretrained(base, sys.argv[1]).eval()
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    ids = torch.arange(3, 40).view(1, -1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    print(json.dumps({"bd_variant": any(isinstance(v, BdLoraLinearVariant) for v in q.lora_variant.values()),
                      "bdlora_imported": "bdlora_train" in sys.modules, "logits": logits[0, -1].tolist()}))
""")


def stock_peft(adapter_dir: Path) -> dict:
    """The adapter loaded by transformers + PEFT alone (a fresh interpreter, bdlora_train never imported) on the tiny
    Llama: {"bd_variant": PEFT built its BD-LoRA variant, "bdlora_imported", "logits": the last position's}."""
    from bdlora_train.models.tiny import TINY_DIMS

    proc = subprocess.run(
        [sys.executable, "-c", STOCK_PEFT_CHECK, str(adapter_dir), json.dumps(TINY_DIMS)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kill_9_when(command: list[str], ready: Path, timeout: float = 180) -> None:
    """Run `command` from the repository root with cli_env() and kill -9 it as soon as `ready` exists."""
    proc = subprocess.Popen(command, cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while not ready.exists():
            assert proc.poll() is None, f"the run ended before {ready} appeared"
            assert time.monotonic() < deadline, f"no {ready} within {timeout:.0f} s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
