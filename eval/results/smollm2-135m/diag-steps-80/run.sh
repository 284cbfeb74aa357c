#!/usr/bin/env bash
# Diagnostic, not a tuning run: does BD-LoRA's matched-budget perplexity gap on news-ppl shrink with longer
# training? Same recipe as the main run (../run.sh) for every method, seed 0, LoRA rank 8, but 80 steps
# instead of 40 (the calibration recipe's length).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
OUT=runs/diag-steps-80
DEST=eval/results/smollm2-135m/diag-steps-80
start=$(date +%s)
.venv/bin/bdlora compare --model embedded --task news-ppl --lora-ranks 8 --seeds 1 --steps 80 --no-base \
    --set per_device_train_batch_size=4 --limit 15 --threads auto --out "$OUT" --quiet > /dev/null
echo "wall_s=$(( $(date +%s) - start ))"
cp "$OUT"/results.json "$OUT"/results.md "$OUT"/pareto.png "$DEST"/
