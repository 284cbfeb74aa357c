"""The recipe: what one training run is asked to do.

schema.py         the `Recipe` dataclass (the YAML keys: type, default, help and range each), validation, loading
text.py           YAML files and `key=value` text parsed into typed values
methods.py        the PEFT config of each method (bdlora, lora, peft-bdlora) and the keys each reads
parallel_keys.py  the model-parallel sizes checked against each other (and the EP layouts that fit)
"""
