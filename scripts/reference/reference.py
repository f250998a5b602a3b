"""An independent PyTorch implementation of the attnres model, written from the method's
definition (docs/method.md).

It reads and writes the same checkpoint format (config.json + model.safetensors with Hugging
Face names) and is used to generate the test fixtures and as the PyTorch side of the benchmark.
Pinned versions: see requirements.txt beside this file.
"""
import json
import math
import os

import torch
import torch.nn.functional as F


def block_size(cfg):
    """Sublayers per depth block: None (standard), 1 (full) or L / num_blocks (block)."""
    L = 2 * cfg["num_hidden_layers"]
    return {"standard": None, "full": 1, "block": L // max(cfg["num_blocks"], 1)}[cfg["residual"]]


def param_shapes(cfg):
    """Every parameter name and shape, in checkpoint order."""
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    qd, kvd = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    attnres = block_size(cfg) is not None
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], d))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        if attnres:
            out += [(f"{p}.attn_res_proj.weight", (1, d)), (f"{p}.attn_res_norm.weight", (d,))]
        out += [
            (f"{p}.input_layernorm.weight", (d,)),
            (f"{p}.self_attn.q_proj.weight", (qd, d)),
            (f"{p}.self_attn.k_proj.weight", (kvd, d)),
            (f"{p}.self_attn.v_proj.weight", (kvd, d)),
            (f"{p}.self_attn.o_proj.weight", (d, qd)),
        ]
        if attnres:
            out += [(f"{p}.mlp_res_proj.weight", (1, d)), (f"{p}.mlp_res_norm.weight", (d,))]
        out += [
            (f"{p}.post_attention_layernorm.weight", (d,)),
            (f"{p}.mlp.gate_proj.weight", (f, d)),
            (f"{p}.mlp.up_proj.weight", (f, d)),
            (f"{p}.mlp.down_proj.weight", (d, f)),
        ]
    if attnres:
        out += [("model.output_attn_res_proj.weight", (1, d)), ("model.output_attn_res_norm.weight", (d,))]
    out.append(("model.norm.weight", (d,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (cfg["vocab_size"], d)))
    return out


def random_params(cfg, gen, gain_std, query_std, weight_std):
    """Random float64 parameters holding f32 values (the ones the Rust side reads): gains
    1 + N(0, gain_std²), pseudo-queries N(0, query_std²), everything else N(0, weight_std²)."""
    P = {}
    for name, shape in param_shapes(cfg):
        if name.endswith("norm.weight"):
            t = 1.0 + gain_std * torch.randn(shape, generator=gen, dtype=torch.float64)
        elif "res_proj" in name:
            t = query_std * torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            t = weight_std * torch.randn(shape, generator=gen, dtype=torch.float64)
        P[name] = t.to(torch.float32).to(torch.float64)
    return P


def rmsnorm(x, g, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def rope(x, theta):
    """Rotate-half rotary embedding of x [B, T, heads, hd], positions from 0."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos().to(x.dtype)[None, :, None, :], emb.sin().to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(P, p, x, cfg, sdpa):
    B, T, _ = x.shape
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // H
    q = (x @ P[f"{p}.self_attn.q_proj.weight"].T).view(B, T, H, hd)
    k = (x @ P[f"{p}.self_attn.k_proj.weight"].T).view(B, T, KV, hd)
    v = (x @ P[f"{p}.self_attn.v_proj.weight"].T).view(B, T, KV, hd)
    q, k = rope(q, cfg["rope_theta"]), rope(k, cfg["rope_theta"])
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k = k.repeat_interleave(H // KV, dim=1)
    v = v.repeat_interleave(H // KV, dim=1)
    if sdpa:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        s = q @ k.transpose(-1, -2) / math.sqrt(hd)
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        o = s.masked_fill(mask, float("-inf")).softmax(-1) @ v
    o = o.transpose(1, 2).reshape(B, T, H * hd)
    return o @ P[f"{p}.self_attn.o_proj.weight"].T


def mlp(P, p, x):
    g = x @ P[f"{p}.mlp.gate_proj.weight"].T
    u = x @ P[f"{p}.mlp.up_proj.weight"].T
    return (F.silu(g) * u) @ P[f"{p}.mlp.down_proj.weight"].T


def depth_attention(sources, q, gain, eps):
    """docs/method.md §3: softmax over sources of <q, RMSNorm_gain(v_i)>, applied to the raw sources."""
    V = torch.stack(sources)  # [K, B, T, d]
    logits = torch.einsum("d,kbtd->kbt", q.reshape(-1), rmsnorm(V, gain, eps))
    alpha = logits.softmax(0)
    return torch.einsum("kbt,kbtd->btd", alpha, V)


def sublayer(P, cfg, l, h, sdpa):
    i, eps = l // 2, cfg["rms_norm_eps"]
    p = f"model.layers.{i}"
    if l % 2 == 0:
        return attention(P, p, rmsnorm(h, P[f"{p}.input_layernorm.weight"], eps), cfg, sdpa)
    return mlp(P, p, rmsnorm(h, P[f"{p}.post_attention_layernorm.weight"], eps))


def forward(P, cfg, ids, sdpa=False):
    """Logits [B, T, vocab] for token ids [B, T]."""
    eps, L, S = cfg["rms_norm_eps"], 2 * cfg["num_hidden_layers"], block_size(cfg)
    e = P["model.embed_tokens.weight"][ids]
    if S is None:
        h = e
        for l in range(L):
            h = h + sublayer(P, cfg, l, h, sdpa)
    else:
        blocks, partial = [e], None  # b_0 = e; completed block sums; running partial sum
        for l in range(L):
            kind = "attn" if l % 2 == 0 else "mlp"
            p = f"model.layers.{l // 2}.{kind}_res"
            sources = blocks + ([partial] if partial is not None else [])
            h = depth_attention(sources, P[f"{p}_proj.weight"], P[f"{p}_norm.weight"], eps)
            out = sublayer(P, cfg, l, h, sdpa)
            partial = out if partial is None else partial + out
            if (l + 1) % S == 0:
                blocks.append(partial)
                partial = None
        h = depth_attention(blocks, P["model.output_attn_res_proj.weight"], P["model.output_attn_res_norm.weight"], eps)
    x = rmsnorm(h, P["model.norm.weight"], eps)
    head = P["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else P["lm_head.weight"]
    return x @ head.T


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def load(dirname, dtype=torch.float32):
    from safetensors.torch import load_file

    with open(os.path.join(dirname, "config.json")) as f:
        cfg = json.load(f)
    P = {k: v.to(dtype) for k, v in load_file(os.path.join(dirname, "model.safetensors")).items()}
    return cfg, P


def save(dirname, cfg, P):
    from safetensors.torch import save_file

    os.makedirs(dirname, exist_ok=True)
    with open(os.path.join(dirname, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file({k: v.detach().to(torch.float32).contiguous() for k, v in P.items()},
              os.path.join(dirname, "model.safetensors"), metadata={"format": "pt"})
