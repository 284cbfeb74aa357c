"""Launching: one process or many (`torchrun`, `accelerate launch`, DeepSpeed, FSDP), checked before training.

checks.py     world size, a rank dying with its launcher, the sharding that took effect
command.py    the launch command that starts a run right (printed when a run is started wrong)
env.py        the run's environment, scoped: launch flags, thread counts, wandb
deepspeed.py  DeepSpeed's JSON config and its CPU state
"""
