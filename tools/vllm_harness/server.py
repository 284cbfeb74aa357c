"""Start vLLM's OpenAI-compatible server from a command line, wait until it answers, stop it (tests/vllm and
scripts/bench_serving.py)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600) -> tuple[int, str]:
    """POST JSON; (HTTP status, body text), error statuses included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def models(url: str) -> set[str]:
    return {m["id"] for m in json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=30).read())["data"]}


@contextlib.contextmanager
def serving(command: str, log_path: Path, env: dict | None = None, timeout: float = START_TIMEOUT_S):
    """Run `command` (a shell command line that starts the server) with `--host 127.0.0.1 --port P` appended; yield
    the base URL once /v1/models answers; terminate the server's process group on exit."""
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", "-c", f"exec {command} --host 127.0.0.1 --port {port}"],
                                env=env if env is not None else dict(os.environ), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.time() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({proc.returncode}): {Path(log_path).read_text()[-3000:]}")
                try:
                    models(url)
                    break
                except OSError:
                    if time.time() > deadline:
                        raise TimeoutError(f"the server did not come up in {timeout:.0f} s: {log_path}") from None
                    time.sleep(3)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
