#!/usr/bin/env bash
# Diagnostics for BD-LoRA's news-ppl perplexity gap at 0.90x LoRA's parameters (seed 0; see ../README.md).
# Every sweep uses the main run's recipe (../run.sh: 80 steps, batch 4, alpha = 2r, warm-up 10% then linear
# decay, validation_fraction=0.05) and changes one thing, for every method it applies to.
#   step-size: 10 steps, every combination of bd_lr_ratio {1, 3} x use_rslora {false, true} at lr 1e-3, scored
#              on 1 article only (--limit 1): not a quality run, it only records how far each adapter moved each
#              layer in its first 10 steps (update_norms.py -> step_size.json).
#   ratio1:    BD-LoRA r=12 at lr 1e-3, bd_lr_ratio 1 (the default until 2026-12-01): the gap at 80 steps, against LoRA r=8 at lr 1e-3
#              (../news-ppl/records/news-ppl-lora-r8-s0-learning_rate=0.001.json, same recipe and data).
#   ratio3:    bd_lr_ratio=3 (block-diagonal factor at 3x the learning rate), BD-LoRA r=12 at lr 1e-3.
#   analogies-ratio3: the same on analogies (batch 16, the calibration recipe), against ../analogies (seed 0).
# Resumable like every `bdlora compare` (runs/diag-smollm2-135m/<name>/runs/*/record.json).
# Usage: eval/results/smollm2-135m-tuned/diag/run.sh [name ...]   (default: all, in the order above)
set -euo pipefail
cd "$(dirname "$0")/../../../.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-.venv/bin/python}
OUT=runs/diag-smollm2-135m
DEST=eval/results/smollm2-135m-tuned/diag
BASE=(--model embedded --task news-ppl --lora-ranks 8 --seeds 1 --no-base --threads 1 --quiet
      --set per_device_train_batch_size=4 bd_lr_ratio=1 --task-option validation_fraction=0.05)
copy() {
    local name=$1
    mkdir -p "$DEST/$name/records"
    cp "$OUT/$name"/results.json "$OUT/$name"/results.md "$OUT/$name"/*.png "$DEST/$name"/
    for rec in "$OUT/$name"/runs/*/record.json; do cp "$rec" "$DEST/$name/records/$(basename "$(dirname "$rec")").json"; done
}
run() {
    local name=$1; shift
    local start=$(date +%s)
    "$PY" -m bdlora_train.cli compare "${BASE[@]}" "$@" --out "$OUT/$name" > /dev/null
    copy "$name"
    echo "$name done $(date -u +%FT%TZ) wall_s=$(( $(date +%s) - start ))"
}
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(step-size ratio1 ratio3 analogies-ratio3)
for name in "${names[@]}"; do
    case $name in
        step-size)
            run step-size --steps 10 --limit 1 --methods lora bdlora=matched --lr-grid 1e-3 \
                --grid bd_lr_ratio=1,3 use_rslora=false,true
            "$PY" "$DEST/update_norms.py" "$DEST/step-size/step_size.json" "$OUT"/step-size/runs/* ;;
        ratio1) run ratio1 --steps 80 --methods bdlora=matched --lr-grid 1e-3 ;;
        ratio3) run ratio3 --steps 80 --methods bdlora=matched --lr-grid 1e-3 --grid bd_lr_ratio=3 ;;
        analogies-ratio3)
            "$PY" -m bdlora_train.cli compare --task analogies --seeds 1 --model embedded --lora-ranks 8 --steps 80 \
                --methods bdlora=matched --lr-grid 1e-3 --grid bd_lr_ratio=3 --no-base --threads 1 --quiet \
                --out "$OUT/analogies-ratio3" > /dev/null
            copy analogies-ratio3 ;;
        *) echo "unknown diagnostic $name" >&2; exit 1 ;;
    esac
done
