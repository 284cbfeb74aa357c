"""A user reward for the GRPO reward-curve check (README.md here): TRL's reward signature, named on the command line
as `path/to/first_letter.py:starts_with_vowel`. It rewards a property of the answer the built-in exact_match does not
look at, and no test uses it: the first word of the completion starts with a vowel."""


def starts_with_vowel(prompts, completions, **kwargs):
    rewards = []
    for completion in completions:
        words = completion.strip().split()
        rewards.append(1.0 if words and words[0][0].lower() in "aeiou" else 0.0)
    return rewards
