"""Launches that clean up, with the real launchers on CPU (gloo): ranks die with a `kill -9`-ed torchrun and free the
run's lock; a refusal is printed once (rank 0) and leaves no directory; `accelerate launch` with the TP config's
num_processes says to pass --num_processes; a printed launch command runs as printed."""

import fcntl
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bdlora_train.train.rundir import LOCK_NAME, claimed
from tests.launching import ROOT, cli_env, free_port, torchrun

TP_RECIPE = "recipes/tiny/bdlora_tp2.yaml"
pytestmark = pytest.mark.usefixtures("one_thread")


def ours(stderr: str) -> list[str]:
    """The toolkit's own error lines (the launcher's report quotes the line indented, after `traceback : `)."""
    return [line for line in stderr.splitlines() if line.startswith("bdlora train: error:")]


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_ranks_die_with_a_kill_9_torchrun_and_free_the_lock(tmp_path):
    out = tmp_path / "run"
    cmd = [*torchrun(2), "-m", "bdlora_train.train", TP_RECIPE, f"output_dir={out}", "max_steps=100000",
           "save_steps=2", "logging_steps=1"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = []
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoint-2").is_dir():  # both ranks are training
            assert proc.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
        ranks = children(proc.pid)
        assert len(ranks) == 2 and all(alive(pid) for pid in ranks)
        os.kill(proc.pid, signal.SIGKILL)  # the launcher only: it cannot stop its ranks
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in ranks):
            assert time.monotonic() < deadline, "ranks outlived their launcher"
            time.sleep(0.05)
    finally:
        for pid in [proc.pid, *ranks]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    # free: what the re-run takes first. A killed rank's leader thread reads as a zombie while its other threads
    # (gloo's) are still being torn down, and the lock goes with the last of them: allow that a few seconds
    deadline = time.monotonic() + 20
    with open(out / LOCK_NAME) as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "the lock outlived the ranks by 20 s"
                time.sleep(0.1)
        fcntl.flock(handle, fcntl.LOCK_UN)
    with claimed(str(out)):  # the re-run's claim: not "in use by another run"
        pass


def test_torchrun_refusal_is_printed_once_and_leaves_no_directory(tmp_path):
    """3 ranks for tp_size=3 on the tiny Llama (4 heads): every rank refuses in the run's plan, inside the claimed
    output_dir; rank 0 alone prints, the launcher's report ends with the same line, no directory is left."""
    out = tmp_path / "new" / "run"
    cmd = [*torchrun(3), "-m", "bdlora_train.train", TP_RECIPE, f"output_dir={out}", "tp_size=3", "max_steps=1"]
    done = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    line = "bdlora train: error: tp_size=3 does not divide num_attention_heads=4"
    assert len(ours(done.stderr)) == 1 and ours(done.stderr)[0].startswith(line), done.stderr[-3000:]
    # torchrun's own report: rank 0 is the root cause, with our line as its traceback; the others were stopped
    root = done.stderr.split("Root Cause (first observed failure):")[1]
    assert f"traceback : {ours(done.stderr)[0]}" in root and "rank      : 0 " in root
    assert done.stderr.count("traceback : bdlora train: error:") == 1
    assert not (tmp_path / "new").exists()


def test_accelerate_tp_config_without_num_processes_says_to_pass_it(tmp_path):
    """recipes/accelerate/tp.yaml says num_processes: 8 (the tp8 recipes); the tiny TP 2 recipe started with it
    refuses once, with the command that runs (this launch, --num_processes 2)."""
    out = tmp_path / "run"
    start = time.monotonic()
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/tp.yaml",
              "--main_process_port", str(free_port())]  # fmt: skip
    args = ["-m", "bdlora_train.train", TP_RECIPE, f"output_dir={out}", "max_steps=2", "save_steps=0"]
    done = subprocess.run([*launch, *args], cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    assert done.returncode == 1
    command = (
        f"accelerate launch --config_file recipes/accelerate/tp.yaml --main_process_port {launch[-1]} "
        f"--num_processes 2 -m bdlora_train.train {TP_RECIPE} output_dir={out} max_steps=2 save_steps=0"
    )
    assert ours(done.stderr) == [
        "bdlora train: error: recipe: tp_size=2 x fsdp_size=1 x dp_replicate_size=1 needs 2 processes but the "
        f"launcher started 8; launch with `{command}` (or one process per GPU over nodes)"
    ], done.stderr[-3000:]
    assert not out.exists()
    assert took < 60, took


def test_the_printed_torchrun_command_runs_as_printed(tmp_path):
    """`bdlora train RECIPE tp_size=2` in one process prints the torchrun line with this run's recipe and
    arguments; that line, run as printed, trains."""
    out = tmp_path / "run"
    bdlora = Path(sys.executable).parent / "bdlora"
    argv = [str(bdlora), "train", "recipes/tiny/bdlora.yaml", "tp_size=2", f"output_dir={out}", "max_steps=2",
            "save_steps=0"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and len(ours(done.stderr)) == 1, done.stderr[-2000:]
    command = ours(done.stderr)[0].split("`")[1]
    assert command == ("torchrun --nproc_per_node 2 -m bdlora_train.train recipes/tiny/bdlora.yaml tp_size=2 "
                       f"output_dir={out} max_steps=2 save_steps=0")  # fmt: skip
    assert not out.exists()
    words = shlex.split(command)
    words[0] = str(Path(sys.executable).parent / "torchrun")
    words[1:1] = ["--master_port", str(free_port())]
    ran = subprocess.run(words, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["tp_size=3", "nblocks=2"], "tp_size=3 does not divide num_attention_heads=4: TP shards would split heads "
         "(or replicate KV heads) and blocks would not line up; use tp_size in [1, 2]"),
        (["nblocks=3"], "recipe: nblocks=3 is not a multiple of tp_size=2: each rank must hold whole blocks; use "
         "nblocks=2 (or drop it: it defaults to tp_size=2)"),
        (["tp_size=3", "nblocks=3", "lora_r=9"], "tp_size=3 does not divide num_attention_heads=4"),
    ],  # fmt: skip
)
def test_tp_hints_suggest_only_values_every_rule_passes(tmp_path, monkeypatch, overrides, message):
    """The heads speak before nblocks and the rank: a suggested nblocks or lora_r never fails on the head count."""
    from bdlora_train.core.boundary import error_line
    from bdlora_train.recipe.load import load_recipe
    from bdlora_train.train.entry import check_launch

    monkeypatch.setenv("WORLD_SIZE", "1")
    recipe = load_recipe(str(ROOT / TP_RECIPE), [f"output_dir={tmp_path / 'run'}", *overrides])
    with pytest.raises(Exception) as caught:
        check_launch(recipe)
    assert message in error_line("train", caught.value)
    assert not (tmp_path / "run").exists()
