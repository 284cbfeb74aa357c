"""A new user's first hour, as README.md and docs/commands.md lay it out: budget -> train tiny -> inspect -> every
export -> compare tiny, each a real `bdlora` process in a scratch directory (the recipes linked in, as from the
repository root). Every command it runs is one the docs or the toolkit itself printed; none may fail, print a
third-party line on stderr, or leave a placeholder in a generated file. (`check-serving` and `tp-check` have their
own tests: tests/serving/test_serving.py, tests/tp_diagnostics/test_tp_check.py.)"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BDLORA = [sys.executable, "-m", "bdlora_train.cli"]
# What is allowed on stderr besides the toolkit's own `bdlora ...` lines: progress bars and the Trainer's log dicts.
PROGRESS = re.compile(r"\d+%\||it/s\]|examples/s\]|s/it\]")
PLACEHOLDERS = re.compile(r"\bADAPTER(_DIR)?\b|\bBASE\b|<[a-z_]+>")

pytestmark = pytest.mark.usefixtures("one_thread")


def third_party_lines(stderr: str) -> list[str]:
    """stderr lines that are neither the toolkit's (`bdlora ...` and its indented continuation lines) nor progress
    bars nor the Trainer's log dicts."""
    lines, ours = [], False
    for raw in stderr.replace("\r", "\n").splitlines():
        line = raw.strip()
        if not line or PROGRESS.search(line):
            continue
        ours = line.startswith("bdlora ") or (ours and raw.startswith("  "))
        if not ours and not line.startswith("{'"):
            lines.append(line)
    return lines


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """`command` as a user would paste it (a `bdlora ...` line), through the real entry point."""
    argv = shlex.split(command)
    assert argv[0] == "bdlora", command
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    done = subprocess.run(BDLORA + argv[1:], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    assert third_party_lines(done.stderr) == [], f"{command}: third-party lines on stderr"
    return done


def readme_command(prefix: str) -> str:
    """The first command line in README.md that starts with `prefix` (comments cut)."""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith(prefix):
            return line.split("  #")[0].strip()
    raise AssertionError(f"README.md has no command starting with {prefix!r}")


def card_head(path: Path) -> str:
    """A model card up to its serving section (which tests/serving/test_serving.py checks against check-serving)."""
    return (path / "README.md").read_text().split("## Serving")[0]


def snippet(card: str) -> str:
    return card.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("first-hour")
    (root / "recipes").symlink_to(ROOT / "recipes")
    return root


def test_budget_prints_the_readme_table(scratch):
    out = run(readme_command("bdlora budget "), scratch).stdout
    readme = (ROOT / "README.md").read_text()
    rows = [line for line in out.splitlines() if line.startswith("| lora |") or line.startswith("| bdlora |")]
    assert rows and all(row in readme for row in rows)


def test_train_inspect_every_export_and_cards_run_as_printed(scratch, monkeypatch):
    import torch

    train = run(readme_command("bdlora train recipes/tiny/bdlora.yaml output_dir=runs/x"), scratch)
    assert train.stdout.count("\n") == 1 and train.stdout.startswith("bdlora train: bdlora r=8 nblocks=2")
    adapter = scratch / "runs" / "x" / "adapter"
    inspect = run(readme_command("bdlora inspect runs/x/adapter"), scratch).stdout
    printed = [line.split("  #")[0].strip() for line in inspect.splitlines() if line.strip().startswith("bdlora ")]
    assert printed == [  # nblocks 2: TP 2 natively, TP 1 as it is; other degrees through the dense export
        "bdlora export runs/x/adapter --to dense-lora --out runs/x/adapter-dense",
    ]
    for command in printed + [readme_command("bdlora export runs/x/adapter --to merged")]:
        run(command, scratch)
    monkeypatch.chdir(scratch.parent)  # cards name absolute paths: their snippets run from anywhere
    ids = torch.tensor([[12, 30, 4, 8, 19]])
    logits = {}
    for out in (adapter, scratch / "runs/x/adapter-dense", scratch / "runs/x/merged"):
        head = card_head(out)
        assert not PLACEHOLDERS.search(head), (out, PLACEHOLDERS.search(head))
        assert str(out.resolve()) in head
        scope = {}
        exec(snippet(head), scope)
        with torch.no_grad():
            logits[out.name] = scope["model"].eval()(ids).logits
    for name, value in logits.items():  # every export is the same function as the trained adapter
        assert torch.allclose(value, logits["adapter"], rtol=1e-4, atol=1e-5), name
    metrics = json.loads((scratch / "runs/x/metrics.json").read_text())
    assert metrics["world_size"] == 1 and metrics["steps"] == 5


def test_readme_alpaca_example_runs(scratch):
    rows = [
        {"instruction": "Add the two numbers.", "input": "12 30", "output": "42"},
        {"instruction": "Say hello.", "input": "", "output": "Hello!"},
    ] * 4
    (scratch / "alpaca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = run(readme_command("bdlora train recipes/tiny/bdlora.yaml dataset=alpaca.jsonl"), scratch)
    assert "adapter -> runs/alpaca/adapter" in done.stdout


def test_compare_tiny_as_documented(scratch):
    documented = next(
        line.strip()
        for line in (ROOT / "docs" / "commands.md").read_text().splitlines()
        if line.startswith("bdlora compare --model tiny:llama")
    )
    # as documented, with fewer test items scored (the test's only change: the CPU time of the evaluation)
    done = run(f"{documented} --limit 10 --quiet", scratch)
    assert not PROGRESS.search(done.stderr)  # --quiet: no bar at all
    assert done.stdout.startswith("# LoRA vs BD-LoRA") and "{'" not in done.stdout
    planned = re.search(r"(\d+) runs planned", done.stderr).group(1)
    assert f"Cost: {planned} trained runs of {planned} planned" in done.stdout
    assert "0.0 min" not in done.stdout
