"""Reinforcement learning with BD-LoRA (GRPO through TRL): reward functions (rewards.py), the vLLM rollout
server's client (vllm_server.py, composing engine_client.py, server_check.py, server_adapters.py and
server_sampling.py), the rollout function that syncs the adapter and checks the server's log-probabilities against
the trainer's (rollouts.py) and the run's diagnostics (diagnostics.py). `bdlora train` with `objective: grpo`
builds on them; docs/rl.md."""
