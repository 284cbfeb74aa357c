"""The BD-LoRA kernel: the fused GEMMs of a block-diagonal adapter and their autograd Functions, in plain torch (no
PEFT): `bdlora.py` adds an adapter into a layer's output and runs a frozen Linear and its adapter as one node,
`dropout.py` draws torch's own dropout mask inside that node; `experts.py` is the LoRA delta of MoE expert
weights."""
