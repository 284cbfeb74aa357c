"""Tasks: a train set of prompt/completion pairs and a held-out score, on real offline data; what `bdlora compare`
trains and scores, and what a recipe's `dataset: task:<name>` trains on.

    task = get_task("analogies")          # or "news-ppl", "arithmetic", "org/dataset", "my_task.yaml", "my_task.py"
    train = task.train_dataset(seed=0)    # datasets.Dataset with "prompt", "completion" (no EOS: the trainer adds it)
    scores = task.evaluate(model, tokenizer)   # {"accuracy": 81.4, "accuracy/family": 90.0, ...}
    val = task.evaluate(model, tokenizer, split="validation")   # the split hyper-parameters are chosen on

Built-in tasks (data ships in the gensim wheel's test_data, so everything runs offline):
  analogies   word2vec analogy set (questions-words.txt, 14 categories). Prompt "Athens is to Greece as
              Baghdad is to" -> " Iraq"; exact match of the first generated word (greedy, 4 tokens).
  news-ppl    Lee news corpus (lee_background.cor, 300 articles): train on passages of the training
              articles, score perplexity (loss on all tokens) on the held-out articles.
  arithmetic  generated multi-digit addition and multiplication, "123 + 456 =" -> " 579"; exact match.

Three disjoint splits, deterministic and independent of the training seed: items are ordered by the SHA-256
of "<task>:<item>" and the first ones go to test (analogies: the first `test_per_category` of each
category; news-ppl: the first `test_fraction` of articles). The validation split is then carved from what is
left (the training data) the same way under another salt ("<task>-validation:<item>"), and training gets the
rest. The training seed only shuffles the training rows, so every method, seed and hyper-parameter setting is
selected on the very same validation items and scored on the very same test items.
"""

from bdlora_train.tasks.kinds import GenerationTask, PerplexityTask, Task
from bdlora_train.tasks.registry import BUILTIN, get_task, register_task

__all__ = ["BUILTIN", "GenerationTask", "PerplexityTask", "Task", "get_task", "register_task"]
