"""The tensor-parallel training runtime every `tp_size > 1` run uses (`training.py`). The proofs and benchmarks of
TP (collective counters, harnesses, the traffic model) live apart, in tp_proofs/."""
