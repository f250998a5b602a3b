#!/usr/bin/env bash
# Runs, in one Python environment of its own (installed from PyPI on first use and kept under
# ~/.cache/attnres-import for later runs while the pinned versions in
# scripts/reference/requirements.txt and llama.cpp's build flags, below, are unchanged; the
# file's comments do not count):
# - scripts/reference/check_import.py: a real GGUF model imported and checked against
#   transformers (docs/import.md), then scripts/reference/check_upcycle.py on the imported model;
# - scripts/reference/check_transformers.py: Block, Full and ablation checkpoints of short runs
#   loaded by transformers through the module they carry (docs/interop.md);
# - scripts/bench/gpu_torch.py --check: the GPU benchmark's PyTorch baseline against the
#   reference model (docs/gpu.md);
# - scripts/reference/check_export.py: GGUF exports run by llama.cpp (llama-cpp-python), of the
#   imported SmolLM2 at f32 and of a short standard run at f32, f16, q8_0, q4_0, q4_1, q5_0 and
#   q5_1 (docs/interop.md);
# - scripts/eval/check_lm_eval.py: lm-eval against `attnres serve` and on transformers, the same
#   accuracy and log-likelihoods, on a short Block run and a short standard run (docs/serving.md).
# Needs python3 with venv and pip, PyPI, and the release build of attnres and of the tokenize
# example (which `cargo test --release` leaves in target/release).
set -euo pipefail
cd "$(dirname "$0")/../.."
cache="${XDG_CACHE_HOME:-$HOME/.cache}/attnres-import"
venv="$cache/venv"
stamp="$venv/.requirements"
mkdir -p "$cache"
pins() { grep -v '^#' "$1" 2>/dev/null; }
# llama.cpp's AMX kernels crash where the processor reports AMX (seen on a virtual Xeon: SIGSEGV
# and SIGILL in ggml_backend_amx_mul_mat on Q8_0 products). There llama-cpp-python is built for
# the same instruction sets without AMX (its own build, not a wheel pip cached from a native one).
llama_cmake=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    flags=" $(grep -m1 '^flags' /proc/cpuinfo) "
    llama_cmake="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 avx512vbmi:AVX512_VBMI \
        avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
        if [[ "$flags" == *" ${pair%%:*} "* ]]; then llama_cmake+=" -DGGML_${pair#*:}=ON"; fi
    done
fi
wanted() { pins scripts/reference/requirements.txt; echo "# llama.cpp: ${llama_cmake:-native}"; }
if ! cmp -s <(wanted) "$stamp"; then
    echo "import check: installing scripts/reference/requirements.txt into $venv (torch from PyPI: a few GB, minutes)"
    rm -rf "$venv"
    python3 -m venv "$venv"
    if [ -n "$llama_cmake" ]; then
        CMAKE_ARGS="$llama_cmake" "$venv/bin/pip" install --quiet --no-cache-dir \
            --disable-pip-version-check "$(grep '^llama-cpp-python==' scripts/reference/requirements.txt)"
    fi
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r scripts/reference/requirements.txt
    wanted > "$stamp"
fi
[ -x target/release/attnres ] || cargo build --release --locked --bin attnres
[ -x target/release/examples/tokenize ] || cargo build --release --locked --example tokenize
# The imported model is kept for scripts/reference/check_upcycle.py (convert to AttnRes keeps
# the function; docs/import.md, "Upcycling").
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" scripts/reference/check_import.py --cache "$cache/model" --keep "$work"
"$venv/bin/python" scripts/reference/check_upcycle.py --model "$work/smollm2" --work "$work/upcycle"
"$venv/bin/python" scripts/reference/check_transformers.py --attnres target/release/attnres
# The GPU benchmark's PyTorch baseline computes the reference's model (docs/gpu.md).
"$venv/bin/python" scripts/bench/gpu_torch.py --check
"$venv/bin/python" scripts/reference/check_export.py --attnres target/release/attnres \
    --model "$work/smollm2" --types f32
target/release/attnres train --preset tiny --set residual=standard --no-progress --out "$work/standard"
"$venv/bin/python" scripts/reference/check_export.py --attnres target/release/attnres \
    --model "$work/standard"
target/release/attnres train --preset tiny --set max_tokens=409600 --no-progress --out "$work/block"
"$venv/bin/python" scripts/eval/check_lm_eval.py --attnres target/release/attnres \
    --model "$work/block" --model "$work/standard" --items 40
