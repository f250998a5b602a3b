"""The PyTorch side of the GPU training benchmark: the engine's model written for speed in PyTorch,
timed step by step on one GPU, one JSON line per residual mode.

    python scripts/bench/gpu_torch.py [--shape anchor|tiny] [--batch 16] [--seq 2048]
        [--modes standard,block,full] [--blocks 8] [--precision bf16|fp32] [--compile] [--steps 10]
    python scripts/bench/gpu_torch.py --check      # on the CPU, float64: the model is the reference's

The model is the one attnres trains (a Llama with the standard residual, Block or Full AttnRes;
docs/method.md), with what makes PyTorch fast on a GPU: the q/k/v and gate/up projections each
one matrix, F.rms_norm, scaled_dot_product_attention (flash attention), the fused AdamW, bf16
autocast over fp32 weights (or fp32 with TF32 off, attnres's exact mode, with --precision fp32),
and torch.compile (--compile) over the model and its loss together. Full and Block AttnRes run the two-phase depth attention: each
completed source gets its 1/rms once; when a block starts, one product per source scores it for
all of the block's consumers (phase 1), and each consumer merges its partial sum by online softmax
(phase 2). One step is forward, mean cross-entropy, backward and the optimiser's update.

Printed per mode: the median step time over --steps (after --warmup untimed steps, where
torch.compile compiles), tokens per second, model TFLOP/s (the count of attnres's `bench`:
matrix products, causal attention on its lower triangle, backward twice forward) and the peak
of memory PyTorch allocated. --check compares each mode's logits, in float64 on the CPU, with
scripts/reference/reference.py's on the same weights.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

SHAPES = {
    # hidden, layers, heads, kv heads, FFN, vocabulary
    "anchor": (1024, 24, 16, 16, 2816, 49152),
    "tiny": (64, 4, 4, 4, 176, 512),
}


class Config:
    def __init__(self, d, layers, heads, kv, ffn, vocab, residual, blocks, eps=1e-6, theta=10000.0):
        self.d, self.layers, self.heads, self.kv, self.ffn, self.vocab = d, layers, heads, kv, ffn, vocab
        self.hd = d // heads
        self.residual, self.eps, self.theta = residual, eps, theta
        L = 2 * layers
        self.block = {"standard": None, "full": 1, "block": L // blocks}[residual]


def wide(x):
    """x in float32 at least: the softmax's and norms' statistics."""
    return x if x.dtype == torch.float64 else x.float()


def rope_tables(T, hd, theta, device):
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float64) / hd)
    ang = torch.arange(T, device=device, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    return ang.cos().float(), ang.sin().float()


def rotate(x, cos, sin):
    """Rotate-half RoPE of x [B, heads, T, hd]."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos.to(x.dtype) + turned * sin.to(x.dtype)


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        d, hd = c.d, c.hd
        qkv = (c.heads + 2 * c.kv) * hd

        def w(*shape):
            return nn.Parameter(torch.randn(*shape) * 0.02)

        def ones():
            return nn.Parameter(torch.ones(d))

        self.embed = w(c.vocab, d)
        self.norm1 = nn.ParameterList(ones() for _ in range(c.layers))
        self.qkv = nn.ParameterList(w(qkv, d) for _ in range(c.layers))
        self.o = nn.ParameterList(w(d, c.heads * hd) for _ in range(c.layers))
        self.norm2 = nn.ParameterList(ones() for _ in range(c.layers))
        self.gate_up = nn.ParameterList(w(2 * c.ffn, d) for _ in range(c.layers))
        self.down = nn.ParameterList(w(d, c.ffn) for _ in range(c.layers))
        self.final_norm = ones()
        self.head = w(c.vocab, d)
        if c.block is not None:
            # One pseudo-query and key-norm gain per consumer: the sublayers, then the output.
            n = 2 * c.layers + 1
            self.query = nn.Parameter(torch.zeros(n, d))
            self.gain = nn.Parameter(torch.ones(n, d))

    def sublayer(self, l, x, cos, sin):
        c, i = self.c, l // 2
        B, T, _ = x.shape
        if l % 2 == 0:
            q, k, v = F.linear(F.rms_norm(x, (c.d,), self.norm1[i], c.eps), self.qkv[i]).split(
                [c.heads * c.hd, c.kv * c.hd, c.kv * c.hd], -1)
            q = rotate(q.view(B, T, c.heads, c.hd).transpose(1, 2), cos, sin)
            k = rotate(k.view(B, T, c.kv, c.hd).transpose(1, 2), cos, sin)
            v = v.view(B, T, c.kv, c.hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.kv != c.heads)
            return F.linear(o.transpose(1, 2).reshape(B, T, c.heads * c.hd), self.o[i])
        g, u = F.linear(F.rms_norm(x, (c.d,), self.norm2[i], c.eps), self.gate_up[i]).chunk(2, -1)
        return F.linear(F.silu(g) * u, self.down[i])

    def rstd(self, v):
        return torch.rsqrt(wide(v).pow(2).mean(-1, keepdim=True) + self.c.eps)

    @staticmethod
    def phase1(sources, rstds, ws):
        """The consumers ws [S, d] of a block score its completed sources: per token the logits'
        maximum m [B, T, S, 1], the sum of exponentials z, and the normalised mix o1 [B, T, S, d]."""
        logits = torch.stack([wide(F.linear(v, ws)) * r for v, r in zip(sources, rstds)], -1)
        m = logits.amax(-1, keepdim=True)
        e = (logits - m).exp()
        z = e.sum(-1, keepdim=True)
        a = (e / z).to(sources[0].dtype)
        o1 = sum(a[..., i, None] * v[:, :, None, :] for i, v in enumerate(sources))
        return o1, m, z

    @staticmethod
    def phase2(o1, m, z, partial, rp, w):
        """Merges the partial sum (1/rms rp) into one consumer's phase-1 results, online."""
        if partial is None:
            return o1
        lp = wide(partial @ w)[..., None] * rp
        mm = torch.maximum(m, lp)
        s1, sp = (m - mm).exp() * z, (lp - mm).exp()
        return (o1 * (s1 / (s1 + sp)).to(o1.dtype) + partial * (sp / (s1 + sp)).to(o1.dtype))

    def forward(self, ids, cos, sin):
        c = self.c
        x = F.embedding(ids, self.embed)
        L = 2 * c.layers
        if c.block is None:
            for l in range(L):
                x = x + self.sublayer(l, x, cos, sin)
        else:
            ws = self.query * self.gain
            sources, rstds = [x], [self.rstd(x)]
            partial = rp = None
            for l in range(L):
                if l % c.block == 0:
                    o1, m, z = self.phase1(sources, rstds, ws[l:min(l + c.block, L)])
                j = l % c.block
                h = self.phase2(o1[:, :, j], m[:, :, j], z[:, :, j], partial, rp, ws[l])
                out = self.sublayer(l, h, cos, sin)
                partial = out if partial is None else partial + out
                if (l + 1) % c.block == 0 or l + 1 == L:
                    sources.append(partial)
                    rstds.append(self.rstd(partial))
                    partial = None
                else:
                    rp = self.rstd(partial)
            o1, _, _ = self.phase1(sources, rstds, ws[L:])
            x = o1[:, :, 0]
        return F.linear(F.rms_norm(x, (c.d,), self.final_norm, c.eps), self.head)


class WithLoss(nn.Module):
    """The model and its mean cross-entropy in one module, so that torch.compile fuses the
    logits' cast to f32 into the loss and its gradient rather than keeping them in f32."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, targets, cos, sin):
        logits = self.model(ids, cos, sin)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def step_flops(c, batch, seq):
    """attnres's count (src/experiments/bench/mod.rs: step_flops)."""
    n = batch * seq
    per_layer = c.d * (c.heads + 2 * c.kv) * c.hd + c.heads * c.hd * c.d + 3 * c.d * c.ffn
    linear = 2 * n * (per_layer * c.layers + c.d * c.vocab)
    attn = 2 * 2 * batch * c.heads * seq * seq / 2 * c.hd
    return 3 * (linear + attn * c.layers)


def bench(args, mode, device):
    d, layers, heads, kv, ffn, vocab = SHAPES[args.shape]
    c = Config(d, layers, heads, kv, ffn, vocab, mode, args.blocks)
    torch.manual_seed(0)
    model = Model(c).to(device)
    cos, sin = rope_tables(args.seq, c.hd, c.theta, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    ids = torch.randint(0, vocab, (args.batch, args.seq + 1), device=device)
    x, y = ids[:, :-1], ids[:, 1:]
    loss_of = WithLoss(model)
    loss_of = torch.compile(loss_of) if args.compile else loss_of
    bf16 = args.precision == "bf16"

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(x, y, cos, sin)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    dt = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return {
        "mode": mode, "precision": args.precision, "compile": args.compile,
        "batch": args.batch, "seq": args.seq, "step_ms": dt * 1e3,
        "tokens_per_s": args.batch * args.seq / dt,
        "model_tflops": step_flops(c, args.batch, args.seq) / dt / 1e12,
        "peak_gb": peak / 1e9,
    }


def check():
    """Each mode's logits against the reference implementation, in float64 on the CPU."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
    import reference as ref

    torch.manual_seed(1)
    d, layers, heads, kv, ffn, vocab = 32, 3, 4, 2, 48, 61
    B, T = 2, 9
    ids = torch.randint(0, vocab, (B, T))
    for mode, blocks in [("standard", 1), ("block", 3), ("block", 2), ("full", 1)]:
        c = Config(d, layers, heads, kv, ffn, vocab, mode, blocks)
        m = Model(c).double()
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.shape == (d,) else 0.0))
        cfg = {"num_hidden_layers": layers, "hidden_size": d, "intermediate_size": ffn,
               "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": c.hd,
               "vocab_size": vocab, "residual": mode, "num_blocks": blocks,
               "tie_word_embeddings": False, "rms_norm_eps": c.eps, "rope_theta": c.theta}
        hd = c.hd
        P = {"model.embed_tokens.weight": m.embed, "model.norm.weight": m.final_norm, "lm_head.weight": m.head}
        for i in range(layers):
            p = f"model.layers.{i}"
            q, k, v = m.qkv[i].split([heads * hd, kv * hd, kv * hd], 0)
            g, u = m.gate_up[i].chunk(2, 0)
            P.update({f"{p}.input_layernorm.weight": m.norm1[i], f"{p}.self_attn.q_proj.weight": q,
                      f"{p}.self_attn.k_proj.weight": k, f"{p}.self_attn.v_proj.weight": v,
                      f"{p}.self_attn.o_proj.weight": m.o[i], f"{p}.post_attention_layernorm.weight": m.norm2[i],
                      f"{p}.mlp.gate_proj.weight": g, f"{p}.mlp.up_proj.weight": u, f"{p}.mlp.down_proj.weight": m.down[i]})
            if c.block is not None:
                for j, kind in enumerate(["attn", "mlp"]):
                    P[f"{p}.{kind}_res_proj.weight"] = m.query[2 * i + j][None]
                    P[f"{p}.{kind}_res_norm.weight"] = m.gain[2 * i + j]
        if c.block is not None:
            P["model.output_attn_res_proj.weight"] = m.query[-1][None]
            P["model.output_attn_res_norm.weight"] = m.gain[-1]
        cos, sin = rope_tables(T, hd, c.theta, "cpu")
        with torch.no_grad():
            got = m(ids, cos.double(), sin.double())
            want = ref.forward({k: v.detach() for k, v in P.items()}, cfg, ids, sdpa=False)
        err = (got - want).abs().max().item() / want.abs().max().item()
        print(f"{mode} (blocks {blocks}): logits within {err:.1e} of the reference's")
        # The reference takes its rotary tables in float32, these in float64 rounded to
        # float32: they part by float32's rounding, not by a different function.
        assert err < 1e-6, f"{mode}: the baseline's model is not the reference's ({err})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="anchor")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--modes", default="standard,block,full")
    ap.add_argument("--blocks", type=int, default=8, help="Block AttnRes's blocks")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--check", action="store_true", help="compare with the reference in float64 and exit")
    args = ap.parse_args()
    if args.check:
        return check()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # fp32 is attnres's exact mode: no TF32 anywhere.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    first = None
    for mode in args.modes.split(","):
        r = bench(args, mode, device)
        first = first or r["step_ms"]
        r["vs_first"] = r["step_ms"] / first
        r["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
