"""Sampling completions from a running `vllm serve` (`/v1/completions`), under an adapter it serves, with the log-prob
of each sampled token.

Log-probs: vLLM's default `--logprobs-mode raw_logprobs`, which server_check.py holds the server to, returns the
log-softmax of the unscaled logits, before temperature, top-k, top-p or penalties: `Completion.logprobs` are the
log-probs of the sampled tokens at temperature 1 whatever the sampling temperature, the trainer's log_softmax of its
logits. Every sampling setting is sent (top_k 0, min_p 0, repetition_penalty 1 when not asked), so the defaults vLLM
takes from the model's generation_config.json for unset ones never change the sampling.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from bdlora_train.core.errors import RolloutError
from bdlora_train.rl.engine_client import EngineClient, error_reason, json_object
from bdlora_train.rl.server_adapters import ServerAdapters

MAX_THREADS = 64


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its token ids (the EOS or stop token that ended it included), the raw log-prob of
    each (see the module docstring) and vLLM's finish reason ("stop" or "length")."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class ServerSampling:
    """Completions from the server behind `client`; `adapters` names what it serves when a model is missing."""

    def __init__(self, client: EngineClient, adapters: ServerAdapters):
        self.client, self.adapters = client, adapters

    def complete(self, model: str, prompts: list[list[int]], *, n: int, max_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int | None = None, seed: int | None = None,
                 stop_token_ids: list[int] | None = None, start: str) -> list[list[Completion]]:
        """`n` completions of each prompt (token ids) under `model` (an adapter's name, or the base's id): one list
        per prompt, in prompt order. The prompts go as concurrent requests, one per prompt (vLLM batches them in
        its scheduler as it does a multi-prompt request); with `seed`, prompt i's samples use seeds seed + i*n ...
        seed + i*n + n-1 (vLLM gives a request's j-th sample seed + j), so equal prompts still differ. `start`: the
        command that restarts the server, for the message of one that stops answering."""
        if not prompts:
            return []
        body = {"model": model, "n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                "top_k": top_k or 0, "min_p": 0.0, "repetition_penalty": 1.0, "logprobs": 0,
                "return_token_ids": True, "return_tokens_as_token_ids": True}
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)
        what = f"the completions of {len(prompts)} prompt(s) (n {n}) under '{model}'"

        def one(i: int) -> list[Completion]:
            request = {**body, "prompt": list(prompts[i])}
            if seed is not None:
                request["seed"] = seed + i * n
            status, text = self.client.call("POST", "/v1/completions", request, what, start)
            return self.read(model, status, text, n, what, start)

        if len(prompts) == 1:
            return [one(0)]
        with ThreadPoolExecutor(min(len(prompts), MAX_THREADS)) as pool:
            return list(pool.map(one, range(len(prompts))))

    def read(self, model: str, status: int, text: str, n: int, what: str, start: str) -> list[Completion]:
        """One answer of /v1/completions (`status`, `text`) to a request of `n` samples under `model`."""
        url = self.client.url
        if status == 404 and "does not exist" in text:
            raise RolloutError(
                f"rollout server {url} does not serve '{model}' (it serves {sorted(self.adapters.served(start))}): "
                "it was restarted or the adapter unloaded since the sync; run the same command again: the run resumes "
                "from its last checkpoint")
        if status != 200:
            reason = error_reason(text)
            fix = ("; start the server with a larger --max-model-len, or ask fewer tokens"
                   if "maximum context length" in reason or "max_model_len" in reason else "")
            raise RolloutError(f"rollout server {url} refused {what}: HTTP {status}: {reason}{fix}")
        out = json_object(text)
        if out.get("model") != model:
            raise RolloutError(f"rollout server {url} answered {what} for model '{out.get('model')}', not "
                               f"'{model}': it does not serve the adapter version the trainer synced; run the same "
                               "command again: the run resumes from its last checkpoint")
        choices = sorted(out.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != n:
            raise RolloutError(f"rollout server {url} answered {what} with {len(choices)} completions, not {n}")
        result = []
        for choice in choices:
            ids, lp = choice.get("token_ids"), choice.get("logprobs") or {}
            logprobs, tokens = lp.get("token_logprobs"), lp.get("tokens")
            if (ids is None or logprobs is None or len(logprobs) != len(ids)
                    or tokens != [f"token_id:{t}" for t in ids] or any(x is None for x in logprobs)):
                raise RolloutError(f"rollout server {url} answered {what} without a log-prob for each token id "
                                   "(return_token_ids, logprobs 0): it is not vLLM 0.32's OpenAI server")
            result.append(Completion([int(t) for t in ids], [float(x) for x in logprobs],
                                     str(choice.get("finish_reason"))))
        return result
