"""GRPO rollouts in a running `vllm serve`, the adapter synced to it as an adapter after every optimizer step.

`ServerRollouts` is a TRL `rollout_func` (`GRPOTrainer(rollout_func=...)`, called with the step's prompts and the
trainer). On each call it
1. syncs: when the trainer has taken a step since the last sync, writes the adapter once, atomically, into
   `<output_dir>/rollout-adapters/v<step>` (only the adapter's tensors: MBs, never the base's GBs), loads it into the
   server under a new versioned name (`<run>-<nonce>-v<step>`) and unloads and deletes the version before it, which
   no request can still use (GRPO here is synchronous: every request of a step is answered before the next sync);
2. generates: the prompts' token ids go to `/v1/completions` under that name, `num_generations` samples each;
3. checks: the trainer's log-probabilities of the sampled tokens under the same adapter (a forward of the policy on
   prompt + completion, fp32 log-softmax of the unscaled logits: vLLM's raw log-probs) are compared with the
   server's, and the largest difference is recorded for the step. Above the recipe's `rollout_max_logprob_diff`
   the step is refused: the server did not generate with the adapter the trainer has (a stale, skipped or failed
   sync), and training on those samples would be off-policy without anyone knowing.

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
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bdlora_train.core.errors import BlockDiagLoraError, RolloutError
from bdlora_train.rl.ranks import Ranks

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


def sampled_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                     batch_size: int = 16) -> list[list[float]]:
    """The model's log-probability of each completion token given its prompt and the completion before it: fp32
    log-softmax of the unscaled logits (temperature 1: what vLLM returns by default, its raw log-probs)."""
    was_training = model.training
    model.eval()  # no dropout: the same function the server computes
    out: list[list[float]] = []
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
                logits = model(input_ids=ids, attention_mask=mask).logits.float()
                logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
                for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
                    out.append(logp[i, len(p) - 1:len(p) - 1 + len(c)].tolist())
    finally:
        model.train(was_training)
    return out


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """The largest |a - b| over every token of every completion (0 for no tokens)."""
    diffs = [abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    return max(diffs, default=0.0)


class ServerRollouts:
    """TRL's `rollout_func` for a running `vllm serve` (see the module docstring). `save(dir)` writes the trainer's
    adapter into `dir` (PEFT format); `tokenize(prompts)` gives their token ids as the trainer feeds them."""

    def __init__(self, server, save: Callable[[Path], None], tokenize: Callable[[list], list[list[int]]],
                 output_dir: Path, run_name: str, tol: float, ranks: Ranks | None = None, policy=None):
        self.server, self.save, self.tokenize, self.tol = server, save, tokenize, tol
        # policy(trainer): a context manager giving the model to score the completions with (the trainer's unwrapped
        # model by default; objectives/grpo.py passes TRL's, which gathers a ZeRO-3 partition for the forward)
        self.policy = policy or (lambda t: contextlib.nullcontext(t.accelerator.unwrap_model(t.model)))
        self.ranks = ranks or Ranks()
        self.root = Path(output_dir) / ADAPTERS_DIR
        # a new nonce per launch (the main process's, on every rank): a resumed run never reuses a name an earlier
        # process loaded with other weights
        self.prefix = f"{run_name}-{self.ranks.main_value(secrets.randbelow(16**6)):06x}"
        self.version: int | None = None  # the step whose adapter the server holds
        self.served: str | None = None
        # per generation: {"step", "max_abs_logprob_diff", "completions", "tokens", "rollout_seconds" (the server's
        # answer), "check_seconds" (the trainer's forward for its log-probs)}
        self.diffs: list[dict] = []
        self.syncs: list[dict] = []  # {"step", "bytes" (the adapter's files), "seconds" (write, load, unload)}
        self.start: Callable[[], None] | None = None  # the checks to run at the first call (objectives/grpo.py)

    def clear_stale(self) -> list[str]:
        """Before the first step: unload what earlier processes of this run left on the server (a killed trainer
        leaves its last version loaded); the first call then serves the adapter the run starts from (after a
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
        """Make the server hold the adapter of `step` under its versioned name; unload and delete the old one. The
        main process talks to the server; every rank returns once it did (or raises if it failed)."""
        if self.version == step:
            return self.served
        start = time.perf_counter()
        path = self.write(step)
        name = self.name(step)
        self.together(lambda: self._load(name, path) if self.ranks.is_main else None)
        old_version, self.served, self.version = self.version, name, step
        if self.ranks.is_main:
            moved = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            self.syncs.append({"step": step, "bytes": moved, "seconds": round(time.perf_counter() - start, 4)})
            if old_version is not None:
                shutil.rmtree(self.root / f"v{old_version}", ignore_errors=True)
        return name

    def _load(self, name: str, path: Path) -> None:
        old = self.served
        self.server.load(name, path)
        if name not in self.server.served_adapters():
            raise RolloutError(f"rollout server {self.server.url}: loaded adapter {name} is not listed by /v1/models; "
                               "the sync did not take effect")
        if old is not None:
            self.server.unload(old)

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
        groups = group_prompts(prompts)
        unique_ids = self.tokenize([p for p, _ in groups])
        start = time.perf_counter()
        samples = self.together(lambda: self._samples(name, unique_ids, groups, trainer.args, step)
                                if self.ranks.asks else None)
        rollout_s = time.perf_counter() - start
        completion_ids = server_lp = None
        if samples is not None:
            completion_ids, server_lp = [ids for ids, _ in samples], [lps for _, lps in samples]
        completion_ids, server_lp = self.ranks.share_samples(completion_ids, server_lp)  # a TP group's, on each rank
        prompt_ids = [ids for ids, (_, count) in zip(unique_ids, groups, strict=True) for _ in range(count)]
        start = time.perf_counter()
        with self.policy(trainer) as model:  # under TP every rank of the group runs it, together
            trainer_lp = sampled_logprobs(model, prompt_ids, completion_ids)
        check_s = time.perf_counter() - start
        diff = self.ranks.max(max_abs_diff(server_lp, trainer_lp))  # every rank's completions, this rank's included
        tokens = sum(len(c) for c in completion_ids)
        self.diffs.append({"step": step, "max_abs_logprob_diff": diff, "completions": len(completion_ids),
                           "tokens": tokens, "rollout_seconds": round(rollout_s, 4),
                           "check_seconds": round(check_s, 4)})
        trainer._metrics["train"]["rollout/max_abs_logprob_diff"].append(diff)  # TRL's per-log-step metric store
        if not diff <= self.tol:  # NaN refused too
            raise RolloutError(
                f"rollout server {self.server.url}: at step {step} its log-probs of the sampled tokens differ from the "
                f"trainer's by {diff:.2e} > rollout_max_logprob_diff={self.tol:g} under adapter {name}: the server "
                "did not generate with the trainer's adapter (a stale or failed sync, or another base or dtype); "
                "nothing was trained on these samples, the last checkpoint is kept"
            )
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": server_lp}

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
        """Unload the served version and delete the rollout adapters (the final adapter is in adapter/). The main
        process alone, with no collective: a rank that stops on an error must not wait for the others here."""
        if not self.ranks.is_main:
            self.served = self.version = None
            return
        if self.served is not None:
            try:
                self.server.unload(self.served)
            except RolloutError:
                pass  # a server that is gone holds nothing
            self.served = self.version = None
        shutil.rmtree(self.root, ignore_errors=True)
