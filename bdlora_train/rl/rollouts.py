"""GRPO rollouts in a running `vllm serve`, the adapter synced to it as an adapter after every optimizer step.

`ServerRollouts` is a TRL `rollout_func` (`GRPOTrainer(rollout_func=...)`, called with the step's prompts and the
trainer). On each call it
1. syncs: when the trainer has taken a step since the last sync, writes the adapter once, atomically, into
   `<output_dir>/rollout-adapters/v<step>` (only the adapter's tensors: MBs, never the base's GBs), loads it into the
   server under a new versioned name (`<run>-<nonce>-v<step>`) and unloads and deletes every version no request can
   still use;
2. generates: the prompts' token ids go to `/v1/completions` under that name, `num_generations` samples each;
3. checks: the trainer's log-probabilities of the sampled tokens under the adapter version they were sampled under
   (a forward of the policy on prompt + completion, fp32 log-softmax of the unscaled logits: vLLM's raw log-probs)
   are compared with the server's; the largest and the mean difference are recorded for the step. Past the run's
   rule (rl/logprob_gap.py: by the dtype, or the recipe's `rollout_max_logprob_diff`) the step is refused: the
   server did not generate with that adapter (a stale, skipped or failed sync), and training on those samples would
   be off-policy without anyone knowing.

Asynchronous (`max_staleness: K` > 0): the server samples the next K steps' prompts (rl/lookahead.py predicts them
and each is used only once the step's real prompts equal it) while the trainer trains, each under the adapter of the
step that sent it: a step trains on completions K versions old, and the importance-sampling ratios of TRL's
`vllm_importance_sampling_*` (objectives/grpo.py) correct for it. At most K + 1 versions are loaded. The check runs
under the version that sampled: the trainer keeps each version's adapter parameters (MBs) while a request uses it,
and copies them in for the check's forward. The first step of a run (and of a resumed run) samples synchronously;
a prediction that missed is dropped and the step samples synchronously too.

No merge, no full-weight transfer, no NCCL communicator (TRL's vLLM modes merge the adapter into the base and
broadcast every weight): this runs on a CPU, and the server's ranks each compute only their own blocks (the plugin).

Under N training processes (DDP, ZeRO, FSDP, TP; rl/ranks.py) every process calls it with its own prompts, as TRL
does: the adapter is written collectively (a TP run's blocks and a ZeRO-3 partition gathered, never more than the
adapter) and the main process alone loads it, once per version, while the others wait for it before sampling. Each
data-parallel rank samples under a seed of its own (the ranks of a TP group share one request and its completions),
and each checks its own completions' log-prob gap; the step records the largest over ranks. A failure on any rank
stops every rank at the same step, so the checkpoint kept after it is the same for all.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import shutil
import time
from collections import deque
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import torch

from bdlora_train.core.errors import BlockDiagLoraError, RolloutError
from bdlora_train.rl.logprob_gap import Gap, GapRule, gap
from bdlora_train.rl.lookahead import InFlight, PromptStream, in_background
from bdlora_train.rl.ranks import Ranks
from bdlora_train.rl.server_check import lora_slots

ADAPTERS_DIR = "rollout-adapters"


def group_prompts(prompts: list) -> list[tuple[object, int]]:
    """Consecutive equal prompts as (prompt, count): TRL's sampler repeats each prompt `num_generations` times in a
    row, and the server samples `count` completions of one prompt in one request."""
    groups: list[tuple[object, int]] = []
    for prompt in prompts:
        if groups and groups[-1][0] == prompt:
            groups[-1] = (prompt, groups[-1][1] + 1)
        else:
            groups.append((prompt, 1))
    return groups


def sampled_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], temperature: float = 1.0,
                     batch_size: int = 16) -> tuple[list[list[float]], list[list[float]]]:
    """The model's log-probability of each completion token given its prompt and the completion before it, from one
    forward: (raw, at `temperature`). Raw: fp32 log-softmax of the unscaled logits (what vLLM returns by default, its
    raw log-probs, whatever the sampling temperature). At `temperature`: the log-softmax of the logits divided by it,
    the distribution the server samples from (top-k and top-p aside) and the one TRL scores the trainer's policy at;
    at temperature 1 the raw list itself."""
    was_training = model.training
    model.eval()  # no dropout: the same function the server computes
    raw: list[list[float]] = []
    scaled: list[list[float]] = []
    device = next(p.device for p in model.parameters())
    try:
        with torch.no_grad():
            for start in range(0, len(prompt_ids), batch_size):
                prompts, completions = prompt_ids[start:start + batch_size], completion_ids[start:start + batch_size]
                seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
                width = max(len(s) for s in seqs)
                ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
                mask = torch.zeros_like(ids)
                for i, seq in enumerate(seqs):  # right-padded: a causal model's earlier positions do not see it
                    ids[i, :len(seq)] = torch.tensor(seq, device=device)
                    mask[i, :len(seq)] = 1
                logits = model(input_ids=ids, attention_mask=mask).logits.float()[:, :-1]
                logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
                at_t = None if temperature == 1.0 else (
                    torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1))
                for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
                    span = slice(len(p) - 1, len(p) - 1 + len(c))
                    raw.append(logp[i, span].tolist())
                    if at_t is not None:
                        scaled.append(at_t[i, span].tolist())
    finally:
        model.train(was_training)
    return raw, (raw if temperature == 1.0 else scaled)


class ServerRollouts:
    """TRL's `rollout_func` for a running `vllm serve` (see the module docstring). `save(dir)` writes the trainer's
    adapter into `dir` (PEFT format); `tokenize(prompts)` gives their token ids as the trainer feeds them; `rule`:
    how far the server's log-probs may be from the trainer's (rl/logprob_gap.py); `max_staleness` and `stream`: the
    asynchronous mode's bound and the prompts of the steps to come (rl/lookahead.py)."""

    def __init__(self, server, save: Callable[[Path], None], tokenize: Callable[[list], list[list[int]]],
                 output_dir: Path, run_name: str, rule: GapRule, ranks: Ranks | None = None, policy=None,
                 max_staleness: int = 0, stream: PromptStream | None = None):
        self.server, self.save, self.tokenize, self.rule = server, save, tokenize, rule
        # policy(trainer): a context manager giving the model to score the completions with (the trainer's unwrapped
        # model by default; objectives/grpo.py passes TRL's, which gathers a ZeRO-3 partition for the forward)
        self.policy = policy or (lambda t: contextlib.nullcontext(t.accelerator.unwrap_model(t.model)))
        self.ranks = ranks or Ranks()
        self.max_staleness, self.stream = max_staleness, stream
        self.slots = lora_slots(max_staleness)
        self.root = Path(output_dir) / ADAPTERS_DIR
        # a new nonce per launch (the main process's, on every rank): a resumed run never reuses a name an earlier
        # process loaded with other weights
        self.prefix = f"{run_name}-{self.ranks.main_value(secrets.randbelow(16**6)):06x}"
        self.loaded: dict[int, str] = {}  # version (the step whose adapter it is) -> its name on the server
        self.inflight: deque[InFlight] = deque()  # requests sent ahead, for the calls to come, in order
        self.missed = False  # the trainer's data order was not predicted at least once (lost_order warned)
        self.weights: dict[int, dict] = {}  # version -> the adapter's parameters then (asynchronous mode)
        # per generation: {"step", "version" (the adapter the completions were sampled under), "lag" (step -
        # version), "max_abs_logprob_diff" / "mean_abs_logprob_diff" (server vs trainer under that version),
        # "completions", "tokens", "rollout_seconds" (waiting for the server's answer), "check_seconds" (the
        # trainer's forward for its log-probs); with importance sampling, "importance_sampling" (objectives/grpo.py)}
        self.diffs: list[dict] = []
        self.syncs: list[dict] = []  # {"step", "bytes" (the adapter's files), "seconds" (write, load, unload)}
        self.start: Callable[[], None] | None = None  # the checks to run at the first call (objectives/grpo.py)

    def clear_stale(self) -> list[str]:
        """Before the first step: unload what earlier processes of this run left on the server (a killed trainer
        leaves its last versions loaded); the first call then serves the adapter the run starts from (after a
        resume, its checkpoint's). Returns the names unloaded."""
        run = self.prefix.rsplit("-", 1)[0] + "-"
        stale = sorted(n for n in self.server.served_adapters() if n.startswith(run))
        for name in stale:
            self.server.unload(name)
        return stale

    def name(self, step: int) -> str:
        return f"{self.prefix}-v{step}"

    def write(self, step: int) -> Path:
        """The adapter of `step`, written once into its version directory (staged, then renamed). Every rank calls
        `save` (a sharded or partitioned adapter is gathered collectively); the main process writes."""
        final, staging = self.root / f"v{step}", self.root / f".tmp-v{step}"
        if self.ranks.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            for path in (final, staging):
                if path.exists():
                    shutil.rmtree(path)  # ours: a version directory a killed process of this run left behind
        self.save(staging)
        if self.ranks.is_main:
            staging.rename(final)
        return final

    def sync(self, step: int) -> str:
        """Make the server hold the adapter of `step` under its versioned name, and no version that neither it nor a
        request in flight samples under (deleted once unloaded). The new version loads before the old ones unload
        when a slot is free for it. The main process talks to the server; every rank returns once it did (or raises
        if it failed)."""
        if step in self.loaded:
            return self.loaded[step]
        start = time.perf_counter()
        path = self.write(step)
        name = self.name(step)
        needed = {request.version for request in self.inflight} | {step}
        stale = [v for v in self.loaded if v not in needed]
        first = stale if len(self.loaded) + 1 > self.slots else []
        self.together(lambda: self._load(name, path, first, stale) if self.ranks.is_main else None)
        for version in stale:
            del self.loaded[version]
            self.weights.pop(version, None)
        self.loaded[step] = name
        if self.ranks.is_main:
            moved = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            self.syncs.append({"step": step, "bytes": moved, "seconds": round(time.perf_counter() - start, 4)})
        return name

    def _load(self, name: str, path: Path, first: list[int], stale: list[int]) -> None:
        for version in first:
            self._unload(version)
        self.server.load(name, path)
        if name not in self.server.served_adapters():
            raise RolloutError(f"rollout server {self.server.url}: loaded adapter {name} is not listed by /v1/models; "
                               "the sync did not take effect")
        for version in stale:
            if version not in first:
                self._unload(version)

    def _unload(self, version: int) -> None:
        self.server.unload(self.loaded[version])
        shutil.rmtree(self.root / f"v{version}", ignore_errors=True)

    def together(self, work: Callable[[], object]):
        """`work()` on this rank; if it failed on any rank, every rank raises (collective: each rank calls it at the
        same point), the failing one its own error, the others a line that points to it."""
        error, result = None, None
        try:
            result = work()
        except BlockDiagLoraError as err:  # the toolkit's one-line errors; anything else is a bug and ends the run
            error = err
        if self.ranks.any(error is not None):
            raise error or RolloutError(
                f"rollout server {self.server.url}: another training process's rollouts failed (its error is above); "
                "nothing was trained on this step, the last checkpoint is kept"
            )
        return result

    def __call__(self, prompts: list, trainer) -> dict:
        if self.start is not None:
            start, self.start = self.start, None
            start()
        step = trainer.state.global_step
        name = self.sync(step)
        if self.max_staleness and step not in self.weights:
            with self.policy(trainer) as model:
                self.weights[step] = adapter_weights(model)
        ahead = self.take_ahead(prompts, step, trainer)
        version = step if ahead is None else ahead.version
        groups = group_prompts(prompts)
        unique_ids = self.tokenize([p for p, _ in groups])
        start = time.perf_counter()
        if ahead is not None:
            samples = self.together(lambda: ahead.answer.result() if self.ranks.asks else None)
        else:
            samples = self.together(lambda: self._samples(name, unique_ids, groups, trainer.args, step)
                                    if self.ranks.asks else None)
        rollout_s = time.perf_counter() - start
        completion_ids = server_lp = None
        if samples is not None:
            completion_ids, server_lp = [ids for ids, _ in samples], [lps for _, lps in samples]
        completion_ids, server_lp = self.ranks.share_samples(completion_ids, server_lp)  # a TP group's, on each rank
        prompt_ids = [ids for ids, (_, count) in zip(unique_ids, groups, strict=True) for _ in range(count)]
        start = time.perf_counter()
        with self.policy(trainer) as model, self.weights_of(model, version, step):  # TP: every rank, together
            trainer_lp, trainer_at_t = sampled_logprobs(model, prompt_ids, completion_ids, trainer.args.temperature)
        check_s = time.perf_counter() - start
        local = gap(server_lp, trainer_lp)
        # every rank's completions, this rank's included: the largest gap and the largest rank's mean
        found = Gap(self.ranks.max(local.max), self.ranks.max(local.mean), local.tokens)
        self.diffs.append({"step": step, "version": version, "lag": step - version,
                           "max_abs_logprob_diff": found.max, "mean_abs_logprob_diff": found.mean,
                           "completions": len(completion_ids), "tokens": local.tokens,
                           "rollout_seconds": round(rollout_s, 4), "check_seconds": round(check_s, 4)})
        metrics = trainer._metrics["train"]  # TRL's per-log-step metric store
        metrics["rollout/max_abs_logprob_diff"].append(found.max)
        metrics["rollout/version_lag"].append(step - version)
        if not self.rule.holds(found):
            raise RolloutError(
                f"rollout server {self.server.url}: at step {step} its log-probs of the sampled tokens differ from the "
                f"trainer's under adapter {self.name(version)} (version {version}): {self.rule.describe(found)}: the "
                "server did not generate with that adapter (a stale or failed sync, or another base or dtype); "
                "nothing was trained on these samples, the last checkpoint is kept"
            )
        if self.max_staleness:
            self.send_ahead(prompts, step, name, trainer)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
                "logprobs": behaviour_logprobs(server_lp, trainer_lp, trainer_at_t)}

    def take_ahead(self, prompts: list, step: int, trainer) -> InFlight | None:
        """The request sent ahead for this call, if every rank's was for these prompts and under a version at most
        `max_staleness` old (collective); otherwise None, and every request in flight is dropped (they followed a
        prediction that failed: `lost_order`)."""
        if not self.max_staleness:
            return None
        ahead = self.inflight.popleft() if self.inflight else None
        fits = ahead is not None and ahead.prompts == prompts and step - ahead.version <= self.max_staleness
        if not self.ranks.any(not fits):
            return ahead
        if self.ranks.any(ahead is not None):
            self.lost_order(trainer, step, "the prompts sampled ahead for this step were not its prompts")
        # their answers are never read; the versions they sample under unload at the next sync, once they are done
        dropped = [r.answer for r in (ahead, *self.inflight) if r is not None and r.answer is not None]
        futures.wait(dropped)
        self.inflight.clear()
        return None

    def lost_order(self, trainer, step: int, what: str) -> None:
        """The first time in a run the prompts of the steps to come were not predicted: a warning
        (`trainer.warn`). Nothing but a data order the stream cannot repeat does it, and from then on steps may keep
        sampling synchronously."""
        if not self.missed:
            self.missed = True
            trainer.warn(step, (
                f"max_staleness {self.max_staleness}: {what}: the trainer's data order is not the one a second pass "
                "over its get_train_dataloader() yields (a sampler or dataloader of your own that is not seeded?); "
                "where that happens a step samples synchronously and loses the overlap (lag 0 in metrics.json's "
                "rollout.steps)"))

    def send_ahead(self, prompts: list, step: int, name: str, trainer) -> None:
        """Keep `max_staleness` requests in flight (none for a step at or past the run's max_steps): for each call
        to come that has none, its prompts (the stream's prediction) sent now under this step's adapter, with the
        seed block of the step that will use them. Every rank predicts; where any rank cannot, none sends
        (collective)."""
        args = trainer.args
        depth = min(self.max_staleness, trainer.state.max_steps - step - 1)
        upcoming = self.stream.upcoming(prompts, depth) if self.stream is not None else None
        if self.ranks.any(upcoming is None or len(upcoming) < depth):
            if depth > 0 and self.ranks.any(self.stream is not None and self.stream.lost):
                self.lost_order(trainer, step, "the prompts of the steps after this one could not be predicted")
            return
        for offset in range(len(self.inflight), depth):
            ahead = upcoming[offset]
            groups = group_prompts(ahead)
            answer = None
            if self.ranks.asks:
                ids = self.tokenize([p for p, _ in groups])
                answer = in_background(functools.partial(self._samples, name, ids, groups, args, step + 1 + offset))
            self.inflight.append(InFlight(ahead, step, answer))

    @contextlib.contextmanager
    def weights_of(self, model, version: int, step: int):
        """The model with the adapter of `version` for the duration (its saved parameters copied in, this step's
        copied back after); as it is when `version` is this step's."""
        if version == step:
            yield model
            return
        then, now = self.weights[version], self.weights[step]
        params = [(p, then[n], now[n]) for n, p in model.named_parameters() if n in then]
        with torch.no_grad():
            for param, old, _ in params:
                param.copy_(old)
        try:
            yield model
        finally:
            with torch.no_grad():
                for param, _, current in params:
                    param.copy_(current)

    def _samples(self, name: str, unique_ids: list[list[int]], groups: list, args, step: int) -> list:
        """(token ids, the server's log-probs) of each completion, `count` per prompt in the prompts' order."""
        counts = {count for _, count in groups}
        sampling = self._sampling(args, step, sum(count for _, count in groups))
        if len(counts) != 1:  # one request size per call; a group split over processes leaves a part on each
            answers = [self.server.complete(name, [ids], n=count, **sampling)[0]
                       for ids, (_, count) in zip(unique_ids, groups, strict=True)]
        else:
            answers = self.server.complete(name, unique_ids, n=counts.pop(), **sampling)
        samples = []
        for (_, count), completions in zip(groups, answers, strict=True):
            if len(completions) != count:
                raise RolloutError(f"rollout server {self.server.url}: asked {count} completions of one prompt, got "
                                   f"{len(completions)}")
            samples += [(c.token_ids, c.logprobs) for c in completions]
        return samples

    def _sampling(self, args, step: int, samples: int) -> dict:
        """GRPOConfig's sampling settings as the server takes them, and the first seed of this call's `samples`
        completions: the server gives them consecutive seeds (rl/server_sampling.py), so each (step, sampling rank)
        gets a block of its own; reproducible, and no two completions of a run share a seed."""
        return {
            "max_tokens": args.max_completion_length,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k if args.top_k and args.top_k > 0 else None,
            "seed": args.seed + (step * self.ranks.samplers + self.ranks.sampler) * samples,
        }

    def close(self) -> None:
        """Unload every version the server holds and delete the rollout adapters (the final adapter is in adapter/);
        requests still in flight are left to end (their answers are never read). The main process alone, with no
        collective: a rank that stops on an error must not wait for the others here."""
        self.inflight.clear()
        if self.ranks.is_main:
            for name in self.loaded.values():
                try:
                    self.server.unload(name)
                except RolloutError:
                    pass  # a server that is gone holds nothing
            shutil.rmtree(self.root, ignore_errors=True)
        self.loaded.clear()
        self.weights.clear()


def behaviour_logprobs(server_raw: list[list[float]], trainer_raw: list[list[float]],
                       trainer_at_t: list[list[float]]) -> list[list[float]]:
    """The sampling policy's log-prob of each token at the sampling temperature, for TRL's importance-sampling ratio
    (it divides the trainer's logits by the temperature): the server's raw one plus what the temperature changes in
    it, measured on the trainer's forward under the version that sampled (trainer_at_t - trainer_raw).
    The server cannot return both: vLLM's `--logprobs-mode` is one per engine, and the exactness check needs raw
    (rl/server_check.py); TRL's own server runs processed log-probs instead and has no such check. At temperature 1
    the two trainer terms are one computation and this is the server's raw log-probs, bit for bit; at any
    temperature the server-vs-trainer difference the ratio corrects for (another engine's rounding, a version
    behind) is kept as it is."""
    return [[s + (t - r) for s, r, t in zip(srv, raw, at, strict=True)]
            for srv, raw, at in zip(server_raw, trainer_raw, trainer_at_t, strict=True)]


def adapter_weights(model) -> dict:
    """A copy of the model's trainable parameters (the adapter's; a TP or FSDP run's local shards as they are)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
