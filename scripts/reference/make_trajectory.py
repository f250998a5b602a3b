"""Generates the training-trajectory fixtures (tests/fixtures/trajectory/): a few optimiser
steps of a tiny model, computed in float64 by the PyTorch reference model (reference.py) with
an optimiser, learning-rate schedule and gradient clipping written here from the project's
documented semantics (the doc comments of src/train/optim.rs and src/train/run.rs):

- schedule: linear warmup `lr·(step+1)/warmup` for the first `warmup_steps` steps (0-based),
  then cosine decay to `min_lr_ratio·lr` at `total` steps;
- clipping: the global L2 norm over every gradient; above `grad_clip` all gradients are
  scaled by `grad_clip / (norm + 1e-12)`;
- AdamW: bias-corrected moments, decoupled weight decay `p -= lr·(m̂/(sqrt(v̂)+eps) + wd·p)`,
  decayed tensors: the hidden matrices (q/k/v/o, gate/up/down) and an untied LM head; never
  the embedding, RMSNorm gains, depth key-norm gains or pseudo-queries;
- Muon (the hidden matrices, when selected; AdamW for the rest): Nesterov momentum
  `B = μB + G`, direction `G + μB`, orthogonalised by five quintic Newton–Schulz iterations
  (3.4445, −4.7750, 2.0315) on the wide orientation after dividing by `‖·‖_F + 1e-7`, scaled
  by `0.2·sqrt(max(rows, cols))`, with decoupled weight decay `p ← p·(1 − lr·wd) − lr·scale·O`.

Each fixture directory holds the initial checkpoint (config.json + model.safetensors),
optim.json (the optimiser settings, as the `[train]` keys name them, plus `steps`),
batches.json (per step: input_ids and targets) and expected.safetensors: per-step `loss`,
`grad_norm` (before clipping) and `lr`, and `final.<name>` for every parameter after the last
step.

    python scripts/reference/make_trajectory.py
"""
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import reference as ref  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fixtures", "trajectory")

BASE = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=16,
    intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=8, max_position_embeddings=16, rms_norm_eps=1e-6, rope_theta=10000.0,
    initializer_range=0.02, hidden_act="silu", attention_bias=False, mlp_bias=False,
    attention_dropout=0.0, torch_dtype="float32", tie_word_embeddings=False,
)

OPTIM = dict(
    lr=0.01, min_lr_ratio=0.1, warmup_steps=3, schedule="cosine", decay_fraction=0.2,
    weight_decay=0.1, beta1=0.9, beta2=0.95, adam_eps=1e-8, muon_momentum=0.95,
)

CASES = {
    # name: (residual, num_blocks, optimizer, grad_clip)
    "adamw": ("block", 2, "adamw", 4.5),
    "muon": ("full", 4, "muon", 4.5),
}
STEPS, B, T = 8, 2, 8


def lr_at(o, step, total):
    if step < o["warmup_steps"]:
        return o["lr"] * (step + 1) / o["warmup_steps"]
    lo = o["lr"] * o["min_lr_ratio"]
    t = min((step - o["warmup_steps"]) / (total - o["warmup_steps"]), 1.0)
    return lo + 0.5 * (o["lr"] - lo) * (1.0 + math.cos(math.pi * t))


def hidden_matrix(name):
    return ".self_attn." in name or ".mlp." in name


def decayed(name):
    return hidden_matrix(name) or name == "lm_head.weight"


def newton_schulz(g):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def run(name, residual, num_blocks, optimizer, grad_clip, gen):
    cfg = dict(BASE, residual=residual, num_blocks=num_blocks)
    o = dict(OPTIM, optimizer=optimizer, grad_clip=grad_clip)
    # Gains near 1, std-0.2 matrices and non-zero pseudo-queries.
    P = ref.random_params(cfg, gen, gain_std=0.1, query_std=0.3, weight_std=0.2)
    d = os.path.join(OUT, name)
    ref.save(d, cfg, P)
    batches = [(torch.randint(0, cfg["vocab_size"], (B, T), generator=gen),
                torch.randint(0, cfg["vocab_size"], (B, T), generator=gen)) for _ in range(STEPS)]
    state = {k: dict(m=torch.zeros_like(v), v=torch.zeros_like(v), buf=torch.zeros_like(v)) for k, v in P.items()}
    losses, norms, lrs = [], [], []
    for step, (ids, targets) in enumerate(batches):
        lr = lr_at(o, step, STEPS)
        W = {k: v.clone().requires_grad_(True) for k, v in P.items()}
        loss = ref.loss_fn(ref.forward(W, cfg, ids), targets)
        loss.backward()
        G = {k: W[k].grad for k in P}
        norm = math.sqrt(sum(float((g * g).sum()) for g in G.values()))
        if norm > o["grad_clip"] > 0:
            G = {k: g * (o["grad_clip"] / (norm + 1e-12)) for k, g in G.items()}
        t = step + 1
        for k, p in P.items():
            g, s = G[k], state[k]
            if optimizer == "muon" and hidden_matrix(k) and p.dim() == 2:
                s["buf"] = o["muon_momentum"] * s["buf"] + g
                direction = g + o["muon_momentum"] * s["buf"]
                scale = 0.2 * math.sqrt(max(p.shape))
                P[k] = p * (1 - lr * o["weight_decay"]) - lr * scale * newton_schulz(direction)
            else:
                s["m"] = o["beta1"] * s["m"] + (1 - o["beta1"]) * g
                s["v"] = o["beta2"] * s["v"] + (1 - o["beta2"]) * g * g
                m_hat = s["m"] / (1 - o["beta1"] ** t)
                v_hat = s["v"] / (1 - o["beta2"] ** t)
                wd = o["weight_decay"] if decayed(k) else 0.0
                P[k] = p - lr * (m_hat / (v_hat.sqrt() + o["adam_eps"]) + wd * p)
        losses.append(loss.item())
        norms.append(norm)
        lrs.append(lr)
    with open(os.path.join(d, "optim.json"), "w") as f:
        json.dump(dict(o, steps=STEPS), f, indent=2)
    with open(os.path.join(d, "batches.json"), "w") as f:
        json.dump([{"input_ids": i.tolist(), "targets": t.tolist()} for i, t in batches], f)
    from safetensors.torch import save_file

    exp = {"loss": torch.tensor(losses), "grad_norm": torch.tensor(norms), "lr": torch.tensor(lrs)}
    exp.update({f"final.{k}": v for k, v in P.items()})
    save_file({k: v.to(torch.float32).contiguous() for k, v in exp.items()}, os.path.join(d, "expected.safetensors"))
    for f in os.listdir(d):
        os.chmod(os.path.join(d, f), 0o644)
    clipped = sum(n > grad_clip for n in norms)
    print(f"{name}: losses {' '.join(f'{x:.4f}' for x in losses)}; {clipped}/{STEPS} steps clipped")


def main():
    gen = torch.Generator().manual_seed(20260316)
    for name, case in CASES.items():
        run(name, *case, gen)


if __name__ == "__main__":
    main()
