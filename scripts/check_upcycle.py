"""Checks `attnres convert` on a real model: the upcycled model computes the source's logits.

    python scripts/check_upcycle.py --model DIR [--work DIR] [--attnres PATH]

DIR is a standard checkpoint (docs/import.md: SmolLM2-135M-Instruct as `attnres import` writes
it). The script converts it to Block AttnRes (6 blocks of 10 sublayers) and to Full AttnRes, runs
`attnres forward` on the same token windows through every model and compares the logits:

1. With eps = 0: each model converted again with `--set rms_norm_eps=1e-30`, which in f32 is
   eps = 0 (1e-30 vanishes in `mean(x²) + eps` for any mean square above ~1e-23, so the sums
   are bit-identical to eps = 0; eps = 0 itself is refused by the config, a zero row would
   divide by zero). Exact arithmetic gives equal logits; f32 rounding (the mean of n sources
   against the running sum, over 60 sublayers) must stay below EXACT_TOL.
2. At the model's own eps: each norm's consumer reads the mean s/n of the standard stream s, and
   `RMSNorm(s/n; eps) = RMSNorm(s; n²·eps)`: the norm's output shrinks by the factor
   sqrt((ms + eps) / (ms + n²·eps)), a relative change δ ≤ (n² − 1)·eps / (2·ms) (ms: the mean
   square of s at that token). To first order each such change moves the logits by at most δ
   of the largest logit, so max |Δlogit| ≤ Σ_l δ_l · max |z| with δ_l at the smallest ms of
   consumer l over the tokens (the bound of tests/model.rs). The ms come from the source model
   in float64 (transformers, hooks on every norm's input); the measured change must stay within
   the bound.

Prints one line per figure (docs/import.md, "Upcycling"); exits 1 when a check fails.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# f32 rounding of a 30-layer model, with margin (docs/import.md has the measured figure).
EXACT_TOL = 2e-3
SEQ = 64
TEXTS = [
    "The capital of France is Paris. It lies on the Seine, and about two million people live "
    "in the city itself, more than twelve million in its metropolitan area.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\nprint([fibonacci(i) for i in range(10)])\n",
    "<|im_start|>user\nWhat is the boiling point of water at sea level?<|im_end|>\n"
    "<|im_start|>assistant\nWater boils at 100 degrees Celsius (212 °F) at sea level.<|im_end|>\n",
    "ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east, and Juliet "
    "is the sun.\nArise, fair sun, and kill the envious moon,\n",
]
VARIANTS = {"block6": ["--set", "residual=block", "--set", "num_blocks=6"],
            "full": ["--set", "residual=full"]}


def log(msg):
    print(msg, flush=True)


def run(cmd):
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def windows(model_dir):
    """SEQ-token rows cut from TEXTS with the model's tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ids = [i for t in TEXTS for i in tok.encode(t, add_special_tokens=False).ids]
    rows = len(ids) // SEQ
    return [ids[r * SEQ:(r + 1) * SEQ] for r in range(rows)]


def logits(attnres, model_dir, rows, work):
    batch, out = os.path.join(work, "batch.json"), os.path.join(work, "out.safetensors")
    with open(batch, "w") as f:
        json.dump({"input_ids": rows}, f)
    run([attnres, "forward", "--model", model_dir, "--batch", batch, "--out", out])
    z = load_file(out)["logits"]
    return z.reshape(-1, z.shape[-1]).astype(np.float64)


def norm_mean_squares(model_dir, rows):
    """Per consumer (each sublayer's PreNorm in order, then the final norm): the mean square of
    the stream it normalises, per token, from the source model in float64."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    norms = []
    for layer in model.model.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    norms.append(model.model.norm)
    seen = [[] for _ in norms]
    for i, n in enumerate(norms):
        n.register_forward_pre_hook(
            lambda _m, args, i=i: seen[i].append(args[0].pow(2).mean(-1).flatten()))
    with torch.no_grad():
        z = model(torch.tensor(rows)).logits
    return [torch.cat(s).numpy() for s in seen], z.reshape(-1, z.shape[-1]).numpy()


def sources_read(l, block):
    """Sources consumer l reads (l = L: the output aggregation): the embedding, the completed
    blocks, the partial sum."""
    return 1 + l // block + (l % block != 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a standard checkpoint directory")
    ap.add_argument("--work", help="where the converted models go (default: a temporary dir)")
    ap.add_argument("--attnres", default=os.path.join(ROOT, "target/release/attnres"))
    args = ap.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="check-upcycle-")
    os.makedirs(work, exist_ok=True)
    config = json.load(open(os.path.join(args.model, "config.json")))
    eps, layers = config["rms_norm_eps"], config["num_hidden_layers"]
    rows = windows(args.model)
    log(f"{len(rows)} windows of {SEQ} tokens; rms_norm_eps {eps:.3g}")
    fails = []

    def convert(name, sets):
        out = os.path.join(work, name)
        run([args.attnres, "convert", "--model", args.model, *sets, "--out", out, "--force"])
        return out

    eps0 = ["--set", "rms_norm_eps=1e-30"]
    z0 = logits(args.attnres, convert("standard-eps0", eps0), rows, work)
    z = logits(args.attnres, args.model, rows, work)
    ms, z64 = norm_mean_squares(args.model, rows)
    scale = float(np.abs(z).max())
    log(f"source: logits up to {scale:.2f}; ours against transformers float64: "
        f"{np.abs(z - z64).max():.2e}")
    for name, sets in VARIANTS.items():
        gap0 = float(np.abs(logits(args.attnres, convert(name + "-eps0", sets + eps0), rows, work)
                            - z0).max())
        ok = gap0 <= EXACT_TOL
        fails += [] if ok else [name]
        log(f"{'ok  ' if ok else 'FAIL'} {name}, eps = 0: max |Δlogit| = {gap0:.2e} "
            f"(tolerance {EXACT_TOL:.0e}, f32 rounding)")
        zc = logits(args.attnres, convert(name, sets), rows, work)
        gap = float(np.abs(zc - z).max())
        block = 1 if name == "full" else 2 * layers // 6
        deltas = [(sources_read(l, block) ** 2 - 1) * eps / (2 * float(m.min()))
                  for l, m in enumerate(ms)]
        bound = sum(deltas) * scale
        argmax = float((zc.argmax(-1) == z.argmax(-1)).mean())
        ok = gap <= bound
        fails += [] if ok else [name]
        log(f"{'ok  ' if ok else 'FAIL'} {name}, eps = {eps:.3g}: max |Δlogit| = {gap:.2e}, "
            f"bound Σδ·max|z| = {bound:.2e} (Σδ = {sum(deltas):.2e}, largest δ = "
            f"{max(deltas):.2e}); same most likely token at {100 * argmax:.1f}% of positions")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
