"""The rollout server as an RL run uses it: a stock `vllm serve` (any TP degree, the bdlora plugin loaded through
vLLM's general_plugins entry point) that loads each version of the run's adapter at run time and samples
completions. `RolloutServer` composes the parts, each in a module of its own: the HTTP client (engine_client.py),
the checks before the first step (server_check.py), the adapters it serves (server_adapters.py) and sampling
(server_sampling.py). Every failure is a `RolloutError` of one line naming the URL, the value and the fix.
"""

from __future__ import annotations

from pathlib import Path

from bdlora_train.rl.engine_client import EngineClient
from bdlora_train.rl.logprob_gap import GapRule
from bdlora_train.rl.server_adapters import ServerAdapters
from bdlora_train.rl.server_check import MIN_LORAS, ServerCheck, ServerPreflight, start_hint
from bdlora_train.rl.server_sampling import Completion, ServerSampling

__all__ = ["Completion", "RolloutServer", "ServerCheck"]


class RolloutServer:
    """A running `vllm serve` at `url` (http://host:port). `start_command`: the command that starts it as the run
    needs it (printed in the messages that say to start or restart it). `timeout_s`: the longest wait for one
    answer (a completion request answers when all its samples are done)."""

    def __init__(self, url: str, start_command: str | None = None, timeout_s: float = 600.0):
        self.client = EngineClient(url, timeout_s)
        self.preflight = ServerPreflight(self.client)
        self.adapters = ServerAdapters(self.client)
        self.sampling = ServerSampling(self.client, self.adapters)
        self.start_command = start_command
        self.checked: ServerCheck | None = None

    @property
    def url(self) -> str:
        return self.client.url

    def check(self, *, base_model: str, probe_ids: list[int], probe_logprobs: list[float], adapter_dir: Path,
              adapter_name: str, rule: GapRule, slots: int = MIN_LORAS) -> ServerCheck:
        """Every refusal the server can give before the first step (`ServerPreflight.run`), then the run's initial
        adapter `adapter_dir` refused (its rank above --max-lora-rank, nblocks the TP degree cannot cut, ...). The
        base comes before the adapter: an adapter on another base fails to load for reasons that do not say so. On
        success `adapter_dir` is loaded as `adapter_name`; returns (and keeps in `self.checked`) what was
        measured. `rule`: how far the probe's log-probs may be from the trainer's (rl/logprob_gap.py); `slots`: the
        --max-loras the run needs (server_check.lora_slots)."""
        start = self.start_command or start_hint(base_model, adapter_dir, slots)
        self.checked = self.preflight.run(base_model=base_model, probe_ids=probe_ids, probe_logprobs=probe_logprobs,
                                          rule=rule, start=start, slots=slots)
        self.adapters.load(adapter_name, Path(adapter_dir), start, checking=True, tp=self.checked.tp)
        return self.checked

    def load(self, name: str, path: Path) -> None:
        """Load the PEFT adapter directory `path` (as the server's filesystem holds it) under `name`."""
        tp = self.checked.tp if self.checked is not None else None
        self.adapters.load(name, Path(path), self.restart_hint(), checking=False, tp=tp)

    def unload(self, name: str) -> None:
        self.adapters.unload(name, self.restart_hint())

    def served_adapters(self) -> set[str]:
        """The adapters the server serves: the ids of /v1/models with a parent (the base)."""
        return self.adapters.served(self.restart_hint())

    def complete(self, model: str, prompts: list[list[int]], *, n: int, max_tokens: int, temperature: float,
                 top_p: float = 1.0, top_k: int | None = None, seed: int | None = None,
                 stop_token_ids: list[int] | None = None) -> list[list[Completion]]:
        """`n` completions of each prompt (token ids) under `model`, one list per prompt (`ServerSampling`)."""
        return self.sampling.complete(model, prompts, n=n, max_tokens=max_tokens, temperature=temperature,
                                      top_p=top_p, top_k=top_k, seed=seed, stop_token_ids=stop_token_ids,
                                      start=self.restart_hint())

    def restart_hint(self) -> str:
        return self.start_command or "the same `vllm serve` command"
