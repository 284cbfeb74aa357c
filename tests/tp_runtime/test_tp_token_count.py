"""The tokens a TP run has seen, as the Trainer logs them live: the ranks of a TP group read the same batch, so the
count is one process's (transformers' Trainer sums every process's tokens as if each were a data-parallel replica, and
`torchrun --nproc_per_node 2` of the tiny TP recipe logged twice the one-process count)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import ROOT, cli_env, torchrun

RECIPE = "recipes/tiny/bdlora_tp2.yaml"
SHORT = {"max_steps": 3, "logging_steps": 1, "save_steps": 0}

pytestmark = pytest.mark.usefixtures("one_thread")


def logged_tokens(output: str) -> list[int]:
    """`num_input_tokens_seen` of every log dict the Trainer printed (one per step, then the run's summary)."""
    counts = []
    for line in output.replace("\r", "\n").splitlines():
        start = line.find("{'")
        if start >= 0 and "num_input_tokens_seen" in line:
            counts.append(int(ast.literal_eval(line[start : line.rindex("}") + 1])["num_input_tokens_seen"]))
    return counts


def _train(out: Path, launcher: list[str], *overrides: str) -> str:
    """The live log (stdout and stderr) of `python -m bdlora_train.train` in a fresh process: what a user sees, not
    what an earlier test left the progress-bar switch at."""
    proc = subprocess.run(
        [*launcher, "-m", "bdlora_train.train", RECIPE, f"output_dir={out}", *overrides],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def test_a_tp_run_logs_the_tokens_one_process_sees(tmp_path):
    overrides = [f"{key}={value}" for key, value in SHORT.items()]
    one = logged_tokens(_train(tmp_path / "one", [sys.executable], "tp_size=1", *overrides))
    assert len(one) == 4 and one == sorted(one) and one[0] > 0  # three steps, then the summary

    out = tmp_path / "tp"
    assert logged_tokens(_train(out, torchrun(2), *overrides)) == one  # rank 0 logs; every step's running count
    assert json.loads((out / "metrics.json").read_text())["tokens_seen"] == one[-1]
    assert json.loads((tmp_path / "one" / "metrics.json").read_text())["tokens_seen"] == one[-1]
    assert Path(out / "adapter" / "adapter_model.safetensors").is_file()
