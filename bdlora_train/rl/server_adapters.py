"""The adapters a running `vllm serve` holds: load one at run time (`/v1/load_lora_adapter`, which needs the server
started with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`), unload one, list them (/v1/models entries with a parent), each
refusal read into one line with its fix.

A run's adapter versions need a new (name, path) each: vLLM's prefix cache keys an adapter's KV blocks by both, so a
name and path reused with other weights would reuse KV computed with the old ones.

A load the bdlora plugin refuses (the adapter's rank above --max-lora-rank, nblocks the TP degree cannot cut)
answers 500 "Call to add_lora method failed: Worker failed with error '<the plugin's refusal>', ..."; the refusal is
passed on. vLLM masks paths in error messages as `<path>`. vLLM 0.32 at TP > 1 does not drain the other ranks'
replies after a worker fails (vllm-project/vllm#58242), so every later load on that server answers an earlier
refusal: the message says to restart it.
"""

from __future__ import annotations

import re
from pathlib import Path

from bdlora_train.core.errors import RolloutError, first_line
from bdlora_train.rl.engine_client import EngineClient, error_reason, json_object

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_WORKER_ERROR = re.compile(r"Worker failed with error '(.*)', please check the stack trace", re.S)


class ServerAdapters:
    """The adapters the server behind `client` serves. `start`, in each call: the command that (re)starts the
    server, for the messages that say to."""

    def __init__(self, client: EngineClient):
        self.client = client

    def load(self, name: str, path: Path, start: str, *, checking: bool, tp: int | None) -> None:
        """Load the PEFT adapter directory `path` (as the server's filesystem holds it) under `name`. `checking`:
        the load before the first step (its refusal needs no "run the same command again"); `tp`: the server's TP
        degree as checked (None: not known, said as if above 1)."""
        url = self.client.url
        status, text = self.client.call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                                        f"loading adapter '{name}' from {path}", start)
        if status == 200:
            return
        reason = error_reason(text)
        worker = _WORKER_ERROR.search(reason)
        reason = first_line(worker.group(1), 600) if worker else reason
        where = f"rollout server {url} cannot load {path} as '{name}'"
        if "LoRA is not enabled" in reason:
            raise RolloutError(f"rollout server {url} serves no adapters: it was started without --enable-lora "
                               f"(loading {path} answered: {reason}); restart it with --enable-lora: {start}")
        if status == 404 and "No adapter found" in reason:
            raise RolloutError(f"{where}: the server finds no adapter there ({reason}); it reads adapters from its "
                               "own filesystem: run it where the trainer writes them, or write them to a directory "
                               "both see")
        if status == 404:
            raise RolloutError(f"{where}: /v1/load_lora_adapter answers 404, the server no longer loads adapters at "
                               f"run time; restart it with {RUNTIME_ENV}=1 in its environment: {start}")
        if "has already been loaded" in reason:
            raise RolloutError(f"{where}: it already serves an adapter named '{name}' (loaded by an earlier process?); "
                               "unload it first, or load under a new name")
        fix = "" if checking else f"; restart it ({start}) and run the same command again"
        if worker and (tp is None or tp > 1):
            fix = (f"; after the fix, restart the server ({start}): at TP > 1 vLLM 0.32 answers every later load "
                   "with this refusal (vllm-project/vllm#58242)")
        raise RolloutError(f"{where}: HTTP {status}: {reason}{fix}")

    def unload(self, name: str, start: str) -> None:
        status, text = self.client.call("POST", "/v1/unload_lora_adapter", {"lora_name": name},
                                        f"unloading adapter '{name}'", start)
        if status != 200:
            raise RolloutError(f"rollout server {self.client.url} cannot unload '{name}': HTTP {status}: "
                               f"{error_reason(text)}; it serves {sorted(self.served(start)) or 'no adapter'}")

    def served(self, start: str) -> set[str]:
        """The adapters the server serves: the ids of /v1/models with a parent (the base)."""
        status, text = self.client.call("GET", "/v1/models", None, "listing models", start)
        if status != 200:
            raise RolloutError(f"rollout server {self.client.url}: GET /v1/models answered HTTP {status}: "
                               f"{error_reason(text)}")
        return {m["id"] for m in json_object(text).get("data", []) if m.get("parent")}
