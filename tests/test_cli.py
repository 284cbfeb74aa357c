"""The CLI contract: user errors are one line (exit 1), Ctrl-C exits 130, bugs keep their traceback, --traceback
shows every traceback, and the documented recipe-key table is the one the code generates."""

import re
import sys
import types
from pathlib import Path

import pytest

from bdlora_train import cli

ROOT = Path(__file__).resolve().parents[1]


def _run_with(monkeypatch, capsys, exc, argv=("budget",)):
    """Run `bdlora budget` with the command replaced by one that raises `exc`."""

    def boom(argv):
        raise exc

    monkeypatch.setitem(sys.modules, "fake_command", types.SimpleNamespace(main=boom))
    monkeypatch.setitem(cli.COMMANDS, "budget", ("fake_command:main", "test"))
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


def test_user_errors_are_one_line_exit_1(monkeypatch, capsys):
    from bdlora_train.core.errors import RecipeError

    code, err = _run_with(monkeypatch, capsys, RecipeError("budget: lora_r=0 must be >= 1"))
    assert code == 1
    assert err == "bdlora budget: error: lora_r=0 must be >= 1\n"  # no doubled "budget:" prefix


def test_empty_message_and_foreign_user_errors(monkeypatch, capsys):
    from safetensors import SafetensorError

    code, err = _run_with(monkeypatch, capsys, OSError(28, "No space left on device", "/full/disk/x"))
    assert code == 1 and err.count("\n") == 1 and "No space left on device" in err and "/full/disk/x" in err
    code, err = _run_with(monkeypatch, capsys, SafetensorError("Error while deserializing header"))
    assert code == 1 and "deserializing header" in err
    from bdlora_train.core.errors import BlockDiagLoraError

    code, err = _run_with(monkeypatch, capsys, BlockDiagLoraError(""))  # an empty message must not crash the handler
    assert code == 1 and err == "bdlora budget: error: BlockDiagLoraError\n"


def test_ctrl_c_exits_130_with_a_resume_hint(monkeypatch, capsys):
    code, err = _run_with(monkeypatch, capsys, KeyboardInterrupt())
    assert code == 130 and "interrupted; re-run the same command to resume" in err


def test_bugs_keep_their_traceback_and_traceback_flag_shows_user_errors(monkeypatch, capsys):
    with pytest.raises(ZeroDivisionError):
        _run_with(monkeypatch, capsys, ZeroDivisionError("a bug"))
    from bdlora_train.core.errors import RecipeError

    with pytest.raises(RecipeError):
        _run_with(monkeypatch, capsys, RecipeError("x"), argv=("budget", "--traceback"))


def test_version_and_unknown_command(capsys):
    assert cli.main(["--version"]) == 0
    assert re.match(r"bdlora \S+", capsys.readouterr().out)
    assert cli.main(["bugdet"]) == 2
    assert "did you mean 'budget'" in capsys.readouterr().err


def test_corrupt_adapter_file_is_one_line(tmp_path, capsys):
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    assert cli.main(["inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unreadable safetensors" in err and "adapter_model.safetensors" in err
    (tmp_path / "adapter_config.json").write_text("{not json")
    assert cli.main(["inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "adapter_config.json: not valid JSON" in err


def test_recipe_key_table_in_docs_is_generated_from_the_code():
    from tools.recipe_keys import doc_table, keys_markdown

    assert doc_table() == keys_markdown(), "docs/training.md's key table is stale; run `python -m tools.recipe_keys`"


def test_docs_cite_nothing_outside_the_repository_and_links_resolve():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for path in files:
        text = path.read_text()
        assert "NOTES" not in text and "../shared" not in text, f"{path} cites a file outside the repository"
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to missing {target}"
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


BENCH = ROOT / "eval" / "bench"


def _braces(text: str) -> list[str]:
    """Shell brace expansion: `a_{x,y}_run{1..3}.json` -> the six names it stands for."""
    match = re.search(r"\{([^{}]*)\}", text)
    if not match:
        return [text]
    span = re.fullmatch(r"(\d+)\.\.(\d+)", match.group(1))
    options = [str(i) for i in range(int(span[1]), int(span[2]) + 1)] if span else match.group(1).split(",")
    return [name for option in options for name in _braces(text[: match.start()] + option + text[match.end() :])]


def _bench_citations(text: str) -> list[tuple[str, bool]]:
    """(file name, written by a command) for every `eval/bench/<name>` in `text`, brace patterns expanded; a path right
    after `--out`, `--json` or `>` is what that command writes (e.g. a GPU run not made yet), not a file cited."""
    found = []
    for match in re.finditer(r"eval/bench/([\w.{},-]+)", text):
        before = text[text.rfind("\n", 0, match.start()) + 1 : match.start()]
        written = re.search(r"(--out|--json|>)\s*$", before) is not None
        found += [(name, written) for name in _braces(match.group(1).rstrip(".,")) if name]
    return found


def test_eval_bench_holds_exactly_the_files_the_docs_cite_each_listed_with_its_claim():
    """eval/bench/ holds one file per cited measurement (docs/*.md, README.md; scripts' and the package's comments
    must name existing ones too) and its README.md lists each with the claim it backs and its command."""
    files = {path.name for path in BENCH.iterdir()}
    held = files - {"README.md"}
    cited, missing = set(), []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "scripts").glob("*.py")),
                 *sorted((ROOT / "bdlora_train").rglob("*.py"))]:  # fmt: skip
        for name, written in _bench_citations(path.read_text()):
            if path.suffix == ".md":
                cited.add(name)
            if not written and name not in files:
                missing.append(f"{path.relative_to(ROOT)}: eval/bench/{name}")
    assert not missing, f"cited but not in eval/bench/: {missing}"
    assert not held - cited, f"in eval/bench/ but no doc cites them (git rm them): {sorted(held - cited)}"
    listing = (BENCH / "README.md").read_text()
    rows = [line.split("|")[1] for line in listing.splitlines() if line.startswith("| `")]
    listed = {name for cell in rows for pattern in re.findall(r"`([^`]+)`", cell) for name in _braces(pattern)}
    assert listed == held, f"eval/bench/README.md lists {sorted(listed - held)} and misses {sorted(held - listed)}"


ARGPARSE_ERRORS = {
    "check-serving --tp two": ("check-serving", "x", "--tp", "two"),
    "tp-check --tp two": ("tp-check", "--tp", "two"),
    "export without --out": ("export", "x", "--to", "dense-lora"),
    "export two kinds": ("export", "x", "--to", "dense-lora", "--reblock", "1", "--out", "y"),
    "budget --lora-ranks x": ("budget", "--lora-ranks", "x"),
    "compare --seeds x": ("compare", "--seeds", "x"),
    "inspect without adapter": ("inspect",),
    "push without --repo-id": ("push", "x"),
    "train --bad-flag": ("train", "--bad-flag"),
    "bench-tp --rank r": ("bench-tp", "--rank", "r"),
}


@pytest.mark.parametrize("argv", ARGPARSE_ERRORS.values(), ids=list(ARGPARSE_ERRORS))
def test_argparse_errors_follow_the_one_line_exit_1_contract(capsys, argv):
    assert cli.main(list(argv)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err, err
    assert err.startswith(f"bdlora {argv[0]}: error: ") and f"(see `bdlora {argv[0]} --help`)" in err
    import argparse

    assert argparse.ArgumentParser.error.__module__ == "argparse"  # restored after the command


def test_train_without_a_recipe_is_one_line_and_trains_nothing(tmp_path, capsys, monkeypatch):
    """Bad input is one line and exit 1 (README): no usage block, and an example that runs."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "usage:" not in out.err
    assert out.err.startswith("bdlora train: error: give a recipe YAML") and "recipes/tiny/bdlora.yaml" in out.err
    assert list(tmp_path.iterdir()) == []  # no runs/bdlora: the defaults would train SmolLM2 for 2,352 steps


@pytest.mark.parametrize(
    "options, hint",
    [
        (["--max_steps", "5"], "write max_steps=5"),
        (["--max-steps=5", "--packing"], "write max_steps=5 packing=true"),
        (["--output_dir", "runs/x", "--seed", "3"], "write output_dir=runs/x seed=3"),
        (["--bogus", "3"], "recipe keys are key=value arguments (see"),  # no key of that name: no rewrite offered
    ],
)
def test_train_options_spelled_as_flags_get_the_key_value_they_meant(tmp_path, capsys, monkeypatch, options, hint):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", str(ROOT / "recipes/tiny/bdlora.yaml"), *options]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bdlora train: error: unrecognized arguments: ")
    assert hint in err, err
    assert list(tmp_path.iterdir()) == []


def test_train_help_shows_every_default_as_a_value(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "training_args = {}  #" in text and "_MISSING_TYPE" not in text and "object at 0x" not in text
    # spelled as a recipe writes them (key=value takes YAML)
    assert "  nblocks = null  #" in text and "  use_rslora = false  #" in text
    assert "= None" not in text and "= False" not in text and "= True" not in text


def _help(capsys, monkeypatch, command) -> str:
    monkeypatch.setenv("COLUMNS", "250")  # one line per option
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


REQUIRED = {"export": "--out OUT", "push": "--repo-id REPO_ID", "check-serving": "--tp TP", "tp-check": "--tp TP"}
HELP_DEFAULTS = {
    "bench-tp": [
        "--repeats REPEATS     timed forwards (steps) per mode and token count (default: 5)",
        "--tokens TOKENS [TOKENS ...]",
        "token counts (batch 1) (default: 16 256 2048)",
        "--tp TP               number of ranks (TP degree) (default: 2)",
        "--out OUT             also write the JSON result to this file (atomically; default: none)",
        "time a training step (forward + backward): base vs BD-LoRA vs plain LoRA, with peak memory per rank, the "
        "FLOP floor and each adapter's optimizer step (default: false)",
        "bf16-autocast: a bf16 base, fp32 adapter weights, the forward under bf16 autocast (a recipe with a bf16 "
        "base and bf16: true) (default: fp32)",
        "--train: the adapters' lora_dropout (the recipes' 0.05) (default: 0.0)",
    ],
    "tp-check": [
        "--tokens TOKENS       tokens per sequence (batch of 2) (default: 16)",
        "--rank RANK           --train: LoRA rank; BD-LoRA gets the rank of equal params (default: 8)",
    ],
    "budget": ["LoRA rank(s) to match (default: 16)", "ep (expert parallelism: nblocks 1), none (default: tp)"],
    "compare": [
        "--seeds SEEDS         number of seeds (0..N-1) (default: 3)",
        "--out OUT             output directory (re-run to resume) (default: runs/compare)",
        "test items scored per forward (default: 32)",
        "--quiet               no progress bars (default: false)",
        "recipe overrides applied to every run (default: none)",
        "(default: lora bdlora)",
    ],
    "export": ["--force               replace an existing --out (default: false)"],
    "push": ["--private             create the repo as private (default: false)"],
    "check-serving": ["--json                print JSON instead of the table (default: false)"],
    "inspect": ["--per-module   one row per module instead of per module kind (default: false)"],
}


@pytest.mark.parametrize("command", sorted(HELP_DEFAULTS))
def test_every_option_help_shows_its_default_as_typed(command, capsys, monkeypatch):
    """Issue 30: each option says its default, spelled as on a command line or in a recipe (null, true, false), never
    Python's None / True / False; only -h, the required options and the --to / --reblock pair (one is required)
    have none."""
    text = _help(capsys, monkeypatch, command)
    for line in HELP_DEFAULTS[command]:
        assert line in text, line
    assert not re.search(r"\b(None|True|False)\b", text), text
    options = text.split("options:\n", 1)[1]
    entries = re.split(r"\n(?=  -)", options.strip("\n"))
    for entry in entries:
        head = entry.split("  ", 2)[1] if entry.startswith("  -") else entry
        if head.startswith("-h") or entry.lstrip().startswith(REQUIRED.get(command, "-h")):
            assert "(default:" not in entry, entry
            continue
        assert "default" in entry or "is required" in entry, entry


# Every command's --help loads no torch / transformers / PEFT / datasets.
FAST_HELP = ("budget", "train", "compare", "inspect", "export", "push", "check-serving", "tp-check", "bench-tp")


@pytest.mark.parametrize("command", FAST_HELP)
def test_help_imports_no_heavy_library(command):
    import subprocess

    code = (
        "import sys\nfrom bdlora_train import cli\ntry:\n    cli.main([sys.argv[1], '--help'])\n"
        "except SystemExit as e:\n    assert e.code == 0\n"
        "print(sorted(m for m in ('torch', 'transformers', 'peft', 'datasets') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code, command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]" and done.stderr == ""


BNB_AVX512 = """
import importlib.abc, importlib.util, sys

class ForceAvx512Bf16(importlib.abc.MetaPathFinder):
    # bitsandbytes prints its `kernels` hint at import on CPUs with AVX512-BF16; pretend this is one
    def find_spec(self, name, path=None, target=None):
        if name != "bitsandbytes.functional":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            module.has_avx512bf16 = lambda: True
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, ForceAvx512Bf16())
if sys.argv[1] == "import":
    import logging
    # without the toolkit's filter, which `make install`'s bdlora_train-quiet.pth puts in place at startup
    logging.getLogger("bitsandbytes.backends.cpu.ops").filters.clear()
    import bitsandbytes
else:
    from bdlora_train import cli
    code = cli.main(["budget", "--model", "tiny:llama", "--lora-ranks", "4"])
    assert code == 0 and "bitsandbytes" in sys.modules
"""


def test_bitsandbytes_kernels_hint_and_torchao_chatter_never_reach_the_user(tmp_path):
    import importlib.util
    import subprocess

    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed")
    script = tmp_path / "bnb.py"
    script.write_text(BNB_AVX512)
    plain = subprocess.run([sys.executable, str(script), "import"], capture_output=True, text=True, timeout=300)
    assert "Failed to load CPU gemm_4bit_forward from kernels-community" in plain.stderr  # the line is real here
    done = subprocess.run([sys.executable, str(script), "cli"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr  # nor torchao's .so failures or torch's pytree notes: nothing at all


def test_importing_the_package_and_its_api_from_python_prints_nothing():
    """`import bdlora_train` and every public name (PEFT, transformers, torchao behind them), as a user's script does:
    no torchao .so failures, no pytree notes, nothing on stderr; warnings of the user's own code still show."""
    import subprocess

    script = (
        "import warnings, bdlora_train\n"
        "from bdlora_train import BlockDiagLoraConfig, get_peft_model\n"
        "[getattr(bdlora_train, name) for name in bdlora_train.__all__]\n"
        "print('imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and done.stdout == "imported\n", done.stderr
    assert done.stderr == "", done.stderr
    mine = subprocess.run(
        [sys.executable, "-c", "import bdlora_train, warnings; warnings.warn('my own warning')"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert "UserWarning: my own warning" in mine.stderr


def _raises(error):
    def main(argv):
        raise error

    return main


def test_the_error_boundary_maps_each_failure_to_its_exit_code(capsys, monkeypatch):
    """core/boundary.py, which `bdlora` and `python -m bdlora_train.train` share: a user error is one line and exit 1,
    Ctrl-C exits 130 on a line of its own, a bug keeps its traceback, `--traceback` shows every one."""

    from bdlora_train.core import boundary
    from bdlora_train.core.errors import RecipeError

    fake = types.ModuleType("fake_boundary_target")
    fake.user = _raises(RecipeError("recipe: lora_r=0; use a positive rank"))
    long_fix = "restart it (" + " ".join(f"--flag{i} /some/long/path/{i}" for i in range(40)) + ") and run it again"
    fake.long = _raises(RecipeError(f"rollout server: stopped answering; {long_fix}"))
    fake.long_other = _raises(OSError(5, "x" * 2000))
    fake.disk = _raises(OSError(28, "No space left on device"))
    fake.interrupt = _raises(KeyboardInterrupt())
    fake.bug = _raises(ZeroDivisionError("division by zero"))
    fake.ok = lambda argv: len(argv)
    monkeypatch.setitem(sys.modules, "fake_boundary_target", fake)

    assert boundary.run_command("train", "fake_boundary_target:ok", ["a", "b", "--help"]) == 3  # its own code
    assert boundary.run_command("train", "fake_boundary_target:user", []) == 1
    assert capsys.readouterr().err == "bdlora train: error: recipe: lora_r=0; use a positive rank\n"
    assert boundary.run_command("train", "fake_boundary_target:long", []) == 1  # a fix is never cut short
    assert capsys.readouterr().err == f"bdlora train: error: rollout server: stopped answering; {long_fix}\n"
    assert boundary.run_command("train", "fake_boundary_target:long_other", []) == 1  # another library's is
    assert len(capsys.readouterr().err) < 600
    assert boundary.run_command("export", "fake_boundary_target:disk", []) == 1
    assert capsys.readouterr().err == "bdlora export: error: [Errno 28] No space left on device\n"
    assert boundary.run_command("train", "fake_boundary_target:interrupt", []) == boundary.INTERRUPTED == 130
    assert capsys.readouterr().err.splitlines()[-1] == "bdlora train: interrupted; re-run the same command to resume"
    with pytest.raises(ZeroDivisionError):
        boundary.run_command("train", "fake_boundary_target:bug", [])
    with pytest.raises(RecipeError):
        boundary.run_command("train", "fake_boundary_target:user", [], show_traceback=True)


def test_the_train_summary_line_reads_the_metrics():
    from bdlora_train.train.entry import summary_line

    metrics = dict(method="bdlora", r=8, nblocks=2, trainable_params=12345, steps=10, steps_this_run=4,
                   train_wall_time_s=2.5, tokens_per_second=1234.4, peak_memory_mb=2048.2, final_loss=1.23456,
                   world_size=2, adapter_dir="runs/x/adapter")
    assert summary_line(metrics) == (
        "bdlora train: bdlora r=8 nblocks=2 | 12,345 trainable | step 10 | 4 steps in 2.5 s | 1,234 tok/s | "
        "peak 2,048 MB | final loss 1.2346 | world 2 | adapter -> runs/x/adapter"
    )
    assert "r=8 |" in summary_line({**metrics, "method": "lora", "final_loss": None}) and "final loss n/a" in (
        summary_line({**metrics, "final_loss": None}))
