"""Peak memory of one training step against the context length: attnres next to PyTorch on the
same model and weights, each step in a fresh process whose peak resident set (RSS) is read
from the kernel when it exits.

    cargo build --release
    python scripts/bench/bench_memory.py --attnres target/release/attnres [--seqs 256,512,1024,2048,4096]
        [--batch 1] [--modes standard,block] [--threads 2] [--also OTHER_ATTNRES_BINARY]
        [--recompute]

attnres runs `attnres bench --steps 1 --warmup 0` (one forward + backward); PyTorch runs the
reference implementation (scripts/reference/reference.py, scaled_dot_product_attention, eager) for one
forward, mean cross-entropy and backward. `--also` adds another attnres binary (an older build,
say) as a third column; `--recompute` adds attnres with activation recomputation
(`bench --recompute`) as another. Prints a Markdown table of peak RSS in MiB, and each column's
growth from the shortest context, with the exponent k of growth ~ T^k fitted over the longest
three.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from attnres_run import run_attnres  # noqa: E402


def peak_rss_mib(cmd):
    """Runs `cmd` to completion; returns its peak resident set in MiB."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if status != 0:
        sys.exit(f"failed ({status}): {' '.join(cmd)}\n{err[-2000:]}")
    return usage.ru_maxrss / 1024  # Linux reports KiB


def torch_step(ckpt, batch, seq, threads):
    """The worker: one PyTorch training step on the checkpoint, then exit."""
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
    import reference as ref

    torch.set_num_threads(threads)
    cfg, P = ref.load(ckpt)
    for v in P.values():
        v.requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=gen)
    targets = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=gen)
    ref.loss_fn(ref.forward(P, cfg, ids, sdpa=True), targets).backward()


def exponent(xs, ys):
    """Least-squares slope of log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--attnres", required=True)
    ap.add_argument("--also", help="another attnres binary, measured as a third column")
    ap.add_argument("--recompute", action="store_true", help="also attnres with activation recomputation")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seqs", default="256,512,1024,2048,4096")
    ap.add_argument("--modes", default="standard,block")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--set", action="append", default=[], help="a model setting for both sides")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    seqs = [int(s) for s in a.seqs.split(",")]
    if a.worker:
        torch_step(a.worker, a.batch, seqs[0], a.threads)
        return
    sets = [x for kv in a.set for x in ("--set", kv)]
    sets += ["--set", f"max_position_embeddings={max(seqs)}"]
    tmp = tempfile.mkdtemp()
    rows = {}
    for mode in a.modes.split(","):
        ckpt = os.path.join(tmp, mode)
        run_attnres([a.attnres, "init", "--out", ckpt, "--preset", a.preset, *sets, "--set", f"residual={mode}"])
        for t in seqs:
            print(f"{mode} T={t}", file=sys.stderr)
            bench = ["--threads", str(a.threads), "bench", "--preset", a.preset, *sets, "--modes", mode,
                     "--batch", str(a.batch), "--seq", str(t), "--steps", "1", "--warmup", "0"]
            row = {"attnres": peak_rss_mib([a.attnres, *bench])}
            if a.recompute:
                row["recompute"] = peak_rss_mib([a.attnres, *bench, "--recompute"])
            if a.also:
                row["also"] = peak_rss_mib([a.also, *bench])
            row["torch"] = peak_rss_mib([sys.executable, __file__, "--attnres", a.attnres, "--worker", ckpt,
                                         "--batch", str(a.batch), "--seqs", str(t), "--threads", str(a.threads)])
            rows[(mode, t)] = row
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    print(f"preset {a.preset} ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"{cfg['num_attention_heads']} heads, vocab {cfg['vocab_size']}), batch {a.batch}, {a.threads} threads")
    cols = ["attnres"] + ["recompute"] * a.recompute + ["also"] * bool(a.also) + ["torch"]
    names = {"attnres": "attnres", "recompute": "attnres --recompute", "also": "attnres (--also)",
             "torch": "PyTorch eager"}
    print("| mode | T | " + " | ".join(f"{names[c]} peak RSS (MiB) | growth from T = {seqs[0]}" for c in cols) + " |")
    print("|---|---:|" + "---:|---:|" * len(cols))
    for mode in a.modes.split(","):
        for t in seqs:
            cells = []
            for c in cols:
                v, base = rows[(mode, t)][c], rows[(mode, seqs[0])][c]
                cells += [f"{v:.0f}", f"{v - base:+.0f}"]
            print(f"| {mode} | {t} | " + " | ".join(cells) + " |")
        if len(seqs) >= 4:
            fit = seqs[-3:]
            ks = []
            for c in cols:
                growth = [rows[(mode, t)][c] - rows[(mode, seqs[0])][c] for t in fit]
                ks.append(f"{exponent(fit, growth):.2f}" if all(g > 0 for g in growth) else "–")
            # Each exponent under its column's growth.
            print(f"| {mode} | growth ~ T^k, k over T = {fit[0]}…{fit[-1]} |"
                  + "".join(f"  | {k} |" for k in ks))


if __name__ == "__main__":
    main()
