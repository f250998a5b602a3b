#!/usr/bin/env bash
# SmolLM2-135M-Instruct kept standard versus upcycled to Block AttnRes (6 blocks of 10
# sublayers), both continued on the embedded Shakespeare corpus with the same tokens, data order
# and settings (docs/results.md, "Continuing a pretrained model"). Resumable: run it again after
# a kill and each run continues from its last checkpoint.
#
#   scripts/bench/upcycle_experiment.sh [WORKDIR]    (default /tmp/upcycle; ATTNRES: the binary)
#
# SEED=N (default 0) changes the data order (the same for both models): its runs go to
# run-standard-seedN and run-block6-seedN, without samples.
set -euo pipefail
ATTNRES=${ATTNRES:-target/release/attnres}
WORK=${1:-/tmp/upcycle}
GGUF=${GGUF:-$HOME/.cache/attnres-import/model/SmolLM2-135M-Instruct.Q4_1.gguf}
mkdir -p "$WORK"

[ -f "$WORK/smol/model.safetensors" ] || "$ATTNRES" import --from "$GGUF" --out "$WORK/smol" --force
[ -f "$WORK/smol-block6/model.safetensors" ] ||
    "$ATTNRES" convert --model "$WORK/smol" --set residual=block --set num_blocks=6 \
        --out "$WORK/smol-block6" --force

# 24 steps of 512 tokens (4 sequences of 128): 12,288 training tokens per model; validation on
# the first 1,024 tokens of the validation split every 4 steps, and before the first step.
SETTINGS=(--set optimizer=adamw --set lr=3e-4 --set warmup_steps=4 --set min_lr_ratio=0.1
    --set weight_decay=0 --set seq_len=128 --set micro_batch=4 --set batch_tokens=512
    --set max_tokens=12288 --set eval_every=4 --set eval_tokens=1024 --set checkpoint_every=4
    --set seed=${SEED:-0})
SUFFIX=""
[ "${SEED:-0}" = 0 ] || SUFFIX="-seed$SEED"

train() { # NAME INIT
    local out="$WORK/run-$1$SUFFIX"
    local resume=()
    [ -f "$out/ckpt/train_state.json" ] && resume=(--resume)
    "$ATTNRES" train --init "$2" --out "$out" --no-progress "${SETTINGS[@]}" "${resume[@]}"
}
train standard "$WORK/smol" > "$WORK/standard$SUFFIX.log" 2>&1 &
train block6 "$WORK/smol-block6" > "$WORK/block6$SUFFIX.log" 2>&1 &
wait

# A larger held-out measurement than the runs' own: the first 20,000 characters of All's Well
# That Ends Well (the 20th play, held out), in windows of 128 tokens as trained.
[ -f "$WORK/allswell.txt" ] || python3 -c '
import gzip, sys
plays = gzip.open(sys.argv[1]).read().decode().replace("\r\n", "\n").split("\n\n\n")
plays = [p.strip("\n") for p in plays if p.strip()]
sys.stdout.write(plays[19][:20000])' data/shakespeare.txt.gz > "$WORK/allswell.txt"
for model in smol run-standard$SUFFIX run-block6$SUFFIX; do
    [ -f "$WORK/eval-$model.json" ] ||
        "$ATTNRES" eval --model "$WORK/$model" --text "$WORK/allswell.txt" --seq 128 --json \
            > "$WORK/eval-$model.json"
done
[ -z "$SUFFIX" ] || exit 0

# Held-out samples: openings of speeches from the validation plays (Henry IV Part 1, All's Well
# That Ends Well, Cymbeline), continued greedily.
PROMPTS=($'MORTIMER:\nThese promises are fair, the parties sure,\n'
    $'BERTRAM:\nThis very day,\nGreat Mars, I put myself into thy file:\n'
    $'CLOTEN:\nReceive it friendly; but from this time forth\n')
for model in smol run-standard run-block6; do
    for p in "${PROMPTS[@]}"; do
        "$ATTNRES" generate --model "$WORK/$model" --prompt "$p" --temperature 0 --max-tokens 40
        echo "----"
    done > "$WORK/samples-$model.txt" 2>> "$WORK/samples.log"
done
