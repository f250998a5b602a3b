"""Side-by-side training-step benchmark: attnres against PyTorch eager on the same shapes,
weights and thread count, in one run.

    cargo build --release
    python scripts/bench_compare.py --attnres target/release/attnres [--threads 2] [--rounds 2]

PyTorch runs the reference implementation (scripts/reference.py, scaled_dot_product_attention)
for every mode, and transformers' LlamaForCausalLM (sdpa) for `standard`. One step is forward,
mean cross-entropy and backward, in f32. Rounds alternate PyTorch and attnres; times are
medians over rounds of per-round medians, and each speed-up is the median of the per-round ratios
(its range over rounds beside it).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import reference as ref  # noqa: E402

MODES = ["standard", "block", "full"]


def time_steps(step, warmup, steps):
    for _ in range(warmup):
        step()
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def torch_round(ckpts, ids, targets, warmup, steps):
    out = {}
    for mode, ck in ckpts.items():
        cfg, P = ref.load(ck)
        for v in P.values():
            v.requires_grad_(True)

        def step():
            loss = ref.loss_fn(ref.forward(P, cfg, ids, sdpa=True), targets)
            loss.backward()
            for v in P.values():
                v.grad = None

        out[mode] = time_steps(step, warmup, steps)
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(ckpts["standard"], dtype=torch.float32, attn_implementation="sdpa")
    hf.train()

    def hf_step():
        loss = ref.loss_fn(hf(input_ids=ids).logits, targets)
        loss.backward()
        hf.zero_grad(set_to_none=True)

    out["hf_standard"] = time_steps(hf_step, warmup, steps)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--attnres", required=True)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tmp = tempfile.mkdtemp()
    ckpts = {}
    for mode in MODES:
        ckpts[mode] = os.path.join(tmp, mode)
        subprocess.run([a.attnres, "init", "--out", ckpts[mode], "--preset", a.preset, "--set", f"residual={mode}"],
                       check=True, stderr=subprocess.DEVNULL)
    cfg = json.load(open(os.path.join(ckpts["block"], "config.json")))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (a.batch, a.seq), generator=gen)
    targets = torch.randint(0, cfg["vocab_size"], (a.batch, a.seq), generator=gen)
    rounds_t, rounds_r, report = [], [], None
    for r in range(a.rounds):
        print(f"round {r + 1}/{a.rounds}: PyTorch", file=sys.stderr)
        rounds_t.append(torch_round(ckpts, ids, targets, a.warmup, a.steps))
        print(f"round {r + 1}/{a.rounds}: attnres", file=sys.stderr)
        res = subprocess.run([a.attnres, "--threads", str(a.threads), "bench", "--json", "--preset", a.preset,
                              "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps),
                              "--warmup", str(a.warmup), "--modes", ",".join(MODES)],
                             check=True, capture_output=True, text=True)
        report = json.loads(res.stdout)
        rounds_r.append({m["residual"]: m["step_seconds"] for m in report["modes"]})
    med = statistics.median
    n = a.batch * a.seq
    print(f"config: preset {a.preset} ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"{cfg['num_attention_heads']} heads, vocab {cfg['vocab_size']}, block num_blocks {cfg['num_blocks']}), "
          f"batch {a.batch} x seq {a.seq}, {a.threads} threads, torch {torch.__version__}, {a.rounds} rounds")
    print(f"attnres matrix-product peak: {report['matmul_peak_gflops']:.0f} GFLOP/s")
    print("| mode | attnres step (ms) | attnres tokens/s | PyTorch eager step (ms) | speed-up vs PyTorch (range over rounds) | attnres vs its standard |")
    print("|---|---:|---:|---:|---:|---:|")

    def speedup(torch_key, ours_key):
        ratios = sorted(t[torch_key] / r[ours_key] for t, r in zip(rounds_t, rounds_r))
        return f"{med(ratios):.2f}x ({ratios[0]:.2f}–{ratios[-1]:.2f})"

    for m in MODES:
        ours, theirs = med([r[m] for r in rounds_r]), med([t[m] for t in rounds_t])
        rel = med([r[m] / r["standard"] for r in rounds_r])
        print(f"| {m} | {ours * 1e3:.0f} | {n / ours:.0f} | {theirs * 1e3:.0f} | {speedup(m, m)} | {rel:.3f}x |")
    hf = med([t["hf_standard"] for t in rounds_t])
    print(f"| standard (transformers LlamaForCausalLM) | | | {hf * 1e3:.0f} | {speedup('hf_standard', 'standard')} | |")


if __name__ == "__main__":
    main()
