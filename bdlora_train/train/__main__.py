"""`python -m bdlora_train.train RECIPE.yaml [key=value ...]`: the entry point for torchrun / accelerate launch; the
same command line and error boundary as `bdlora train` (train/entry.py, core/boundary.py), nothing imported from
above train/."""

import gc
import sys

from bdlora_train.core.boundary import run_command

argv = [a for a in sys.argv[1:] if a != "--traceback"]
code = run_command("train", "bdlora_train.train.entry:main", argv, show_traceback=len(argv) < len(sys.argv) - 1)
if "torch.distributed" in sys.modules:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
# The run's last references to the process group (the model's DTensors in reference cycles) go now, while the
# interpreter is whole: left to interpreter exit, gloo's teardown can abort a rank after a finished run ("terminate
# called without an active exception", SIGABRT; tp_diagnostics/ranks.py does the same for its ranks).
gc.collect()
sys.exit(code)
