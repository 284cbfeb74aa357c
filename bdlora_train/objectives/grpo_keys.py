"""The recipe's rollouts section, read by `objective: grpo` (objectives/grpo.py checks it with the rest of the
recipe): the rewards, and where the rollouts are sampled. No TRL import: `bdlora train --help` reads it."""

from __future__ import annotations

from dataclasses import dataclass

from bdlora_train.core.keys import check_fields, key


@dataclass
class RolloutKeys:
    """The recipe's rollouts section: the rewards, and where the rollouts are sampled (objective: grpo)."""

    rewards: list = key(
        [],
        "objective=grpo: reward functions, each a built-in (exact_match) or module:function (TRL's signature), or "
        "{name: ..., weight: ...}; empty: the task's exact_match (task:arithmetic, task:analogies)",
    )
    rollout_server: str | None = key(
        None,
        "objective=grpo: URL of a running `vllm serve` (--enable-lora, the plugin) that generates the rollouts, the "
        "adapter synced to it after every step; null: the trainer generates",
    )
    rollout_max_logprob_diff: float | None = key(
        None,
        "objective=grpo with rollout_server: refuse a step whose server log-probs of a sampled token differ from the "
        "trainer's under the same adapter version by more (nats); null: the rule for torch_dtype (float32: 1e-3 on "
        "every token; bfloat16 / float16: 0.1 / 0.0125 on the mean over the step's tokens; docs/rl.md)",
        low=1e-12,
    )
    max_staleness: int = key(
        0,
        "objective=grpo with rollout_server: how many adapter versions old a step's rollouts may be; K > 0 samples "
        "the next K steps' prompts while the trainer trains (TRL's AsyncGRPOTrainer's name); 0: synchronous",
        low=0,
    )

    def check(self) -> None:
        check_fields(self)
