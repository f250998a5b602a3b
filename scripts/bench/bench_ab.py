#!/usr/bin/env python3
"""Two builds or settings of `attnres bench`, side by side: runs A and B in alternating order
(A B, B A, A B, ...) for a number of pairs and prints, per residual mode, the median over pairs
of B's step time over A's (the median step and the fastest step of each run), with the range.
The machines are shared and their speed moves by tens of percent from minute to minute; a ratio
taken within each pair is what survives that.

  python scripts/bench/bench_ab.py --a "ATTNRES_GEMM=crate target/release/attnres" \
      --b "target/release/attnres" --pairs 8 -- --modes standard,block --steps 2

Each side is a command line: leading NAME=VALUE words set environment variables. Everything
after `--` goes to `bench` on both sides (`--json` is added).
"""
import argparse
import json
import os
import shlex
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
from attnres_run import run_attnres  # noqa: E402


def run(side, bench_args):
    words = shlex.split(side)
    env = dict(os.environ)
    while words and "=" in words[0] and not words[0].startswith("-"):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if not words:
        sys.exit(f"bench_ab: no command in {side!r}")
    return json.loads(run_attnres(words + ["bench", "--json"] + bench_args, env=env).stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="command line of side A")
    ap.add_argument("--b", required=True, help="command line of side B")
    ap.add_argument("--pairs", type=int, default=6)
    args, rest = ap.parse_known_args()
    bench_args = rest[1:] if rest[:1] == ["--"] else rest
    ratios = {}
    for i in range(args.pairs):
        order = [("a", args.a), ("b", args.b)]
        if i % 2:
            order.reverse()
        got = {name: run(side, bench_args) for name, side in order}
        line = []
        for ma, mb in zip(got["a"]["modes"], got["b"]["modes"]):
            key = ma["residual"] + (str(ma["num_blocks"]) if ma["residual"] == "block" else "")
            r = ratios.setdefault(key, {"median": [], "fastest": []})
            r["median"].append(mb["step_seconds"] / ma["step_seconds"])
            r["fastest"].append(mb["fastest_step_seconds"] / ma["fastest_step_seconds"])
            line.append(f'{key} {ma["step_seconds"]*1e3:.0f} -> {mb["step_seconds"]*1e3:.0f} ms')
        peaks = f'peak A {got["a"]["matmul_peak_gflops"]:.0f}, B {got["b"]["matmul_peak_gflops"]:.0f} GFLOP/s'
        print(f"pair {i + 1}/{args.pairs}: " + ", ".join(line) + f" ({peaks})", flush=True)
    print("\n| mode | B / A, median step (range) | B / A, fastest step (range) | pairs |")
    print("|---|---:|---:|---:|")
    for key, r in ratios.items():
        cells = [
            f"{statistics.median(v):.3f}x ({min(v):.3f}–{max(v):.3f})"
            for v in (r["median"], r["fastest"])
        ]
        print(f"| {key} | {cells[0]} | {cells[1]} | {len(r['median'])} |")


if __name__ == "__main__":
    main()
