#!/usr/bin/env bash
# QLoRA on the embedded SmolLM2-135M: the base loaded 4-bit NF4 with double quantization (bitsandbytes, CPU,
# fp32 compute), LoRA r=8 vs BD-LoRA nblocks 3 at the matched rank (r=12, 0.90x) and twice it (r=24, 1.79x), seed 0,
# 40 steps, the compare DEFAULT_RECIPE (batch 16, lr 1e-3, warm-up 10% then linear decay, alpha = 2r, 7 projections),
# all 280 held-out questions: the same settings as seed 0 of ../run.sh (the fp32 sweep), so the two compare directly.
# One torch thread on the shared 2-core CPU (1-minute load 9-19 during the run: train s / tok/s are noise).
set -euo pipefail
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
OUT=runs/qlora-smollm2/analogies
DEST=eval/results/smollm2-135m/qlora-analogies
start=$(date +%s)
echo "start $(date -u +%FT%TZ)"
.venv/bin/bdlora compare --model embedded --task analogies --lora-ranks 8 --seeds 1 --steps 40 \
    --set load_in_4bit=true bnb_4bit_use_double_quant=true --threads 1 --out "$OUT" --quiet
echo "rc $? end $(date -u +%FT%TZ) wall_s=$(( $(date +%s) - start ))"
mkdir -p "$DEST/records"
cp "$OUT"/results.json "$OUT"/results.md "$OUT"/pareto.png "$DEST"/
for rec in "$OUT"/runs/*/record.json; do cp "$rec" "$DEST/records/$(basename "$(dirname "$rec")").json"; done
