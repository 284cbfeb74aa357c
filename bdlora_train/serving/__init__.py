"""Serving: what the installed engine can do (engines.py: metadata only, shared with the vLLM plugin) and
`bdlora check-serving` with the serve commands a model card prints (check.py)."""
