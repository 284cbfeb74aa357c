"""`bdlora train RECIPE.yaml [key=value ...]`: the command line is train/entry.py's, which torchrun also runs as
`python -m bdlora_train.train` (so that entry point imports nothing above train/)."""

from bdlora_train.train.entry import main

__all__ = ["main"]
