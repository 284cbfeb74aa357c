"""The client of the rollout server: a stock `vllm serve` (any TP degree, the bdlora plugin loaded through vLLM's
general_plugins entry point) that loads each version of the RL run's adapter at run time and samples completions.

Standard library only (urllib, no proxies: the server is reached directly, and a proxy would turn a dead server into
its own error page). Every failure is a `RolloutError` of one line naming the URL, the value and the fix.

What vLLM 0.32 answers, and how `RolloutServer.check` reads each misconfiguration before the first step:
- not running: the connection is refused (no answer);
- started without `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`: `/v1/load_lora_adapter` does not exist (404); with it, a load
  without a name answers 400 ("Both 'lora_name' and 'lora_path' must be provided"), loading nothing;
- started without `--enable-lora`: `/metrics` has no `vllm:lora_requests_info` gauge (vLLM creates it only with a
  LoRA config), and a load answers 500 "LoRA is not enabled. Use --enable-lora to enable LoRA.";
- `--max-loras`: the `max_lora` label of `vllm:lora_requests_info{max_lora="2",...}` on `/metrics`; the gauge has
  a sample only once the engine has run a step, so the check reads it after its probe request;
- the adapter's rank above `--max-lora-rank`, or nblocks the TP degree cannot cut: loading the run's initial adapter
  answers 500 "Call to add_lora method failed: Worker failed with error '<the plugin's refusal>', ..."; the
  refusal is passed on. vLLM masks paths in error messages as `<path>`. vLLM 0.32 at TP > 1 does not drain the
  other ranks' replies after a worker fails (vllm-project/vllm#58242), so every later load on that server answers
  an earlier refusal: the message says to restart it;
- `--logprobs-mode` other than `raw_logprobs`: a token sampled at temperature 2 gets a log-prob other than the one
  the same token gets as a prompt token (prompt log-probs skip the sampling processors);
- another base model: the prompt log-probs (`prompt_logprobs: 0`) of the trainer's probe ids under the server's base
  model differ from the trainer's by more than `tol`.

Log-probs: vLLM's default `--logprobs-mode raw_logprobs`, which `check` holds the server to, returns the
log-softmax of the unscaled logits, before temperature, top-k, top-p or penalties: `Completion.logprobs` are the
log-probs of the sampled tokens at temperature 1 whatever the sampling temperature, the trainer's log_softmax of its
logits. Every sampling setting is sent (top_k 0, min_p 0, repetition_penalty 1 when not asked), so the defaults vLLM
takes from the model's generation_config.json for unset ones never change the sampling.

How a server that stops answers: killed (SIGKILL), the requests in flight lose their connection ("Remote end closed
connection without response"); stopped with Ctrl-C (SIGINT), they answer HTTP 500 "EngineCore encountered an
issue" (said as the server that stopped answering, too); with SIGTERM they were seen to wait until the process
ended. A server that never answers is given up after `timeout_s`.

A run's adapter versions need a new (name, path) each: vLLM's prefix cache keys an adapter's KV blocks by both, so a
name and path reused with other weights would reuse KV computed with the old ones.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bdlora_train.core.errors import RolloutError, first_line

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
MIN_LORAS = 2  # a sync loads the new version before it unloads the old one
PROBE_TOKENS = 128  # the base-model check scores at most this many probe tokens
MODE_TEMPERATURE = 2.0  # the --logprobs-mode check samples at this temperature (processed log-probs differ)
MAX_THREADS = 64
ENGINE_DEAD = "EngineCore encountered an issue"  # vLLM's EngineDeadError: the requests in flight when it stops
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_WORKER_ERROR = re.compile(r"Worker failed with error '(.*)', please check the stack trace", re.S)
_MAX_LORA = re.compile(r'^vllm:lora_requests_info\{[^}]*max_lora="(\d+)"', re.M)
_FINGERPRINT = re.compile(r"^vllm-(?P<version>[0-9][^-]*)(?P<parallel>(?:-(?:tp|pp|dp|ep)\d+)*)-[0-9a-f]{8}$")


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its token ids (the EOS or stop token that ended it included), the raw log-prob of
    each (see the module docstring) and vLLM's finish reason ("stop" or "length")."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class ServerCheck:
    """What `RolloutServer.check` found: the server's base model id (/v1/models), vLLM's version and TP degree (its
    system_fingerprint; None when it has none), --max-loras (None when /metrics does not say), and the largest
    |log-prob difference| of the probe's tokens between the server's base and the trainer's."""

    base_model: str
    vllm: str | None
    tp: int | None
    max_loras: int | None
    base_logprob_diff: float
    probe_tokens: int


class _NoAnswer(Exception):
    """The connection failed, broke or timed out: `reason` in words."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class RolloutServer:
    """A running `vllm serve` at `url` (http://host:port). `start_command`: the command that starts it as the run
    needs it (printed in the messages that say to start or restart it). `timeout_s`: the longest wait for one
    answer (a completion request answers when all its samples are done)."""

    def __init__(self, url: str, start_command: str | None = None, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.start_command = start_command
        self.timeout_s = timeout_s
        self.checked: ServerCheck | None = None

    # ---- preflight -------------------------------------------------------------------------------------------

    def check(self, *, base_model: str, probe_ids: list[int], probe_logprobs: list[float], adapter_dir: Path,
              adapter_name: str, tol: float) -> ServerCheck:
        """Every refusal the server can give before the first step, in this order: no answer, run-time adapter
        loading off, no --enable-lora, --max-loras below 2, log-probs other than raw, another base model (the
        server's prompt log-probs of `probe_ids[1:]` against the trainer's `probe_logprobs`, fp32, within `tol`),
        and the run's initial adapter `adapter_dir` refused (its rank above --max-lora-rank, nblocks the TP degree
        cannot cut, ...). The base comes before the adapter: an adapter on another base fails to load for reasons
        that do not say so. On success `adapter_dir` is loaded as `adapter_name`; returns (and keeps in
        `self.checked`) what was measured."""
        start = self._start_hint(base_model, adapter_dir)
        base = self._check_answers(start)
        self._check_runtime_loading(start)
        probe_ids, probe_logprobs = self._cut_probe(base, probe_ids, probe_logprobs)
        try:  # the probe request runs first: the --max-loras gauge has a sample only after an engine step
            scored, refused = self._score(base, probe_ids, base_model, start), None
        except RolloutError as err:
            scored, refused = None, err
        max_loras = self._check_lora_slots(start)
        if refused is not None:
            raise refused
        self._check_logprobs_mode(base, probe_ids, scored, tol, start)
        diff = self._check_base(base, base_model, probe_logprobs, scored["prompt"], tol)
        vllm, tp = scored["fingerprint"]
        self.checked = ServerCheck(base["id"], vllm, tp, max_loras, diff, len(probe_logprobs))
        self._load(adapter_name, Path(adapter_dir), start, checking=True)
        return self.checked

    def _start_hint(self, base_model: str, adapter_dir) -> str:
        if self.start_command:
            return self.start_command
        return (f"{RUNTIME_ENV}=1 vllm serve {base_model} --enable-lora --max-loras {MIN_LORAS} --max-lora-rank R "
                f"(R and the TP degree: `bdlora check-serving {adapter_dir} --tp N` prints them)")

    def _check_answers(self, start: str) -> dict:
        """The base model's entry of /v1/models (the first without a parent)."""
        try:
            status, text = self._request("GET", "/v1/models")
        except _NoAnswer as err:
            raise RolloutError(f"rollout server {self.url}: no answer ({err.reason}); start it with: {start}") from None
        if status == 401:
            raise RolloutError(f"rollout server {self.url} asks for an API key (started with --api-key), which this "
                               f"client does not send; start it without --api-key: {start}")
        models = _json(text).get("data") if status == 200 else None
        bases = [m for m in models or [] if isinstance(m, dict) and not m.get("parent")]
        if not bases:
            raise RolloutError(f"rollout server {self.url}: GET /v1/models answered HTTP {status} "
                               f"{_reason(text)!r}, not vLLM's model list; start `vllm serve` there: {start}")
        return bases[0]

    def _check_runtime_loading(self, start: str) -> None:
        status, text = self._call("POST", "/v1/load_lora_adapter", {"lora_name": "", "lora_path": ""},
                                  "checking run-time adapter loading", start)
        if status == 404:
            raise RolloutError(f"rollout server {self.url} does not load adapters at run time (POST "
                               f"/v1/load_lora_adapter answers 404): it was started without {RUNTIME_ENV}=1; "
                               f"restart it with that variable in its environment: {start}")
        if status != 400:  # an empty name is refused before anything loads
            raise RolloutError(f"rollout server {self.url}: POST /v1/load_lora_adapter without a name answered HTTP "
                               f"{status} {_reason(text)!r}, not vLLM's refusal; start `vllm serve` there: {start}")

    @staticmethod
    def _cut_probe(base: dict, probe_ids: list[int], probe_logprobs: list[float]):
        if len(probe_logprobs) != len(probe_ids) - 1 or len(probe_ids) < 2:
            raise ValueError(f"probe_logprobs holds {len(probe_logprobs)} log-probs for {len(probe_ids)} probe ids; "
                             "it must hold one per id after the first")
        keep = min(len(probe_ids), PROBE_TOKENS + 1, max(2, int(base.get("max_model_len") or 1 << 30) - 2))
        return list(probe_ids[:keep]), list(probe_logprobs[:keep - 1])

    def _score(self, base: dict, probe_ids: list[int], base_model: str, start: str) -> dict:
        """The server's prompt log-probs of probe_ids[1:] under its base, and one token sampled after them at
        MODE_TEMPERATURE with its log-prob as the server returns completion log-probs."""
        body = {"model": base["id"], "prompt": probe_ids, "max_tokens": 1, "prompt_logprobs": 0, "logprobs": 0,
                "temperature": MODE_TEMPERATURE, "seed": 0, "return_token_ids": True, "top_k": 0, "top_p": 1.0}
        status, text = self._call("POST", "/v1/completions", body, "scoring the probe under the base model", start)
        if status != 200:
            raise RolloutError(f"rollout server {self.url} cannot score the trainer's probe token ids under its base "
                               f"model '{base['id']}' (HTTP {status}: {_reason(text)}): it serves another base model "
                               f"than '{base_model}'; serve '{base_model}': {start}")
        out = _json(text)
        choice = out["choices"][0]
        prompt = [_only_logprob(entry) for entry in choice["prompt_logprobs"][1:]]
        sampled = (choice["token_ids"][0], choice["logprobs"]["token_logprobs"][0])
        return {"prompt": prompt, "sampled": sampled, "fingerprint": _fingerprint(out)}

    def _check_lora_slots(self, start: str) -> int | None:
        """--max-loras from /metrics (None when the server exports no metrics); refuses a server without LoRA."""
        text = ""
        for _ in range(10):  # the gauge's sample is written after the engine step that answered the probe
            status, text = self._call("GET", "/metrics", None, "reading /metrics", start)
            if status != 200 or "vllm:" not in text:
                return None  # metrics off (--disable-log-stats): the adapter load below tells instead
            if "vllm:lora_requests_info" not in text:
                raise RolloutError(f"rollout server {self.url} serves no adapters: it was started without "
                                   "--enable-lora (its /metrics have no vllm:lora_requests_info); restart it with "
                                   f"--enable-lora: {start}")
            found = _MAX_LORA.search(text)
            if found:
                max_loras = int(found.group(1))
                if max_loras < MIN_LORAS:
                    raise RolloutError(
                        f"rollout server {self.url} runs with --max-loras {max_loras}: a sync loads the adapter's new "
                        f"version before it unloads the old one, so it needs --max-loras {MIN_LORAS} or more; restart "
                        f"it as: {start}")
                return max_loras
            time.sleep(0.3)
        return None

    def _check_logprobs_mode(self, base: dict, probe_ids: list[int], scored: dict, tol: float, start: str) -> None:
        token, sampled = scored["sampled"]
        body = {"model": base["id"], "prompt": [*probe_ids, token], "max_tokens": 1, "prompt_logprobs": 0,
                "temperature": 0.0}
        status, text = self._call("POST", "/v1/completions", body, "checking the log-probs mode", start)
        if status != 200:
            raise RolloutError(f"rollout server {self.url} refused a prompt-log-probs request under '{base['id']}' "
                               f"(HTTP {status}: {_reason(text)}); restart it as: {start}")
        raw = _only_logprob(_json(text)["choices"][0]["prompt_logprobs"][-1])
        logits = max([raw, sampled, *scored["prompt"]]) > 1e-4  # log-probs are never positive; logits can be
        if logits or not abs(sampled - raw) <= tol:
            seen = ("logits, not log-probs" if logits else
                    f"the token sampled at temperature {MODE_TEMPERATURE:g} got {sampled:.4f}, {raw:.4f} as a prompt "
                    "token")
            raise RolloutError(f"rollout server {self.url} returns log-probs other than raw ({seen}): it was started "
                               "with --logprobs-mode other than raw_logprobs; restart it without --logprobs-mode: "
                               f"{start}")

    def _check_base(self, base: dict, base_model: str, probe_logprobs: list[float], served: list[float],
                    tol: float) -> float:
        diff = max((abs(a - b) for a, b in zip(probe_logprobs, served, strict=True)), default=0.0)
        if not diff <= tol:  # NaN refused too
            raise RolloutError(
                f"rollout server {self.url} serves another base model: its '{base['id']}' gives the log-probs of the "
                f"probe's {len(served)} tokens up to {diff:.3g} from the trainer's '{base_model}' (tolerance {tol:g}); "
                f"serve '{base_model}' at the trainer's dtype (e.g. --dtype float32), or train on '{base['id']}'")
        return diff

    # ---- adapters --------------------------------------------------------------------------------------------

    def load(self, name: str, path: Path) -> None:
        """Load the PEFT adapter directory `path` (as the server's filesystem holds it) under `name`."""
        self._load(name, Path(path), self._restart_hint(), checking=False)

    def _load(self, name: str, path: Path, start: str, checking: bool) -> None:
        status, text = self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                                  f"loading adapter '{name}' from {path}", start)
        if status == 200:
            return
        reason = _reason(text)
        worker = _WORKER_ERROR.search(reason)
        reason = first_line(worker.group(1), 600) if worker else reason
        where = f"rollout server {self.url} cannot load {path} as '{name}'"
        if "LoRA is not enabled" in reason:
            raise RolloutError(f"rollout server {self.url} serves no adapters: it was started without --enable-lora "
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
        if worker and (self.checked is None or self.checked.tp is None or self.checked.tp > 1):
            fix = (f"; after the fix, restart the server ({start}): at TP > 1 vLLM 0.32 answers every later load "
                   "with this refusal (vllm-project/vllm#58242)")
        raise RolloutError(f"{where}: HTTP {status}: {reason}{fix}")

    def unload(self, name: str) -> None:
        status, text = self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name},
                                  f"unloading adapter '{name}'", self._restart_hint())
        if status != 200:
            raise RolloutError(f"rollout server {self.url} cannot unload '{name}': HTTP {status}: {_reason(text)}; "
                               f"it serves {sorted(self.served_adapters()) or 'no adapter'}")

    def served_adapters(self) -> set[str]:
        """The adapters the server serves: the ids of /v1/models with a parent (the base)."""
        status, text = self._call("GET", "/v1/models", None, "listing models", self._restart_hint())
        if status != 200:
            raise RolloutError(f"rollout server {self.url}: GET /v1/models answered HTTP {status}: {_reason(text)}")
        return {m["id"] for m in _json(text).get("data", []) if m.get("parent")}

    # ---- sampling --------------------------------------------------------------------------------------------

    def complete(self, model: str, prompts: list[list[int]], *, n: int, max_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int | None = None, seed: int | None = None,
                 stop_token_ids: list[int] | None = None) -> list[list[Completion]]:
        """`n` completions of each prompt (token ids) under `model` (an adapter's name, or the base's id): one list
        per prompt, in prompt order. The prompts go as concurrent requests, one per prompt (vLLM batches them in
        its scheduler as it does a multi-prompt request); with `seed`, prompt i's samples use seeds seed + i*n ...
        seed + i*n + n-1 (vLLM gives a request's j-th sample seed + j), so equal prompts still differ."""
        if not prompts:
            return []
        body = {"model": model, "n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                "top_k": top_k or 0, "min_p": 0.0, "repetition_penalty": 1.0, "logprobs": 0,
                "return_token_ids": True, "return_tokens_as_token_ids": True}
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)
        what = f"the completions of {len(prompts)} prompt(s) (n {n}) under '{model}'"
        start = self._restart_hint()

        def one(i: int) -> list[Completion]:
            request = {**body, "prompt": list(prompts[i])}
            if seed is not None:
                request["seed"] = seed + i * n
            status, text = self._call("POST", "/v1/completions", request, what, start)
            return self._completions(model, status, text, n, what)

        if len(prompts) == 1:
            return [one(0)]
        with ThreadPoolExecutor(min(len(prompts), MAX_THREADS)) as pool:
            return list(pool.map(one, range(len(prompts))))

    def _completions(self, model: str, status: int, text: str, n: int, what: str) -> list[Completion]:
        if status == 404 and "does not exist" in text:
            raise RolloutError(
                f"rollout server {self.url} does not serve '{model}' (it serves {sorted(self.served_adapters())}): it "
                "was restarted or the adapter unloaded since the sync; run the same command again: the run resumes "
                "from its last checkpoint")
        if status != 200:
            reason = _reason(text)
            fix = ("; start the server with a larger --max-model-len, or ask fewer tokens"
                   if "maximum context length" in reason or "max_model_len" in reason else "")
            raise RolloutError(f"rollout server {self.url} refused {what}: HTTP {status}: {reason}{fix}")
        out = _json(text)
        if out.get("model") != model:
            raise RolloutError(f"rollout server {self.url} answered {what} for model '{out.get('model')}', not "
                               f"'{model}': it does not serve the adapter version the trainer synced; run the same "
                               "command again: the run resumes from its last checkpoint")
        choices = sorted(out.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != n:
            raise RolloutError(f"rollout server {self.url} answered {what} with {len(choices)} completions, not {n}")
        result = []
        for choice in choices:
            ids, lp = choice.get("token_ids"), choice.get("logprobs") or {}
            logprobs, tokens = lp.get("token_logprobs"), lp.get("tokens")
            if (ids is None or logprobs is None or len(logprobs) != len(ids)
                    or tokens != [f"token_id:{t}" for t in ids] or any(x is None for x in logprobs)):
                raise RolloutError(f"rollout server {self.url} answered {what} without a log-prob for each token id "
                                   "(return_token_ids, logprobs 0): it is not vLLM 0.32's OpenAI server")
            result.append(Completion([int(t) for t in ids], [float(x) for x in logprobs],
                                     str(choice.get("finish_reason"))))
        return result

    # ---- HTTP ------------------------------------------------------------------------------------------------

    def _restart_hint(self) -> str:
        return self.start_command or "the same `vllm serve` command"

    def _call(self, method: str, path: str, body: dict | None, what: str, start: str) -> tuple[int, str]:
        """`_request`; a lost connection, or an engine that died (vLLM's answer to the requests in flight when it is
        stopped), said as the server that stopped answering during `what`."""
        try:
            status, text = self._request(method, path, body)
            if status >= 500 and ENGINE_DEAD in text:
                raise _NoAnswer(f"its engine died (HTTP {status}: {_reason(text)})")
            return status, text
        except _NoAnswer as err:
            raise RolloutError(
                f"rollout server {self.url} stopped answering during {what}: {err.reason}; restart it ({start}) and "
                "run the same command again: the run resumes from its last checkpoint") from None

    def _request(self, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
        """(HTTP status, body text), error statuses included; `_NoAnswer` when no answer came."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
        try:
            with _OPENER.open(req, timeout=self.timeout_s) as resp:
                return resp.status, resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as err:
            try:
                return err.code, err.read().decode("utf-8", "replace")
            except (OSError, http.client.HTTPException) as broken:
                raise _NoAnswer(_words(broken, self.timeout_s)) from None
        except urllib.error.URLError as err:
            raise _NoAnswer(_words(err.reason, self.timeout_s)) from None
        except (OSError, http.client.HTTPException) as err:
            raise _NoAnswer(_words(err, self.timeout_s)) from None


def _words(err, timeout_s: float) -> str:
    if isinstance(err, TimeoutError) or str(err) == "timed out":
        return f"no answer in {timeout_s:g} s"
    return first_line(err if isinstance(err, BaseException) else str(err)) or type(err).__name__


def _json(text: str) -> dict:
    try:
        out = json.loads(text)
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def _reason(text: str) -> str:
    """An error answer's message (vLLM's {"error": {"message"}} or FastAPI's {"detail"}), as one line."""
    out = _json(text)
    err = out.get("error")
    message = err.get("message") if isinstance(err, dict) else out.get("detail", text)
    return " ".join(str(message).split())[:600].rstrip(".") or "(empty answer)"


def _only_logprob(entry: dict) -> float:
    """A prompt_logprobs entry with prompt_logprobs 0: {token id: {"logprob": ...}} for the prompt's own token."""
    (value,) = entry.values()
    out = float(value["logprob"])
    return out if not math.isinf(out) else -1e30


def _fingerprint(out: dict) -> tuple[str | None, int | None]:
    """vLLM's version and TP degree from a response's system_fingerprint ("vllm-0.32.0-tp3-963c935f"; at TP 1
    "vllm-0.32.0-963c935f"; None with --fingerprint-mode none or custom)."""
    found = _FINGERPRINT.match(str(out.get("system_fingerprint") or ""))
    if not found:
        return None, None
    tp = re.search(r"-tp(\d+)", found["parallel"])
    return found["version"], int(tp.group(1)) if tp else 1
