#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, run on a GPU machine from binaries built elsewhere
# (docs/gpu.md): what the machine has, every kernel compiled for its GPU, the tests marked
# "needs an NVIDIA GPU" (every GPU kernel against the CPU's, a training pass and steps against
# the CPU engine, 300-step runs beside the CPU's whose checkpoints move between them), the GPU
# benchmark of each residual, and beside it PyTorch: scripts/bench/gpu_torch.py (our baseline)
# and the anchor, when BIN_DIR holds them.
#
#   scripts/gpu/device_checks.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds `attnres` and `lib-tests`, the library's test binary (`cargo test --release --lib
# --no-run` prints its path), and optionally scripts/bench/gpu_torch.py and torch_anchor.py; the
# logs go to OUT_DIR. NVRTC and cuBLASLt come from PyTorch's CUDA wheels
# (site-packages/nvidia/cu13/lib). PARTS chooses what runs (default "device tests bench baseline
# anchor"; "fp32" adds the exact mode's benchmark); BENCH="--batch 8 --seq 2048 ..." overrides
# the benchmark's shape; TEST_TIMEOUT (seconds, default 300) bounds each GPU test, whose verdicts
# go to OUT_DIR/gpu-tests-summary.txt. Exits non-zero when a check fails, after running all. On
# a rerun after a failure, CUDA_LAUNCH_BLOCKING=1 makes a fault show at the launch that made it.
set -uo pipefail
bin="$(cd "$1" && pwd)"; out="$2"
mkdir -p "$out"
parts=" ${PARTS:-device tests bench baseline anchor} "
lib="$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null)"
[ -n "$lib" ] && export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
step() { echo "== $1 ($(date +%T))"; }
want() { [[ "$parts" == *" $1 "* ]]; }
if want device; then
    step device
    "$bin/attnres" device > "$out/device.txt" 2>&1 || status=1
    arch="$(grep -o 'sm_[0-9a-z]*' "$out/device.txt" | head -1)"
    "$bin/attnres" device --compile-for "${arch:-sm_90}" > "$out/compile.txt" 2>&1 || status=1
    cat "$out/device.txt" "$out/compile.txt"
fi
if want tests; then
    step "GPU tests"
    # One process per test under its own time limit, so that a hang costs one test and not the
    # call; the 300-step runs last. The run test trains the tiny preset, whose tokenizer is
    # trained once and cached under HOME.
    tests="$("$bin/lib-tests" --ignored --list on_the_gpu 2>/dev/null | sed -n 's/: test$//p' \
        | awk '/tiny_run/ { last = last $0 "\n"; next } { print } END { printf "%s", last }')"
    : > "$out/gpu-tests.txt"
    for t in $tests; do
        start=$SECONDS
        (cd "$out" && timeout "${TEST_TIMEOUT:-300}" "$bin/lib-tests" --ignored --exact "$t" \
            >> gpu-tests.txt 2>&1)
        rc=$?
        case $rc in 0) verdict=ok ;; 124) verdict="TIMED OUT" ;; *) verdict="FAILED (exit $rc)" ;; esac
        [ $rc -eq 0 ] || status=1
        echo "$verdict  $((SECONDS - start)) s  $t" | tee -a "$out/gpu-tests-summary.txt"
    done
fi
# The anchor's shape: hidden 1024, 24 layers, 16 heads, FFN 2816, vocabulary 49152, Block
# AttnRes with 8 blocks, batch 16 x 2048 in bf16 (fp32, the exact mode, at batch 4 with "fp32"
# in PARTS).
shape="--preset small --set hidden_size=1024 --set num_hidden_layers=24 \
--set num_attention_heads=16 --set num_key_value_heads=16 --set head_dim=64 \
--set intermediate_size=2816 --set vocab_size=49152 --set max_position_embeddings=2048 \
--set num_blocks=8"
if want bench; then
    step bench
    timeout 400 "$bin/attnres" bench --device cuda $shape ${BENCH:---batch 16 --seq 2048 --steps 3} \
        --modes standard,block,full --profile > "$out/bench.txt" 2>&1 || status=1
    cat "$out/bench.txt"
    # The attention forward with 16 rows a warp (docs/gpu-internals.md) beside its own: the
    # two profiles' flash_forward lines time the one against the other.
    ATTNRES_FLASH_WARP_ROWS=16 timeout 200 "$bin/attnres" bench --device cuda $shape \
        ${BENCH:---batch 16 --seq 2048 --steps 3} --modes standard --profile \
        > "$out/bench-warp16.txt" 2>&1 || status=1
    grep -h flash_forward "$out/bench.txt" "$out/bench-warp16.txt"
fi
if want fp32; then
    step "bench fp32"
    timeout 400 "$bin/attnres" bench --device cuda --precision fp32 $shape --batch 4 --seq 2048 \
        --steps 3 --modes standard,block,full > "$out/bench-fp32.txt" 2>&1 || status=1
    cat "$out/bench-fp32.txt"
fi
if want baseline && [ -f "$bin/gpu_torch.py" ]; then
    step "PyTorch baseline"
    # The bench's bf16 steps under torch.compile, at the same batch.
    timeout 400 python3 "$bin/gpu_torch.py" --precision bf16 --compile --batch 16 \
        --modes standard,block --steps 5 --warmup 3 > "$out/baseline.txt" 2>&1 || status=1
    if want fp32; then
        timeout 300 python3 "$bin/gpu_torch.py" --precision fp32 --batch 4 --steps 3 --warmup 1 \
            >> "$out/baseline.txt" 2>&1 || status=1
    fi
    cat "$out/baseline.txt"
fi
if want anchor && [ -f "$bin/torch_anchor.py" ]; then
    step "PyTorch anchor"
    SHAPE=1024,24,16,16,2816,49152,2048 BATCH=16 timeout 400 python3 "$bin/torch_anchor.py" \
        standard:c block2:c > "$out/anchor.txt" 2>&1 || status=1
    tail -15 "$out/anchor.txt"
fi
exit $status
