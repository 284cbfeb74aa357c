"""How far the rollout server's log-probs of the sampled tokens may be from the trainer's under the same adapter
version before a step is refused: evidence that the server sampled with another adapter (a stale, skipped or
failed sync), not the rounding of the dtype the two sides compute in. docs/rl.md, "Exactness, checked every step".

- float32 (and float64) on both sides: every token within 1e-3 nats (`max`). The two sides round differently
  (other kernels, other summation orders) but keep 24 significant bits; the embedded model measured at most
  1.1e-04 against the server at TP 1 in 180 steps (eval/bench/rl_async_cpu.md), 3.6e-05 at TP 3: 1e-3 leaves a
  factor of 9.
- a 16-bit dtype: the mean over the step's tokens (`mean`). bfloat16 keeps 8 significant bits (unit roundoff
  u = 2^-8 = 0.0039, against 2^-24 for float32): every activation the server stores is off by up to u relative, the
  errors of the L layers add up in the residual stream, and a log-prob, a difference of logits of size 10 or more,
  inherits them. Published bf16 serving against fp32 training: a mean gap of 0.022 nats and a max of 0.477 over a
  step's tokens on an MoE (SkyRL issue #2182): the max over thousands of tokens grows with their count and their
  tail, so no max bound tells rounding from a wrong adapter; the mean does. The bound is 0.1 nats for bfloat16
  (4.5x that published mean), scaled by u for float16 (8x finer: 0.0125). A wrong adapter moves the tokens it
  learned by nats, not hundredths: the embedded model's GRPO run ends 1.26 nats per token (its KL) from its base.
  Below the bound is what 16-bit serving cannot tell apart: an adapter one small step away.
A recipe's `rollout_max_logprob_diff` replaces the rule with a bound on the max, for any dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOAT32_MAX = 1e-3
BFLOAT16_MEAN = 0.1


@dataclass(frozen=True)
class GapRule:
    statistic: str  # "max" | "mean": over the step's tokens
    bound: float
    why: str  # where the bound comes from, for the refusal line

    def holds(self, gap: Gap) -> bool:
        value = gap.max if self.statistic == "max" else gap.mean
        return value <= self.bound  # NaN fails

    def describe(self, gap: Gap) -> str:
        value = gap.max if self.statistic == "max" else gap.mean
        return f"{self.statistic} gap {value:.2e} over {gap.tokens} tokens > {self.bound:g}, {self.why}"


@dataclass(frozen=True)
class Gap:
    max: float
    mean: float
    tokens: int


def gap(a: list[list[float]], b: list[list[float]]) -> Gap:
    """The largest and the mean |a - b| over every token of every completion (0 for no tokens)."""
    diffs = [abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    if any(d != d for d in diffs):
        return Gap(float("nan"), float("nan"), len(diffs))
    return Gap(max(diffs, default=0.0), sum(diffs) / len(diffs) if diffs else 0.0, len(diffs))


def gap_rule(dtype: str, max_diff: float | None) -> GapRule:
    """The rule for a run computing in `dtype` (the recipe's torch_dtype, which the printed server command serves
    at too); `max_diff`: the recipe's rollout_max_logprob_diff, or None for the dtype's rule."""
    if max_diff is not None:
        return GapRule("max", max_diff, "the recipe's rollout_max_logprob_diff")
    if dtype in ("float32", "float64"):
        return GapRule("max", FLOAT32_MAX, f"the bound for {dtype} (rollout_max_logprob_diff sets another)")
    import torch

    unit = torch.finfo(getattr(torch, dtype)).eps / 2
    bound = BFLOAT16_MEAN * unit / (torch.finfo(torch.bfloat16).eps / 2)
    return GapRule("mean", bound, f"the bound for {dtype}, whose rounding alone stays far below it")
