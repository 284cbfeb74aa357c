"""The checks of a running `vllm serve` before an RL run's first step: that it answers, loads adapters at run time,
serves them in enough slots, returns raw log-probs, and serves the trainer's base model (its log-probs of the
trainer's probe tokens within the run's bound of the trainer's, rl/logprob_gap.py). Each refusal is one line with
the fix.

What vLLM 0.32 answers, and how `ServerPreflight` reads each misconfiguration:
- not running: the connection is refused (no answer);
- started without `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`: `/v1/load_lora_adapter` does not exist (404); with it, a load
  without a name answers 400 ("Both 'lora_name' and 'lora_path' must be provided"), loading nothing;
- started without `--enable-lora`: `/metrics` has no `vllm:lora_requests_info` gauge (vLLM creates it only with a
  LoRA config), and a load answers 500 "LoRA is not enabled. Use --enable-lora to enable LoRA.";
- `--max-loras`: the `max_lora` label of `vllm:lora_requests_info{max_lora="2",...}` on `/metrics`; the gauge has
  a sample only once the engine has run a step, so the check reads it after its probe request;
- `--logprobs-mode` other than `raw_logprobs`: a token sampled at temperature 2 gets a log-prob other than the one
  the same token gets as a prompt token (prompt log-probs skip the sampling processors);
- another base model: the prompt log-probs (`prompt_logprobs: 0`) of the trainer's probe ids under the server's base
  model differ from the trainer's by more than the run's rule allows (rl/logprob_gap.py).
The run's initial adapter is loaded last (server_adapters.py reads its refusals).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

from bdlora_train.core.errors import RolloutError
from bdlora_train.rl.engine_client import EngineClient, NoAnswer, error_reason, json_object
from bdlora_train.rl.logprob_gap import GapRule, gap
from bdlora_train.rl.server_adapters import RUNTIME_ENV

MIN_LORAS = 2  # a sync loads the new version before it unloads the old one
PROBE_TOKENS = 128  # the base-model check scores at most this many probe tokens
MODE_TEMPERATURE = 2.0  # the --logprobs-mode check samples at this temperature (processed log-probs differ)
_MAX_LORA = re.compile(r'^vllm:lora_requests_info\{[^}]*max_lora="(\d+)"', re.M)
_FINGERPRINT = re.compile(r"^vllm-(?P<version>[0-9][^-]*)(?P<parallel>(?:-(?:tp|pp|dp|ep)\d+)*)-[0-9a-f]{8}$")


def lora_slots(max_staleness: int) -> int:
    """The adapter slots (--max-loras) a run needs: the versions its rollouts may still be sampled under (max_staleness
    of them before the current one) and the current one, and at least two (a new version loads before the old one
    unloads)."""
    return max(MIN_LORAS, max_staleness + 1)


@dataclass(frozen=True)
class ServerCheck:
    """What `ServerPreflight.run` found: the server's base model id (/v1/models), vLLM's version and TP degree (its
    system_fingerprint; None when it has none), --max-loras (None when /metrics does not say), and the largest
    |log-prob difference| of the probe's tokens between the server's base and the trainer's."""

    base_model: str
    vllm: str | None
    tp: int | None
    max_loras: int | None
    base_logprob_diff: float
    probe_tokens: int


def start_hint(base_model: str, adapter_dir, slots: int = MIN_LORAS) -> str:
    """The command that starts the server, when the run was given none."""
    return (f"{RUNTIME_ENV}=1 vllm serve {base_model} --enable-lora --max-loras {slots} --max-lora-rank R "
            f"(R and the TP degree: `bdlora check-serving {adapter_dir} --tp N` prints them)")


class ServerPreflight:
    """The checks of the server behind `client`, run in order by `run`; each step is a method of its own. `start`,
    in each: the command that starts the server as the run needs it."""

    def __init__(self, client: EngineClient):
        self.client = client

    def run(self, *, base_model: str, probe_ids: list[int], probe_logprobs: list[float], rule: GapRule,
            start: str, slots: int = MIN_LORAS) -> ServerCheck:
        """Every refusal before the run's adapter loads, in this order: no answer, run-time adapter loading off, no
        --enable-lora, --max-loras below `slots`, log-probs other than raw, another base model (the server's prompt
        log-probs of `probe_ids[1:]` against the trainer's `probe_logprobs`, fp32, within `rule`)."""
        base = self.answers(start)
        self.check_runtime_loading(start)
        probe_ids, probe_logprobs = cut_probe(base, probe_ids, probe_logprobs)
        try:  # the probe request runs first: the --max-loras gauge has a sample only after an engine step
            scored, refused = self.score(base, probe_ids, base_model, start), None
        except RolloutError as err:
            scored, refused = None, err
        max_loras = self.check_lora_slots(start, slots)
        if refused is not None:
            raise refused
        self.check_logprobs_mode(base, probe_ids, scored, rule, start)
        diff = self.check_base(base, base_model, probe_logprobs, scored["prompt"], rule)
        vllm, tp = scored["fingerprint"]
        return ServerCheck(base["id"], vllm, tp, max_loras, diff, len(probe_logprobs))

    def answers(self, start: str) -> dict:
        """The base model's entry of /v1/models (the first without a parent)."""
        url = self.client.url
        try:
            status, text = self.client.request("GET", "/v1/models")
        except NoAnswer as err:
            raise RolloutError(f"rollout server {url}: no answer ({err.reason}); start it with: {start}") from None
        if status == 401:
            raise RolloutError(f"rollout server {url} asks for an API key (started with --api-key), which this "
                               f"client does not send; start it without --api-key: {start}")
        models = json_object(text).get("data") if status == 200 else None
        bases = [m for m in models or [] if isinstance(m, dict) and not m.get("parent")]
        if not bases:
            raise RolloutError(f"rollout server {url}: GET /v1/models answered HTTP {status} "
                               f"{error_reason(text)!r}, not vLLM's model list; start `vllm serve` there: {start}")
        return bases[0]

    def check_runtime_loading(self, start: str) -> None:
        status, text = self.client.call("POST", "/v1/load_lora_adapter", {"lora_name": "", "lora_path": ""},
                                        "checking run-time adapter loading", start)
        if status == 404:
            raise RolloutError(f"rollout server {self.client.url} does not load adapters at run time (POST "
                               f"/v1/load_lora_adapter answers 404): it was started without {RUNTIME_ENV}=1; "
                               f"restart it with that variable in its environment: {start}")
        if status != 400:  # an empty name is refused before anything loads
            raise RolloutError(f"rollout server {self.client.url}: POST /v1/load_lora_adapter without a name answered "
                               f"HTTP {status} {error_reason(text)!r}, not vLLM's refusal; start `vllm serve` there: "
                               f"{start}")

    def score(self, base: dict, probe_ids: list[int], base_model: str, start: str) -> dict:
        """The server's prompt log-probs of probe_ids[1:] under its base, and one token sampled after them at
        MODE_TEMPERATURE with its log-prob as the server returns completion log-probs."""
        body = {"model": base["id"], "prompt": probe_ids, "max_tokens": 1, "prompt_logprobs": 0, "logprobs": 0,
                "temperature": MODE_TEMPERATURE, "seed": 0, "return_token_ids": True, "top_k": 0, "top_p": 1.0}
        status, text = self.client.call("POST", "/v1/completions", body, "scoring the probe under the base model",
                                        start)
        if status != 200:
            raise RolloutError(f"rollout server {self.client.url} cannot score the trainer's probe token ids under its "
                               f"base model '{base['id']}' (HTTP {status}: {error_reason(text)}): it serves another "
                               f"base model than '{base_model}'; serve '{base_model}': {start}")
        out = json_object(text)
        choice = out["choices"][0]
        prompt = [_only_logprob(entry) for entry in choice["prompt_logprobs"][1:]]
        sampled = (choice["token_ids"][0], choice["logprobs"]["token_logprobs"][0])
        return {"prompt": prompt, "sampled": sampled, "fingerprint": fingerprint(out)}

    def check_lora_slots(self, start: str, slots: int = MIN_LORAS) -> int | None:
        """--max-loras from /metrics (None when the server exports no metrics); refuses a server without LoRA."""
        url = self.client.url
        text = ""
        for _ in range(10):  # the gauge's sample is written after the engine step that answered the probe
            status, text = self.client.call("GET", "/metrics", None, "reading /metrics", start)
            if status != 200 or "vllm:" not in text:
                return None  # metrics off (--disable-log-stats): the adapter load tells instead
            if "vllm:lora_requests_info" not in text:
                raise RolloutError(f"rollout server {url} serves no adapters: it was started without "
                                   "--enable-lora (its /metrics have no vllm:lora_requests_info); restart it with "
                                   f"--enable-lora: {start}")
            found = _MAX_LORA.search(text)
            if found:
                max_loras = int(found.group(1))
                if max_loras < slots:
                    raise RolloutError(
                        f"rollout server {url} runs with --max-loras {max_loras}: a sync loads the adapter's new "
                        "version before it unloads the old one, and the rollouts in flight keep theirs "
                        f"(max_staleness), so it needs --max-loras {slots} or more; restart it as: {start}")
                return max_loras
            time.sleep(0.3)
        return None

    def check_logprobs_mode(self, base: dict, probe_ids: list[int], scored: dict, rule: GapRule,
                            start: str) -> None:
        token, sampled = scored["sampled"]
        body = {"model": base["id"], "prompt": [*probe_ids, token], "max_tokens": 1, "prompt_logprobs": 0,
                "temperature": 0.0}
        url = self.client.url
        status, text = self.client.call("POST", "/v1/completions", body, "checking the log-probs mode", start)
        if status != 200:
            raise RolloutError(f"rollout server {url} refused a prompt-log-probs request under '{base['id']}' "
                               f"(HTTP {status}: {error_reason(text)}); restart it as: {start}")
        raw = _only_logprob(json_object(text)["choices"][0]["prompt_logprobs"][-1])
        logits = max([raw, sampled, *scored["prompt"]]) > 1e-4  # log-probs are never positive; logits can be
        if logits or not rule.holds(gap([[sampled]], [[raw]])):
            seen = ("logits, not log-probs" if logits else
                    f"the token sampled at temperature {MODE_TEMPERATURE:g} got {sampled:.4f}, {raw:.4f} as a prompt "
                    "token")
            raise RolloutError(f"rollout server {url} returns log-probs other than raw ({seen}): it was started "
                               "with --logprobs-mode other than raw_logprobs; restart it without --logprobs-mode: "
                               f"{start}")

    def check_base(self, base: dict, base_model: str, probe_logprobs: list[float], served: list[float],
                   rule: GapRule) -> float:
        found = gap([probe_logprobs], [served])
        if not rule.holds(found):  # NaN refused too
            raise RolloutError(
                f"rollout server {self.client.url} serves another base model: its '{base['id']}' gives the log-probs "
                f"of the probe's {len(served)} tokens up to {found.max:.3g} from the trainer's '{base_model}' "
                f"({rule.describe(found)}); serve '{base_model}' at the trainer's dtype (e.g. --dtype float32), or "
                f"train on '{base['id']}'")
        return found.max


def cut_probe(base: dict, probe_ids: list[int], probe_logprobs: list[float]):
    """The probe cut to PROBE_TOKENS and to what the server's context holds."""
    if len(probe_logprobs) != len(probe_ids) - 1 or len(probe_ids) < 2:
        raise ValueError(f"probe_logprobs holds {len(probe_logprobs)} log-probs for {len(probe_ids)} probe ids; "
                         "it must hold one per id after the first")
    keep = min(len(probe_ids), PROBE_TOKENS + 1, max(2, int(base.get("max_model_len") or 1 << 30) - 2))
    return list(probe_ids[:keep]), list(probe_logprobs[:keep - 1])


def _only_logprob(entry: dict) -> float:
    """A prompt_logprobs entry with prompt_logprobs 0: {token id: {"logprob": ...}} for the prompt's own token."""
    (value,) = entry.values()
    out = float(value["logprob"])
    return out if not math.isinf(out) else -1e30


def fingerprint(out: dict) -> tuple[str | None, int | None]:
    """vLLM's version and TP degree from a response's system_fingerprint ("vllm-0.32.0-tp3-963c935f"; at TP 1
    "vllm-0.32.0-963c935f"; None with --fingerprint-mode none or custom)."""
    found = _FINGERPRINT.match(str(out.get("system_fingerprint") or ""))
    if not found:
        return None, None
    tp = re.search(r"-tp(\d+)", found["parallel"])
    return found["version"], int(tp.group(1)) if tp else 1
