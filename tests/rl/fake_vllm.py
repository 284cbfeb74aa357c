"""A stand-in for `vllm serve`'s OpenAI-compatible server (standard library only), answering as vLLM 0.32 does in
the cases bdlora_train/rl/vllm_server.py's docstrings record, each misconfiguration a setting. It records every
request it gets, in order. Log-probs are a function of the token id alone (`logprob`), so a test can compute what
the trainer's side would be; or, with a `scorer`, a real model's (the adapter a request names loaded on it)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ENGINE_DEAD = "EngineCore encountered an issue."


def logprob(token: int, shift: float = 0.0) -> float:
    """The fake base's log-prob of `token` (wherever it stands)."""
    return -0.1 * (token % 7 + 1) + shift


@dataclass
class FakeVllm:
    base: str = "org/base"
    tp: int = 1
    runtime_loading: bool = True  # VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
    enable_lora: bool = True
    max_loras: int = 2
    raw_logprobs: bool = True  # --logprobs-mode raw_logprobs
    shift: float = 0.0  # another base: every log-prob moved by this much
    worker_refusals: dict = field(default_factory=dict)  # adapter path -> the plugin's refusal
    engine_dead: bool = False  # every completion answers vLLM's EngineDeadError
    api_key: bool = False
    adapters: dict = field(default_factory=dict)  # name -> path
    requests: list = field(default_factory=list)  # (method, path, body)
    answers: list = field(default_factory=list)  # the body of every completion answered, in order
    peak_adapters: int = 0  # the most adapters served at once
    # scorer(adapter path or None for the base, prompt ids, completion ids) -> the completion's log-probs
    scorer: Callable[[str | None, list, list], list] | None = None

    def __enter__(self) -> str:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._answer("GET", None)

            def do_POST(self):
                self._answer("POST", json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

            def _answer(self, method, body):
                fake.requests.append((method, self.path, body))
                status, text = fake.answer(method, self.path, body)
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def answer(self, method: str, path: str, body: dict | None) -> tuple[int, str]:
        if self.api_key:
            return 401, json.dumps({"error": "Unauthorized"})
        if (method, path) == ("GET", "/v1/models"):
            models = [{"id": self.base, "parent": None, "max_model_len": 256}]
            return 200, json.dumps({"data": models + [{"id": n, "parent": self.base} for n in self.adapters]})
        if (method, path) == ("GET", "/metrics"):
            info = f'vllm:lora_requests_info{{max_lora="{self.max_loras}",running_lora_adapters=""}} 1.0\n'
            return 200, "vllm:num_requests_running 0.0\n" + (info if self.enable_lora else "")
        if path == "/v1/load_lora_adapter":
            return self._load(body)
        if path == "/v1/unload_lora_adapter":
            if body["lora_name"] not in self.adapters:
                return 404, _error(f"The lora adapter '{body['lora_name']}' cannot be found.")
            del self.adapters[body["lora_name"]]
            return 200, "Success"
        if path == "/v1/completions":
            return self._complete(body)
        return 404, json.dumps({"detail": "Not Found"})

    def _load(self, body: dict) -> tuple[int, str]:
        name, path = body["lora_name"], body["lora_path"]
        if not self.runtime_loading:
            return 404, json.dumps({"detail": "Not Found"})
        if not name or not path:
            return 400, _error("Both 'lora_name' and 'lora_path' must be provided.")
        if not self.enable_lora:
            return 500, _error("LoRA is not enabled. Use --enable-lora to enable LoRA.")
        if name in self.adapters:
            return 400, _error(f"The lora adapter '{name}' has already been loaded.")
        if path in self.worker_refusals:
            refusal = self.worker_refusals[path]
            return 500, _error(f"Call to add_lora method failed: Worker failed with error '{refusal}', please check "
                               "the stack trace above for the root cause")
        self.adapters[name] = path
        self.peak_adapters = max(self.peak_adapters, len(self.adapters))
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def _complete(self, body: dict) -> tuple[int, str]:
        model = body["model"]
        if model != self.base and model not in self.adapters:
            return 404, _error(f"The model `{model}` does not exist.")
        if self.engine_dead:
            return 500, _error(ENGINE_DEAD)
        seed, prompt = body.get("seed") or 0, body["prompt"]
        choices = []
        for i in range(body.get("n", 1)):
            ids = [(seed + i + k) % 50 + 3 for k in range(body["max_tokens"])]
            temperature = body.get("temperature") or 1.0
            if self.scorer is not None:
                lps = self.scorer(self.adapters.get(model), prompt, ids)
            else:
                lps = [logprob(t, self.shift) / (1.0 if self.raw_logprobs else temperature) for t in ids]
            choice = {"index": i, "token_ids": ids, "finish_reason": "length",
                      "logprobs": {"token_logprobs": lps, "tokens": [f"token_id:{t}" for t in ids]}}
            if body.get("prompt_logprobs") is not None:
                scored = (self.scorer(None, prompt[:1], prompt[1:]) if self.scorer is not None
                          else [logprob(t, self.shift) for t in prompt[1:]])
                choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": lp}} for t, lp in zip(prompt[1:], scored)]
            choices.append(choice)
        tp = f"-tp{self.tp}" if self.tp > 1 else ""
        answer = {"model": model, "choices": choices, "system_fingerprint": f"vllm-0.32.0{tp}-963c935f"}
        self.answers.append(answer)
        return 200, json.dumps(answer)


def _error(message: str) -> str:
    return json.dumps({"error": {"message": message, "type": "BadRequestError"}})
