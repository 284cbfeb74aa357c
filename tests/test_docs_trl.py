"""docs/training.md, "With TRL": its Python blocks, read from the page (not a copy), run as printed on this machine in
one fresh interpreter, in order, as a reader pastes them: they train, save what the page says, and print no
third-party line (no bf16 refusal on a CPU, no deprecation notes, no PEFT note at the save of a tiny model)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a run may print: tqdm progress bars (the trainers' and datasets' maps) and the Trainer's log dicts.
PROGRESS = re.compile(r"\d+%\||it/s\]|examples/s\]|s/it\]")


def trl_blocks() -> list[str]:
    page = (ROOT / "docs" / "training.md").read_text()
    section = page.split("\n## With TRL\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```$", section, flags=re.S | re.M)


def test_the_trl_section_has_the_sft_and_dpo_blocks():
    blocks = trl_blocks()
    assert len(blocks) == 2
    assert "SFTTrainer(" in blocks[0] and "DPOTrainer(" in blocks[1]
    assert "build_tiny_model" in blocks[0] and "tiny_tokenizer" in blocks[0]  # where the model and tokenizer come from


def test_the_trl_blocks_run_as_printed_and_save_what_the_page_says(tmp_path):
    # after the page's lines: what the page says trainer.save_model would have written beside the trained adapter
    script = "\n".join(trl_blocks()) + '\ntrainer.save_model("runs/dpo/with-ref")\n'
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}  # a reader's shell: transformers prints a line
    env["HF_HUB_OFFLINE"] = "1"  # under WANDB_MODE=offline; the Trainer's default report_to is "none"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    output = (done.stdout + "\n" + done.stderr).replace("\r", "\n").splitlines()
    others = [
        line for line in output if line.strip() and not PROGRESS.search(line) and not line.strip().startswith("{'")
    ]
    assert others == [], "\n".join(others)

    sft, dpo = tmp_path / "runs/sft/adapter", tmp_path / "runs/dpo/adapter"
    for adapter in (sft, dpo):  # stock PEFT format, with the tokenizer
        for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json"):
            assert (adapter / name).is_file(), adapter / name
    assert not (dpo / "ref").exists()  # the trained adapter alone
    assert (tmp_path / "runs/dpo/with-ref/ref/adapter_config.json").is_file()  # the page's warning is true
