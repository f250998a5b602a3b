"""Checks `attnres convert` on a real model: the upcycled model computes the source's logits.

    python scripts/reference/check_upcycle.py --model DIR [--work DIR] [--attnres PATH] [--bound]

DIR is a standard checkpoint (docs/import.md: SmolLM2-135M-Instruct as `attnres import` writes
it). The script converts it to Block AttnRes (6 blocks of 10 sublayers) and to Full AttnRes, runs
`attnres forward` on the same token windows through every model and compares the logits:

1. With eps = 0: each model converted again with `--set rms_norm_eps=1e-30`, which in f32 is
   eps = 0 (1e-30 vanishes in `mean(x²) + eps` for any mean square above ~1e-23, so the sums
   are bit-identical to eps = 0; eps = 0 itself is refused by the config, a zero row would
   divide by zero). Exact arithmetic gives equal logits; f32 rounding (the mean of n sources
   against the running sum, over 60 sublayers) must stay below EXACT_TOL.
2. At the model's own eps: each norm's consumer reads the mean s/n of the standard stream s, and
   `RMSNorm(s/n; eps) = s / sqrt(ms(s) + n²·eps) · g = RMSNorm(s; n²·eps)`. So the converted
   model is *exactly* the source with the eps of consumer l's norm raised to n_l²·eps. Checked
   against transformers in float64 with those per-norm eps (to IDENTITY_TOL, the f32-vs-f64
   rounding of check_import.py). Norm l's output then shrinks by the factor
   sqrt((ms + eps) / (ms + n²·eps)), a relative change δ ≤ (n² − 1)·eps / (2·ms). The bound:
   to first order the logit change is the sum of the changes each raised eps makes alone, so
   |Δz| ≤ Σ_l |Δz_l| elementwise, each Δz_l measured with transformers (float32, one norm's eps
   raised at a time; with --bound only: a forward pass per norm, 15 minutes on 2 cores); the
   measured max |Δz| must stay within it. Also printed: the a-priori
   estimate Σ_l δ_l · max |z| (δ_l at the smallest ms over the tokens), which assumes every
   rescaling reaches the logits with gain at most 1.

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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# f32 rounding of a 30-layer model, with margin (docs/import.md has the measured figure).
EXACT_TOL = 2e-3
IDENTITY_TOL = 1e-3
SEQ = 32
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


class Source:
    """The source model in transformers, with hooks on every norm: each sublayer's PreNorm in
    order, then the final norm."""

    def __init__(self, model_dir, dtype):
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.norms = []
        for layer in self.model.model.layers:
            self.norms += [layer.input_layernorm, layer.post_attention_layernorm]
        self.norms.append(self.model.model.norm)
        self.eps = self.norms[0].variance_epsilon
        self.seen = [[] for _ in self.norms]
        for i, n in enumerate(self.norms):
            n.register_forward_pre_hook(
                lambda _m, args, i=i: self.seen[i].append(args[0].pow(2).mean(-1).flatten()))

    def logits(self, rows, eps):
        """Logits with norm l at eps[l]."""
        for n, e in zip(self.norms, eps):
            n.variance_epsilon = e
        with torch.no_grad():
            z = self.model(torch.tensor(rows)).logits
        return z.reshape(-1, z.shape[-1]).double().numpy()

    def mean_squares(self, rows):
        """Per norm, the mean square of its input at each token (at the model's own eps)."""
        self.seen = [[] for _ in self.norms]
        self.logits(rows, [self.eps] * len(self.norms))
        return [torch.cat(s).numpy() for s in self.seen]


def sources_read(l, block):
    """Sources consumer l reads (l = L: the output aggregation): the embedding, the completed
    blocks, the partial sum."""
    return 1 + l // block + (l % block != 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a standard checkpoint directory")
    ap.add_argument("--work", help="where the converted models go (default: a temporary dir)")
    ap.add_argument("--attnres", default=os.path.join(ROOT, "target/release/attnres"))
    ap.add_argument("--bound", action="store_true",
                    help="also the first-order bound (a forward pass per norm)")
    args = ap.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="check-upcycle-")
    os.makedirs(work, exist_ok=True)
    config = json.load(open(os.path.join(args.model, "config.json")))
    layers = config["num_hidden_layers"]
    rows = windows(args.model)
    log(f"{len(rows)} windows of {SEQ} tokens; rms_norm_eps {config['rms_norm_eps']:.3g}")
    fails = []

    def convert(name, sets):
        out = os.path.join(work, name)
        run([args.attnres, "convert", "--model", args.model, *sets, "--out", out, "--force"])
        return out

    eps0 = ["--set", "rms_norm_eps=1e-30"]
    z0 = logits(args.attnres, convert("standard-eps0", eps0), rows, work)
    z = logits(args.attnres, args.model, rows, work)
    f64 = Source(args.model, torch.float64)
    ms = f64.mean_squares(rows)
    eps = f64.eps
    if args.bound:
        f32 = Source(args.model, torch.float32)
        base = f32.logits(rows, [eps] * len(ms))
    scale = float(np.abs(z).max())
    log(f"source: logits up to {scale:.2f}; ours against transformers float64: "
        f"{np.abs(z - f64.logits(rows, [eps] * len(ms))).max():.2e}")

    def check(ok, msg):
        log(("ok   " if ok else "FAIL ") + msg)
        fails.extend([] if ok else [msg])

    for name, sets in VARIANTS.items():
        gap0 = float(np.abs(logits(args.attnres, convert(name + "-eps0", sets + eps0), rows, work)
                            - z0).max())
        check(gap0 <= EXACT_TOL, f"{name}, eps = 0: max |Δlogit| = {gap0:.2e} (tolerance "
              f"{EXACT_TOL:.0e}, f32 rounding)")
        zc = logits(args.attnres, convert(name, sets), rows, work)
        gap = float(np.abs(zc - z).max())
        block = 1 if name == "full" else 2 * layers // 6
        n = [sources_read(l, block) for l in range(len(ms))]
        raised = [k * k * eps for k in n]
        ident = float(np.abs(zc - f64.logits(rows, raised)).max())
        check(ident <= IDENTITY_TOL, f"{name}: ours against transformers float64 with norm l's "
              f"eps at n_l²·eps: max |Δlogit| = {ident:.2e} (tolerance {IDENTITY_TOL:.0e})")
        deltas = [(k * k - 1) * eps / (2 * float(m.min())) for k, m in zip(n, ms)]
        argmax = float((zc.argmax(-1) == z.argmax(-1)).mean())
        msg = (f"{name}, eps = {eps:.3g}: max |Δlogit| = {gap:.2e}; a-priori Σδ·max|z| = "
               f"{sum(deltas) * scale:.2e} (largest δ {max(deltas):.2e}, at consumer "
               f"{int(np.argmax(deltas))}); same most likely token at {100 * argmax:.1f}% of "
               f"positions")
        if not args.bound:
            log("     " + msg)
            continue
        # First order: the sum of what raising each norm's eps alone does.
        total = np.zeros_like(base)
        for l, k in enumerate(n):
            if k > 1:
                one = [eps] * len(ms)
                one[l] = raised[l]
                total += np.abs(f32.logits(rows, one) - base)
        bound = float(total.max())
        check(gap <= bound, f"{msg}; first-order bound max Σ|Δz_l| = {bound:.2e}")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
