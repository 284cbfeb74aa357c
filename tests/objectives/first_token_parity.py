"""A reward for tests/objectives/test_grpo_async.py: 1 when a completion's first token id is odd. The stand-in server's
completions of one prompt start with consecutive ids, so every group's rewards alternate and its advantages are
never all zero."""


def first_token_parity(completions, completion_ids, **kwargs) -> list[float]:
    return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]
