"""`python -m bdlora_train.train RECIPE.yaml [key=value ...]`: the entry point for torchrun / accelerate launch."""

import sys

from bdlora_train.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
