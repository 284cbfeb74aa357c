"""What the toolkit adds to any `transformers.Trainer` subclass (the supervised Trainer, TRL's GRPOTrainer).

mixins.py  atomic checkpoints, a complete adapter save under DDP / ZeRO-3 / FSDP, a TP run's sharded adapter state
optim.py   per-factor learning rates: bd_lr_ratio for the block-diagonal factor, loraplus_lr_ratio for LoRA's B
"""
