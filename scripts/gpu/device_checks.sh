#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, run on a GPU machine from binaries built elsewhere
# (docs/gpu.md): what the machine has, every kernel compiled for its GPU, the tests marked
# "needs an NVIDIA GPU" (every GPU kernel against the CPU's, a training pass and steps against
# the CPU engine, a 300-step run beside the CPU's whose checkpoints move between them), then
# the GPU benchmark beside the PyTorch anchor when BIN_DIR holds torch_anchor.py.
#
#   scripts/gpu/device_checks.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds `attnres` and `lib-tests`, the library's test binary (`cargo test --release --lib
# --no-run` prints its path); the logs go to OUT_DIR. NVRTC and cuBLASLt come from PyTorch's
# CUDA wheels (site-packages/nvidia/cu13/lib). BENCH="--batch 16 --seq 2048 ..." overrides the
# benchmark's shape. Exits non-zero when a check fails, after running all.
set -uo pipefail
bin="$(cd "$1" && pwd)"; out="$2"
mkdir -p "$out"
lib="$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null)"
[ -n "$lib" ] && export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
step() { echo "== $1 ($(date +%T))"; }
step device
"$bin/attnres" device > "$out/device.txt" 2>&1 || status=1
arch="$(grep -o 'sm_[0-9a-z]*' "$out/device.txt" | head -1)"
step compile
"$bin/attnres" device --compile-for "${arch:-sm_90}" > "$out/compile.txt" 2>&1 || status=1
step "GPU tests"
# The run test trains the tiny preset, whose tokenizer is trained once and cached under HOME.
(cd "$out" && "$bin/lib-tests" --ignored --test-threads 1 gpu:: > gpu-tests.txt 2>&1) || status=1
step bench
# The anchor's shape: hidden 1024, 24 layers, 16 heads, FFN 2816, vocabulary 49152, Block
# AttnRes with 8 blocks.
shape="--preset small --set hidden_size=1024 --set num_hidden_layers=24 \
--set num_attention_heads=16 --set num_key_value_heads=16 --set head_dim=64 \
--set intermediate_size=2816 --set vocab_size=49152 --set max_position_embeddings=2048 \
--set num_blocks=8"
timeout 400 "$bin/attnres" bench --device cuda $shape ${BENCH:---batch 4 --seq 2048 --steps 3} \
    --modes standard,block,full > "$out/bench.txt" 2>&1 || status=1
if [ -f "$bin/torch_anchor.py" ]; then
    step "PyTorch anchor"
    SHAPE=1024,24,16,16,2816,49152,2048 BATCH=16 timeout 400 python3 "$bin/torch_anchor.py" \
        standard:c block2:c > "$out/anchor.txt" 2>&1 || status=1
fi
cat "$out/device.txt" "$out/compile.txt"
tail -25 "$out/gpu-tests.txt"
cat "$out/bench.txt"
[ -f "$out/anchor.txt" ] && tail -15 "$out/anchor.txt"
exit $status
