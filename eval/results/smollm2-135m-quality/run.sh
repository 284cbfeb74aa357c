#!/usr/bin/env bash
# Quality per parameter on the embedded SmolLM2-135M (nblocks 3): each method at the toolkit defaults and at its
# validation-best setting, 3 seeds, on analogies and news-ppl. One task per invocation (two can run side by side):
#   eval/results/smollm2-135m-quality/run.sh analogies
#   eval/results/smollm2-135m-quality/run.sh news-ppl
#   eval/results/smollm2-135m-quality/run.sh copy      # copy finished records next to this script (any time)
# then `python eval/results/smollm2-135m-quality/verdict.py` writes verdict.md / verdict.json from the copies.
#
# Adapters: LoRA r=8, BD-LoRA r=12 (0.90x its parameters), BD-LoRA r=24 (1.79x), then LoRA r=16 (BD r=24 is 0.90x
# of it). Recipe: compare.DEFAULT_RECIPE (batch 16, warm-up 10% then linear decay, alpha = 2r, 7 projections, no
# rsLoRA) with these changes to fit 2 shared CPU cores: 40 steps (not 80); news-ppl at batch 4 (its passages are
# ~6x longer than an analogy question) and scored on 15 of its 30 test and 15 of its 30 validation articles
# (--limit 15); analogies on all 280 test / 280 validation questions.
#   tuned/    grid on seed 0 (--grid-seeds 1): learning_rate {1e-3, 3e-3} x the method's own factor ratio —
#             LoRA: loraplus_lr_ratio {1, 3} (LoRA+), BD-LoRA: bd_lr_ratio {1, auto = nblocks = 3}; 4 points each,
#             chosen per adapter on validation; seeds 1 and 2 train the chosen setting only.
#   defaults/ seeds 1 and 2 at the defaults (lr 1e-3; LoRA plain; BD-LoRA at bd_lr_ratio 1 and auto); seed 0 of
#             the defaults is tuned/'s lr=1e-3 point (the same recipe), so verdict.py joins the two.
# Resumable: re-running skips finished runs (runs/quality-smollm2-135m/<task>/{tuned,defaults}/runs/*/record.json);
# in a fresh checkout it first puts the committed records back there (restore), so only missing runs train.
# PY=/path/to/python picks the interpreter; OUT and DEST move the run and result directories.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE/../../.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/quality-smollm2-135m}
DEST=${DEST:-eval/results/smollm2-135m-quality}

copy() {  # results without adapter weights, next to this script
    local task dir rec
    for task in analogies news-ppl; do
        for dir in tuned defaults; do
            [ -d "$OUT/$task/$dir/runs" ] || continue
            mkdir -p "$DEST/$task/$dir/records"
            for f in results.json results.md pareto.png val_curves.png; do
                [ -f "$OUT/$task/$dir/$f" ] && cp "$OUT/$task/$dir/$f" "$DEST/$task/$dir/"
            done
            for rec in "$OUT/$task/$dir"/runs/*/record.json; do
                [ -f "$rec" ] && cp "$rec" "$DEST/$task/$dir/records/$(basename "$(dirname "$rec")").json"
            done
        done
    done
}

restore() {  # the committed records back into the sweep's run directories (compare skips a run with a record)
    local task dir rec run
    for task in analogies news-ppl; do
        for dir in tuned defaults; do
            for rec in "$DEST/$task/$dir"/records/*.json; do
                [ -f "$rec" ] || continue
                run="$OUT/$task/$dir/runs/$(basename "$rec" .json)"
                [ -f "$run/record.json" ] || { mkdir -p "$run" && cp "$rec" "$run/record.json"; }
            done
        done
    done
}

task=${1:?usage: run.sh analogies|news-ppl|copy}
if [ "$task" = copy ]; then copy; exit 0; fi
restore
extra=()
[ "$task" = news-ppl ] && extra=(--set per_device_train_batch_size=4 --limit 15)
COMMON=(--model embedded --task "$task" --steps 40 --threads 1 --quiet "${extra[@]}")
RATIOS=(--grid loraplus_lr_ratio=1,3 bd_lr_ratio=1,auto --grid-seeds 1)
TUNED=(--lr-grid 1e-3 3e-3 "${RATIOS[@]}")
DEFAULTS=(--grid bd_lr_ratio=1,auto --seed-offset 1 --seeds 2)
compare() { "$PY" -m bdlora_train.cli compare "${COMMON[@]}" "$@" > /dev/null; copy; }
start=$(date +%s)
stamp() { echo "$task $1 done $(date -u +%FT%TZ) elapsed_s=$(( $(date +%s) - start ))"; }
echo "$task start $(date -u +%FT%TZ)"
# Most important first, each phase complete (tuned seed 0 grid, defaults seeds 1-2, tuned seeds 1-2) before the next:
# 1. the 0.90x budget: LoRA r=8 and BD-LoRA r=12
compare --lora-ranks 8 --methods lora bdlora=matched "${TUNED[@]}" --seeds 1 --out "$OUT/$task/tuned"; stamp "r12 tuned seed 0 grid"
compare --lora-ranks 8 --methods lora bdlora=matched "${DEFAULTS[@]}" --out "$OUT/$task/defaults"; stamp "r12 defaults seeds 1-2"
compare --lora-ranks 8 --methods lora bdlora=matched "${TUNED[@]}" --seeds 3 --out "$OUT/$task/tuned"; stamp "r12 tuned seeds 1-2"
# 2. the 1.79x budget: BD-LoRA r=24, its defaults on all seeds first (the lr=1e-3 points of tuned/ are the same
#    runs, run ids and fingerprint as the full grid's), then the rest of its grid and its chosen setting
LR1=(--lr-grid 1e-3 "${RATIOS[@]}")
compare --lora-ranks 8 --methods lora bdlora "${LR1[@]}" --seeds 1 --out "$OUT/$task/tuned"; stamp "r24 seed 0 at lr 1e-3"
compare --lora-ranks 8 --methods lora bdlora "${DEFAULTS[@]}" --out "$OUT/$task/defaults"; stamp "r24 defaults seeds 1-2"
compare --lora-ranks 8 --methods lora bdlora "${TUNED[@]}" --seeds 1 --out "$OUT/$task/tuned"; stamp "r24 tuned seed 0 grid"
compare --lora-ranks 8 --methods lora bdlora "${TUNED[@]}" --seeds 3 --out "$OUT/$task/tuned"; stamp "r24 tuned seeds 1-2"
# 3. LoRA r=16 (its matched BD-LoRA is r=24, already trained)
compare --lora-ranks 8 16 --methods lora bdlora=matched "${TUNED[@]}" --seeds 3 --out "$OUT/$task/tuned"; stamp "r16 tuned"
compare --lora-ranks 8 16 --methods lora bdlora=matched "${DEFAULTS[@]}" --out "$OUT/$task/defaults"; stamp "r16 defaults"
echo "$task end $(date -u +%FT%TZ) wall_s=$(( $(date +%s) - start ))"
