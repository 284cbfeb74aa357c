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
"""

from __future__ import annotations

import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bdlora_train.core.errors import RolloutError

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
                 output_dir: Path, run_name: str, tol: float):
        self.server, self.save, self.tokenize, self.tol = server, save, tokenize, tol
        self.root = Path(output_dir) / ADAPTERS_DIR
        # a new nonce per process: a resumed run never reuses a name an earlier process loaded with other weights
        self.prefix = f"{run_name}-{secrets.token_hex(3)}"
        self.version: int | None = None  # the step whose adapter the server holds
        self.served: str | None = None
        # per generation: {"step", "max_abs_logprob_diff", "completions", "tokens", "rollout_seconds" (the server's
        # answer), "check_seconds" (the trainer's forward for its log-probs)}
        self.diffs: list[dict] = []
        self.syncs: list[dict] = []  # {"step", "bytes" (the adapter's files), "seconds" (write, load, unload)}

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
        """The adapter of `step`, written once into its version directory (staged, then renamed)."""
        self.root.mkdir(parents=True, exist_ok=True)
        final, staging = self.root / f"v{step}", self.root / f".tmp-v{step}"
        for path in (final, staging):
            if path.exists():
                shutil.rmtree(path)  # ours: a version directory a killed process of this run left behind
        self.save(staging)
        staging.rename(final)
        return final

    def sync(self, step: int) -> str:
        """Make the server hold the adapter of `step` under its versioned name; unload and delete the old one."""
        if self.version == step:
            return self.served
        old, old_version = self.served, self.version
        name = self.name(step)
        start = time.perf_counter()
        path = self.write(step)
        self.server.load(name, path)
        if name not in self.server.served_adapters():
            raise RolloutError(f"rollout server {self.server.url}: loaded adapter {name} is not listed by /v1/models; "
                               "the sync did not take effect")
        self.served, self.version = name, step
        if old is not None:
            self.server.unload(old)
            shutil.rmtree(self.root / f"v{old_version}", ignore_errors=True)
        moved = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        self.syncs.append({"step": step, "bytes": moved, "seconds": round(time.perf_counter() - start, 4)})
        return name

    def __call__(self, prompts: list, trainer) -> dict:
        step = trainer.state.global_step
        name = self.sync(step)
        args = trainer.args
        groups = group_prompts(prompts)
        unique_ids = self.tokenize([p for p, _ in groups])
        samples = []
        start = time.perf_counter()
        answers = self._answers(name, unique_ids, groups, args, step)
        rollout_s = time.perf_counter() - start
        for ids, (_, count), completions in zip(unique_ids, groups, answers, strict=True):
            if len(completions) != count:
                raise RolloutError(f"rollout server {self.server.url}: asked {count} completions of one prompt, got "
                                   f"{len(completions)}")
            samples += [(ids, c) for c in completions]
        prompt_ids = [ids for ids, _ in samples]
        completion_ids = [c.token_ids for _, c in samples]
        server_lp = [c.logprobs for _, c in samples]
        model = trainer.accelerator.unwrap_model(trainer.model)
        start = time.perf_counter()
        trainer_lp = sampled_logprobs(model, prompt_ids, completion_ids)
        check_s = time.perf_counter() - start
        diff = max_abs_diff(server_lp, trainer_lp)
        tokens = sum(len(c) for c in completion_ids)
        self.diffs.append({"step": step, "max_abs_logprob_diff": diff, "completions": len(samples), "tokens": tokens,
                           "rollout_seconds": round(rollout_s, 4), "check_seconds": round(check_s, 4)})
        trainer._metrics["train"]["rollout/max_abs_logprob_diff"].append(diff)  # TRL's per-log-step metric store
        if not diff <= self.tol:  # NaN refused too
            raise RolloutError(
                f"rollout server {self.server.url}: at step {step} its log-probs of the sampled tokens differ from the "
                f"trainer's by {diff:.2e} > rollout_max_logprob_diff={self.tol:g} under adapter {name}: the server "
                "did not generate with the trainer's adapter (a stale or failed sync, or another base or dtype); "
                "nothing was trained on these samples, the last checkpoint is kept"
            )
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": server_lp}

    def _answers(self, name: str, unique_ids: list[list[int]], groups: list, args, step: int):
        counts = {count for _, count in groups}
        if len(counts) != 1:  # one request size per call; TRL's sampler gives every prompt num_generations
            return [self.server.complete(name, [ids], n=count, **self._sampling(args, step))[0]
                    for ids, (_, count) in zip(unique_ids, groups, strict=True)]
        return self.server.complete(name, unique_ids, n=counts.pop(), **self._sampling(args, step))

    @staticmethod
    def _sampling(args, step: int) -> dict:
        """GRPOConfig's sampling settings as the server takes them; a seed per step (reproducible, not repeated)."""
        return {
            "max_tokens": args.max_completion_length,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k if args.top_k and args.top_k > 0 else None,
            "seed": args.seed + step,
        }

    def close(self) -> None:
        """Unload the served version and delete the rollout adapters (the final adapter is in adapter/)."""
        if self.served is not None:
            try:
                self.server.unload(self.served)
            except RolloutError:
                pass  # a server that is gone holds nothing
            self.served = self.version = None
        shutil.rmtree(self.root, ignore_errors=True)
