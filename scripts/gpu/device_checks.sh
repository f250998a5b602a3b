#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, run on a GPU machine from binaries built elsewhere
# (docs/gpu.md): what the machine has, every kernel compiled for its GPU, and the tests marked
# "needs an NVIDIA GPU" (the GPU kernels against the CPU ones).
#
#   scripts/gpu/device_checks.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds `attnres` and `lib-tests`, the library's test binary (`cargo test --release --lib
# --no-run` prints its path); the logs go to OUT_DIR. NVRTC comes from PyTorch's CUDA wheels when
# it is not on the library path already. Exits non-zero when a check fails, after running all.
set -uo pipefail
bin="$1"; out="$2"
mkdir -p "$out"
if ! ldconfig -p 2>/dev/null | grep -q libnvrtc.so.13; then
    lib="$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null)"
    [ -n "$lib" ] && export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
status=0
"$bin/attnres" device > "$out/device.txt" 2>&1 || status=1
arch="$(grep -o 'sm_[0-9a-z]*' "$out/device.txt" | head -1)"
"$bin/attnres" device --compile-for "${arch:-sm_90}" > "$out/compile.txt" 2>&1 || status=1
"$bin/lib-tests" --ignored gpu:: > "$out/gpu-tests.txt" 2>&1 || status=1
cat "$out/device.txt" "$out/compile.txt"
tail -5 "$out/gpu-tests.txt"
exit $status
