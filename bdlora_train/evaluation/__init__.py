"""Evaluation: tasks on real offline data, metrics, the matched-budget LoRA vs BD-LoRA sweep, and its report."""

from bdlora_train.evaluation.tasks import GenerationTask, PerplexityTask, Task, TaskError, get_task, register_task

__all__ = ["GenerationTask", "PerplexityTask", "Task", "TaskError", "get_task", "register_task"]
