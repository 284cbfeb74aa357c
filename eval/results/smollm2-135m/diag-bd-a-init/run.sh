#!/usr/bin/env bash
# Diagnostic, not a tuning run: is BD-LoRA's small perplexity gap on news-ppl due to the init scale of the
# block-diagonal A factor (o_proj, down_proj)? PEFT draws it kaiming-uniform(a=0) over fan_in d_in/nblocks,
# sqrt(6*nblocks) = 4.2x the vanilla LoRA A bound at nblocks 3; bd_a_init=lora draws it like vanilla LoRA's A.
# Same recipe, data, seed 0 and steps as the main run (../run.sh); only bd_a_init differs. LoRA r=8 ignores
# bd_a_init, so its score here must equal the main run's LoRA r=8 seed 0: a determinism check.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
OUT=runs/diag-bd-a-init
DEST=eval/results/smollm2-135m/diag-bd-a-init
start=$(date +%s)
.venv/bin/bdlora compare --model embedded --task news-ppl --lora-ranks 8 --seeds 1 --steps 40 --no-base \
    --set per_device_train_batch_size=4 bd_a_init=lora --limit 15 --threads auto --out "$OUT" --quiet > /dev/null
echo "wall_s=$(( $(date +%s) - start ))"
cp "$OUT"/results.json "$OUT"/results.md "$OUT"/pareto.png "$DEST"/
