"""Verifiable rewards for GSM8K (openai/gsm8k, config "main"): the reference answer ends with "#### <number>".

Used by grpo_tp8.yaml as `rewards: [recipes/llama-3.1-8b/gsm8k/rewards.py:final_number, ...]` (TRL's reward
signature: keyword arguments, one list entry per completion; `answer` is the row's reference solution)."""

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def final_number(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the last number of the completion equals the reference's final answer (after "####"), else 0.0."""
    scores = []
    for completion, reference in zip(completions, answer, strict=True):
        expected = _number(reference.rsplit("####", 1)[-1])
        scores.append(1.0 if expected is not None and _number(completion) == expected else 0.0)
    return scores


def states_the_answer(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion ends its reasoning with "#### <number>", the format the reference solutions use."""
    return [1.0 if re.search(r"####\s*-?\d", completion) else 0.0 for completion in completions]
