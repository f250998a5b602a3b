"""Checks that `transformers` runs the AttnRes checkpoints attnres writes, through the PyTorch
module they carry (`trust_remote_code=True`; docs/interop.md).

    pip install -r scripts/reference/requirements.txt
    cargo build --release --bin attnres
    python scripts/reference/check_transformers.py [--attnres target/release/attnres] [--work DIR]

Trains short runs (the `tiny` preset, seconds each) of Block and Full AttnRes, of Block with a
shorter last block (4 layers in blocks of 3) and of every ablation option that changes
parameters, then for each checkpoint, against the engine:
1. logits of a batch: `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` in
   float32 against `attnres forward`, max |a - b| / max |b| <= LOGIT_TOL;
2. gradients of the mean cross-entropy of that batch, every parameter, the same measure per
   tensor <= GRAD_TOL (its scale floored at GRAD_FLOOR times the model's largest gradient);
3. padding: a left-padded batch (attention_mask) gives each row the logits it has alone;
and for Block, Full and the shorter last block, trained longer:
4. greedy text: `generate()` with and without the key/value cache gives the same tokens as
   `attnres generate --temperature 0`;
5. the way back: one SGD step in PyTorch, `save_pretrained`, `attnres import` of that directory,
   and `attnres forward` gives transformers' logits of the updated model.
Exits 1 on any failure.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Both sides compute in float32 in different orders; measured differences are about 1e-6.
LOGIT_TOL = 1e-4
GRAD_TOL = 1e-4
GRAD_FLOOR = 1e-2
GREEDY_TOKENS = 40
PROMPTS = ["ROMEO:", "First Citizen:\nWe are accounted poor"]

# name, --set overrides, steps of 4096 tokens (more for the greedy-text checks)
MODELS = [
    ("block", ["residual=block", "num_blocks=4"], 120),
    ("full", ["residual=full"], 120),
    ("block-uneven", ["residual=block", "attn_res_block_size=3"], 120),
    ("block-S3-untied", ["residual=block", "num_hidden_layers=3", "num_blocks=2", "tie_word_embeddings=false"], 10),
    ("block-one", ["residual=block", "num_blocks=1"], 10),
    ("no-key-norm", ["residual=full", "attn_res_key_norm=false"], 10),
    ("sigmoid", ["residual=block", "num_blocks=4", "attn_res_gate=sigmoid"], 10),
    ("input-query", ["residual=full", "attn_res_query=input"], 10),
    ("scalar", ["residual=block", "num_blocks=2", "attn_res_query=scalar"], 10),
    ("dense", ["residual=full", "attn_res_query=dense"], 10),
    ("heads", ["residual=block", "num_blocks=4", "attn_res_heads=4"], 10),
    ("window", ["residual=full", "attn_res_window=2"], 10),
]


def log(msg):
    print(msg, flush=True)


def run(cmd):
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr}")
    return res


def rel(a, b):
    scale = float(np.abs(b).max())
    return float(np.abs(a - b).max()) / (scale if scale > 0 else 1.0)


class Fails:
    def __init__(self):
        self.items = []

    def check(self, ok, what):
        log(("ok   " if ok else "FAIL ") + what)
        if not ok:
            self.items.append(what)


def load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32)


def our_forward(args, model_dir, ids, targets, work):
    batch, out = os.path.join(work, "batch.json"), os.path.join(work, "out.safetensors")
    with open(batch, "w") as f:
        json.dump({"input_ids": ids, **({"targets": targets} if targets else {})}, f)
    run([args.attnres, "forward", "--model", model_dir, "--batch", batch, "--out", out])
    return load_file(out)


def check_model(args, fails, name, model_dir, work, vocab):
    model = load(model_dir)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 33), generator=gen)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    ours = our_forward(args, model_dir, inputs.tolist(), targets.tolist(), work)
    model.train()
    out = model(inputs, use_cache=False)
    loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, vocab), targets.reshape(-1))
    loss.backward()
    err = rel(out.logits.detach().numpy(), ours["logits"])
    fails.check(err <= LOGIT_TOL, f"{name}: logits, relative error {err:.2e}")
    worst, missing = ("", 0.0), []
    # A tensor whose gradient is a cancelling sum far smaller than the model's others (a dense
    # mixing weight: one number summed over every token and channel) is measured against a floor
    # of GRAD_FLOOR times the model's largest gradient, where both sides' float32 rounding lies.
    floor = GRAD_FLOOR * max(float(np.abs(v).max()) for k, v in ours.items() if k.startswith("grad."))
    for pname, p in model.named_parameters():
        key = f"grad.{pname}"
        if key not in ours:
            missing.append(pname)
            continue
        g, scale = ours[key], max(float(np.abs(ours[key]).max()), floor)
        e = float(np.abs(p.grad.numpy() - g).max()) / scale
        worst = max(worst, (pname, e), key=lambda x: x[1])
    extra = {k for k in ours if k.startswith("grad.")} - {f"grad.{n}" for n, _ in model.named_parameters()}
    fails.check(not missing and not extra, f"{name}: the same parameters (missing {missing}, extra {sorted(extra)})")
    fails.check(worst[1] <= GRAD_TOL, f"{name}: gradients of {len(ours) - 2} tensors, worst relative error {worst[1]:.2e} ({worst[0]})")
    model.eval()
    # Left padding: row b is shortened by b tokens and padded in front.
    padded, mask = inputs.clone(), torch.ones_like(inputs)
    for b in range(inputs.shape[0]):
        padded[b, :b] = 0
        mask[b, :b] = 0
    with torch.no_grad():
        batched = model(padded, attention_mask=mask, use_cache=False).logits
        worst = 0.0
        for b in range(inputs.shape[0]):
            alone = model(inputs[b : b + 1, b:], use_cache=False).logits
            worst = max(worst, rel(batched[b, b:].numpy(), alone[0].numpy()))
    fails.check(worst <= LOGIT_TOL, f"{name}: a left-padded batch gives each row its own logits ({worst:.2e})")
    # A new model from the config starts as the method does: pseudo-queries 0 (dense mixing 1),
    # gains 1.
    fresh = type(model)(model.config)
    start = 1.0 if model.config.attn_res_query == "dense" else 0.0
    ok = all(bool((p == (start if "res_proj" in n else 1.0)).all())
             for n, p in fresh.named_parameters() if "res_" in n or n.endswith("norm.weight"))
    fails.check(ok, f"{name}: a new model starts with pseudo-queries {start} and gains 1")
    return model


def check_greedy(args, fails, name, model_dir, model, work):
    from transformers import AutoTokenizer

    # The run's tokenizer.json and tokenizer_config.json, as transformers (and lm-eval) load them.
    tok = AutoTokenizer.from_pretrained(model_dir)
    fails.check(tok.eos_token == "<|endoftext|>", f"{name}: AutoTokenizer loads the run's tokenizer, eos {tok.eos_token!r}")
    prompts = os.path.join(work, "prompts.txt")
    with open(prompts, "w") as f:
        f.write("\n".join(p.replace("\n", " ") for p in PROMPTS) + "\n")
    res = run([args.attnres, "generate", "--model", model_dir, "--prompt-file", prompts, "--temperature", "0",
               "--ignore-eos", "--max-tokens", str(GREEDY_TOKENS)])
    ours = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    for o in ours:
        ids = torch.tensor([tok(o["prompt"]).input_ids])
        texts = []
        for cache in (True, False):
            out = model.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False, use_cache=cache,
                                 eos_token_id=None, pad_token_id=0)
            texts.append(tok.decode(out[0, ids.shape[1]:].tolist(), clean_up_tokenization_spaces=False))
        fails.check(texts[0] == texts[1], f"{name}: generate() with and without the cache agree")
        fails.check(texts[0] == o["completion"], f"{name}: greedy text of {o['prompt']!r} equals ours: {texts[0]!r}")


def check_way_back(args, fails, name, model, work, vocab):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 17), generator=gen)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    saved, imported = os.path.join(work, f"{name}-hf"), os.path.join(work, f"{name}-back")
    model.save_pretrained(saved)
    shutil.copy(os.path.join(work, name, "tokenizer.json"), saved)
    run([args.attnres, "import", "--from", saved, "--out", imported, "--force"])
    model.eval()
    with torch.no_grad():
        theirs = model(ids, use_cache=False).logits.numpy()
    ours = our_forward(args, imported, ids.tolist(), None, work)["logits"]
    err = rel(ours, theirs)
    fails.check(err <= LOGIT_TOL, f"{name}: trained one step in PyTorch, saved, imported: logits {err:.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attnres", default=os.path.join(ROOT, "target", "release", "attnres"))
    ap.add_argument("--work", help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="attnres-hf-")
    os.makedirs(work, exist_ok=True)
    fails = Fails()
    torch.manual_seed(0)
    try:
        for name, sets, steps in MODELS:
            out = os.path.join(work, name)
            cmd = [args.attnres, "train", "--preset", "tiny", "--no-progress", "--overwrite", "--out", out,
                   "--set", f"max_tokens={steps * 4096}"]
            for s in sets:
                cmd += ["--set", s]
            run(cmd)
            with open(os.path.join(out, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            model = check_model(args, fails, name, out, work, vocab)
            if steps > 10:
                check_greedy(args, fails, name, out, model, work)
                check_way_back(args, fails, name, model, work, vocab)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if fails.items:
        log(f"{len(fails.items)} check(s) failed")
        sys.exit(1)
    log("all transformers checks passed")


if __name__ == "__main__":
    main()
