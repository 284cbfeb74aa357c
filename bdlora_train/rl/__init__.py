"""Reinforcement learning with BD-LoRA (GRPO through TRL): reward functions (rewards.py), the vLLM rollout
server's client (vllm_server.py) and the rollout function that syncs the adapter and checks the server's
log-probabilities against the trainer's (rollouts.py). `bdlora train` with `objective: grpo` builds on them
(train/grpo.py); docs/rl.md."""
