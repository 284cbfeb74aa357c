"""A Python session in the `make install` environment prints only what the toolkit means to say: `import peft,
bdlora_train` in either order (a script usually imports peft first, before any line of the toolkit runs: the
startup filter `make install` puts in site-packages, core/chatter.py) and a short `train()` from Python, adapter save
included. Each runs in a fresh interpreter of this environment, as a user's script does."""

import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from bdlora_train.core.chatter import STARTUP_PTH

ROOT = Path(__file__).resolve().parents[1]
# What a run may print besides the toolkit's own `bdlora ...` lines: tqdm progress bars and the Trainer's log dicts.
PROGRESS = re.compile(r"\d+%\||it/s\]|examples/s\]|s/it\]")


def third_party_lines(output: str) -> list[str]:
    return [
        line.strip()
        for line in output.replace("\r", "\n").splitlines()
        if line.strip() and not PROGRESS.search(line) and not line.strip().startswith(("bdlora ", "{'", "OK "))
    ]


def python(code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_this_environment_has_the_startup_filter():
    site = Path(sysconfig.get_path("purelib"))
    assert (site / STARTUP_PTH).is_file(), f"{site / STARTUP_PTH} is missing: run `make install`"


@pytest.mark.parametrize("order", ["peft, bdlora_train", "bdlora_train, peft", "trl, bdlora_train"])
def test_importing_peft_and_the_toolkit_in_any_order_prints_nothing(order):
    done = python(f"import {order}")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == "", done.stderr


def test_without_the_startup_filter_peft_first_is_what_the_filter_removes():
    """The control: the same import with the filters taken off again before peft loads prints the lines of torchao
    (its CUDA-only kernels) that the filter drops, so the test above can fail."""
    code = (
        "import logging\n"
        "for name in ('torchao', 'torch.utils._pytree', 'bitsandbytes.backends.cpu.ops'):\n"
        "    logging.getLogger(name).filters.clear()\n"
        "import peft\n"
    )
    done = python(code)
    assert done.returncode == 0, done.stderr
    assert "torchao" in done.stderr and "Failed to load" in done.stderr


def test_a_two_step_train_from_python_prints_no_third_party_line(tmp_path):
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    code = (
        "import peft\n"
        "from bdlora_train.train import load_recipe, train\n"
        "result = train(load_recipe('recipes/tiny/bdlora.yaml', ['max_steps=2', 'output_dir=run']))\n"
        "print('OK', sorted(p.name for p in result.adapter_dir.iterdir()))\n"
    )
    done = python(code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "adapter_model.safetensors" in done.stdout
    assert third_party_lines(done.stdout) == [] and third_party_lines(done.stderr) == [], done.stdout + done.stderr
