"""Developer tools that are not part of the wheel: docs generators and the vLLM engine harness."""
