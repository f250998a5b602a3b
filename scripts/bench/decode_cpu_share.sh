#!/bin/sh
# Where the CPU time of decoding goes: `perf record` over `attnres bench --generate` (a prompt of
# 8 tokens, then 256 decoded at batch 1), its samples sorted by function into the compute
# kernels, the thread pool's waiting between products (yielding, sleeping, waking), page faults
# and the rest (allocation, copies, bookkeeping). Needs Linux `perf`.
#
#   scripts/bench/decode_cpu_share.sh target/release/attnres CHECKPOINT_DIR
set -eu
attnres=$1
checkpoint=$2
data=$(mktemp)
trap 'rm -f "$data"' EXIT
perf record -q -o "$data" "$attnres" bench --generate --checkpoint "$checkpoint" --batches 1 \
    --prompt-tokens 8 --new-tokens 256 --steps 4 --warmup 0 >/dev/null 2>&1
perf report -i "$data" --no-children --stdio --sort sym 2>/dev/null | awk '
    /%/ {
        p = $1; sub("%", "", p)
        if ($0 ~ /sched|yield|futex|syscall|wait_until|switch|idle|pick_next|finish_task|raw_spin|update_curr|dequeue|enqueue|hrtimer|rcu|tick/) wait += p
        else if ($0 ~ /group_dot|dot_q8|dot_f16|dot_f32|scores_|mixes_|simd::|rmsnorm|swiglu|rope|attention|matmul::x86|tile_/) kern += p
        else if ($0 ~ /clear_page|page_fault|handle_mm|anonymous|folio|read_bandwidth/) fault += p
        else rest += p
    }
    END { printf "kernels %.1f%%, pool waiting %.1f%%, page faults %.1f%%, the rest %.1f%%\n", kern, wait, fault, rest }'
