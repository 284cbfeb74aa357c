"""`python -m bdlora_train.train RECIPE.yaml [key=value ...]`: the entry point for torchrun / accelerate launch; the
same command line and error boundary as `bdlora train` (train/entry.py, core/boundary.py), nothing imported from
above train/."""

import sys

from bdlora_train.core.boundary import run_command

argv = [a for a in sys.argv[1:] if a != "--traceback"]
sys.exit(run_command("train", "bdlora_train.train.entry:main", argv, show_traceback=len(argv) < len(sys.argv) - 1))
