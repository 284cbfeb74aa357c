#!/usr/bin/env bash
# The seed-0 analogies sweep committed in ./analogies: LoRA r=8, the toolkit's BD-LoRA at r=12 (0.90x LoRA's
# parameters) and r=24 (1.79x), stock PEFT's BD-LoRA at r=12, each at its own learning rate chosen on the
# validation split from {1e-3, 3e-3}; 80 steps, calibration recipe (batch 16, warm-up 10%, alpha = 2r), nblocks 3.
# Run on commit a3a7b25 (before compare's per-seed row selection, evaluation/per_run.py): a rerun on later code
# trains each seed on other rows of the same task and lands within seed noise, not on the same digits.
# bd_lr_ratio=1: one learning rate for every factor, the default until 2026-12-01 (auto since).
# 95 min on the shared 2-core CPU with other jobs running. Resumable.
# Usage: eval/results/smollm2-135m-tuned/run_seed0.sh  (PY=/path/to/python to use another interpreter)
set -euo pipefail
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-.venv/bin/python}
OUT=runs/tuned-smollm2-135m-seed0/analogies
DEST=eval/results/smollm2-135m-tuned/analogies
"$PY" -m bdlora_train.cli compare --task analogies --seeds 1 --model embedded --lora-ranks 8 --steps 80 \
    --methods lora bdlora peft-bdlora=matched --lr-grid 1e-3 3e-3 --set bd_lr_ratio=1 --threads 1 --quiet --out "$OUT" > /dev/null
mkdir -p "$DEST/records"
cp "$OUT"/results.json "$OUT"/results.md "$OUT"/*.png "$DEST"/
for rec in "$OUT"/runs/*/record.json; do cp "$rec" "$DEST/records/$(basename "$(dirname "$rec")").json"; done
