"""The vLLM engine harness of tests/vllm and scripts/bench_serving.py (not part of the wheel)."""
