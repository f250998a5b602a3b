"""Side-by-side training-step benchmark: attnres against PyTorch (eager, and with --compile
torch.compile) on the same shapes, weights and thread count, in one run.

    cargo build --release
    python scripts/bench/bench_compare.py --attnres target/release/attnres [--threads 2] [--rounds 2]
        [--compile] [--modes standard,block,full] [--set hidden_size=512 --set ...]

PyTorch runs the reference implementation (scripts/reference/reference.py, scaled_dot_product_attention)
for every mode, eager and (--compile) compiled by inductor, and transformers' LlamaForCausalLM
(sdpa, eager) for `standard`. One step is forward,
mean cross-entropy and backward, in f32. Rounds alternate PyTorch and attnres; times are
medians over rounds of per-round medians, and each speed-up is the median of the per-round ratios
(its range over rounds beside it). PyTorch goes first in even rounds and second in odd ones, its
compiled variants always next to attnres, so that the ratio against torch.compile compares steps
taken minutes apart at most and a drift of the machine's speed favours neither side. Above the
table it prints the processor (model, vector extensions, PyTorch's kernel choice) and the
highest and lowest readings of the peak and the FMA ceiling over rounds. Each step's share of the
peak is given twice: against the highest reading of the run (the strictest yardstick: the quietest
moment of the machine against a median step), and against the peak measured right beside it (by
attnres after each of its steps; torch.compile, timed next to attnres, against the median of that
round's), the median over rounds; the second is the one the machine's swings move least.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
import reference as ref  # noqa: E402
from attnres_run import run_attnres  # noqa: E402

MODES = ["standard", "block", "full"]


def machine():
    """The processor as the docs' tables name it: model, family and model numbers, the vector
    extensions that choose the kernels (ours and PyTorch's), and PyTorch's own choice. These
    machines vary, so every table says which one it ran on."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return f"unknown processor; PyTorch kernels {torch.backends.cpu.get_cpu_capability()}"
    flags = set(info.get("flags", "").split())
    wanted = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile"]
    return (f"{info.get('model name', 'unknown processor')} (family {info.get('cpu family', '?')}, "
            f"model {info.get('model', '?')}), {' '.join(x for x in wanted if x in flags) or 'no AVX2'}; "
            f"PyTorch kernels {torch.backends.cpu.get_cpu_capability()}")


def time_steps(step, warmup, steps):
    for _ in range(warmup):
        step()
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def torch_steps(ckpts, ids, targets, compile_):
    """One training-step function per PyTorch variant: the reference in eager mode and, with
    `compile_`, under torch.compile (inductor), and transformers' LlamaForCausalLM for `standard`.
    Built once, so torch.compile's compilation (in the first, untimed warm-up step) is paid once."""
    steps = {}
    for mode, ck in ckpts.items():
        cfg, P = ref.load(ck)
        for v in P.values():
            v.requires_grad_(True)

        def loss_of(ids, targets, P=P, cfg=cfg):
            return ref.loss_fn(ref.forward(P, cfg, ids, sdpa=True), targets)

        def make(fn, P=P):
            def step():
                fn(ids, targets).backward()
                for v in P.values():
                    v.grad = None
            return step

        steps[mode] = make(loss_of)
        if compile_:
            steps[f"compiled_{mode}"] = make(torch.compile(loss_of))
    if "standard" in ckpts:
        from transformers import LlamaForCausalLM

        hf = LlamaForCausalLM.from_pretrained(ckpts["standard"], dtype=torch.float32, attn_implementation="sdpa")
        hf.train()

        def hf_step():
            loss = ref.loss_fn(hf(input_ids=ids).logits, targets)
            loss.backward()
            hf.zero_grad(set_to_none=True)

        steps["hf_standard"] = hf_step
    return steps


def torch_round(steps, warmup, n, compiled_last):
    """Times every PyTorch variant; the compiled ones last (or first), so that they run right
    next to attnres, whose run follows (or precedes) this one."""
    names = sorted(steps, key=lambda k: k.startswith("compiled_") == compiled_last)
    return {name: time_steps(steps[name], warmup, n) for name in names}


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
    ap.add_argument("--set", action="append", default=[], help="a model setting for both sides, e.g. hidden_size=512")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--compile", action="store_true", help="also time the reference under torch.compile (inductor)")
    a = ap.parse_args()
    modes = a.modes.split(",")
    sets = [x for kv in a.set for x in ("--set", kv)]
    torch.set_num_threads(a.threads)
    tmp = tempfile.mkdtemp()
    ckpts = {}
    for mode in modes:
        ckpts[mode] = os.path.join(tmp, mode)
        run_attnres([a.attnres, "init", "--out", ckpts[mode], "--preset", a.preset, *sets, "--set", f"residual={mode}"])
    cfg = json.load(open(os.path.join(ckpts[modes[-1]], "config.json")))
    if a.seq > cfg["max_position_embeddings"]:
        # Checked here, before PyTorch's first round, rather than by `attnres bench` minutes later.
        sys.exit(f"bench_compare: --seq {a.seq} exceeds the model's max_position_embeddings "
                 f"({cfg['max_position_embeddings']}); pass a shorter --seq or --set max_position_embeddings=...")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (a.batch, a.seq), generator=gen)
    targets = torch.randint(0, cfg["vocab_size"], (a.batch, a.seq), generator=gen)
    steps = torch_steps(ckpts, ids, targets, a.compile)
    rounds_t, rounds_r, reports = [], [], []

    def attnres_round():
        out = run_attnres([a.attnres, "--threads", str(a.threads), "bench", "--json", "--preset", a.preset,
                           "--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps),
                           "--warmup", str(a.warmup), "--modes", ",".join(modes), *sets])
        return json.loads(out.stdout)

    for r in range(a.rounds):
        # PyTorch first in even rounds, attnres first in odd ones, so that a drift of the
        # machine's speed over a run favours neither side.
        torch_first = r % 2 == 0
        for side in ["PyTorch", "attnres"] if torch_first else ["attnres", "PyTorch"]:
            print(f"round {r + 1}/{a.rounds}: {side}", file=sys.stderr)
            if side == "PyTorch":
                rounds_t.append(torch_round(steps, a.warmup, a.steps, compiled_last=torch_first))
            else:
                reports.append(attnres_round())
                rounds_r.append({m["residual"]: m["step_seconds"] for m in reports[-1]["modes"]})
    med = statistics.median
    n = a.batch * a.seq
    print(f"config: preset {a.preset} ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"{cfg['num_attention_heads']} heads, MLP {cfg['intermediate_size']}, vocab {cfg['vocab_size']}, "
          f"num_blocks {cfg.get('num_blocks')}), "
          f"batch {a.batch} x seq {a.seq}, {a.threads} threads, torch {torch.__version__}, {a.rounds} rounds")
    # Every round measures the peak and the ceiling again; the highest reading is the one least
    # disturbed by the machine's other work (shared cores make single readings swing by 2x), and
    # the shares of the peak below are taken against it.
    peaks = [r["matmul_peak_gflops"] for r in reports]
    ceilings = [r["fma_ceiling_gflops"] for r in reports if r.get("fma_ceiling_gflops")]
    peak, ceiling = max(peaks), max(ceilings, default=0)
    print(f"machine: {machine()}")
    print(f"attnres matrix-product peak, highest of {len(reports)} rounds: {peak:.0f} GFLOP/s "
          f"(lowest {min(peaks):.0f})"
          + (f"; FMA ceiling of {a.threads} threads: {ceiling:.0f} GFLOP/s (lowest {min(ceilings):.0f})"
             if ceiling else ""))
    compiled = "compiled_standard" in rounds_t[0]
    head = "| mode | attnres step (ms) | attnres tokens/s | PyTorch eager step (ms) | vs eager (range over rounds) |"
    if compiled:
        head += " torch.compile step (ms) | vs torch.compile (range) |"
    head += " attnres vs its standard | attnres GFLOP/s (% of highest peak; of peak beside it) |"
    if compiled:
        head += " torch.compile GFLOP/s (% of highest peak; of peak beside it) |"
    # Useful FLOPs of one step (the products and attention, as `attnres bench` counts them).
    flops = {m["residual"]: m["gflops"] * 1e9 * m["step_seconds"] for m in reports[-1]["modes"]}

    def rate(seconds, m, beside):
        g = flops[m] / seconds / 1e9
        return f"{g:.0f} ({100 * g / peak:.0f}%; {100 * beside:.0f}%)"

    def of_peak_beside(m):
        """Median over rounds of each round's shares of the peak measured beside its steps: attnres's
        as `bench` reports it, torch.compile's against the median of the same round's peaks."""
        ours = med([next(x for x in rep["modes"] if x["residual"] == m)["share_of_adjacent_peak"]
                    for rep in reports])
        if not compiled:
            return ours, None
        theirs = []
        for t, rep in zip(rounds_t, reports):
            peaks = [p for x in rep["modes"] for p in x["adjacent_peaks_gflops"]]
            theirs.append(flops[m] / t[f"compiled_{m}"] / 1e9 / med(peaks))
        return ours, med(theirs)

    print(head)
    print("|---|" + "---:|" * (head.count("|") - 2))

    def speedup(torch_key, ours_key):
        ratios = sorted(t[torch_key] / r[ours_key] for t, r in zip(rounds_t, rounds_r))
        return f"{med(ratios):.2f}x ({ratios[0]:.2f}–{ratios[-1]:.2f})"

    for m in modes:
        ours, theirs = med([r[m] for r in rounds_r]), med([t[m] for t in rounds_t])
        rel = med([r[m] / r["standard"] for r in rounds_r]) if "standard" in modes else float("nan")
        row = f"| {m} | {ours * 1e3:.0f} | {n / ours:.0f} | {theirs * 1e3:.0f} | {speedup(m, m)} |"
        if compiled:
            c = med([t[f"compiled_{m}"] for t in rounds_t])
            row += f" {c * 1e3:.0f} | {speedup(f'compiled_{m}', m)} |"
        ours_beside, theirs_beside = of_peak_beside(m)
        row += f" {rel:.3f}x | {rate(ours, m, ours_beside)} |"
        if compiled:
            row += f" {rate(c, m, theirs_beside)} |"
        print(row)
    if "hf_standard" in rounds_t[0]:
        hf = med([t["hf_standard"] for t in rounds_t])
        row = f"| standard (transformers LlamaForCausalLM) | | | {hf * 1e3:.0f} | {speedup('hf_standard', 'standard')} |"
        print(row + (" | |" if compiled else "") + " | |" + (" |" if compiled else ""))


if __name__ == "__main__":
    main()
