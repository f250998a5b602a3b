//! A plain-loop float64 forward pass written from the method's equations (docs/method.md §2–4),
//! sharing no code with the library: the independent side of the zero-init and diagnostics
//! tests. It reads a model's parameters by their checkpoint names and records what the
//! diagnostics measure: every sublayer's input `h_l` and raw output, every consumer's depth
//! weights α, the vector fed to the final norm, and the logits.

use attnres::model::{Model, ResidualKind};

pub struct RefForward {
    /// Per sublayer, its input `h_l` (`[rows][d]`).
    pub inputs: Vec<Vec<Vec<f64>>>,
    /// Per sublayer, its raw output `f_l(h_l)` (`[rows][d]`).
    pub outputs: Vec<Vec<Vec<f64>>>,
    /// AttnRes only: per consumer (sublayers, then the output aggregation), per token, the
    /// weight on each of its sources in reading order (embedding, completed blocks, partial).
    pub alpha: Vec<Vec<Vec<f64>>>,
    /// The vector fed to the final norm (`[rows][d]`).
    pub final_input: Vec<Vec<f64>>,
    /// `[rows][vocab]`.
    pub logits: Vec<Vec<f64>>,
}

/// A model's configuration and layout with float64 parameters.
pub struct Ref<'a> {
    pub m: &'a Model,
    pub params: Vec<f64>,
}

impl<'a> Ref<'a> {
    pub fn new(m: &'a Model) -> Ref<'a> {
        Ref { m, params: m.params.iter().map(|v| *v as f64).collect() }
    }
}

fn param<'a>(r: &'a Ref, name: &str) -> &'a [f64] {
    let s = r.m.layout.spec(name).unwrap_or_else(|| panic!("no parameter {name}"));
    &r.params[s.range.clone()]
}

/// `x Wᵀ` for one row, `W` `[out, in]` row-major.
fn linear(x: &[f64], w: &[f64], out: usize) -> Vec<f64> {
    let n = x.len();
    (0..out).map(|o| (0..n).map(|i| x[i] * w[o * n + i]).sum()).collect()
}

/// `x / sqrt(mean(x²) + eps) · g`.
fn rmsnorm(x: &[f64], g: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(g).map(|(v, g)| v * r * g).collect()
}

/// Rotate-half rotary embedding of one head vector at position `pos`.
fn rope(x: &mut [f64], pos: usize, theta: f64) {
    let hd = x.len();
    let half = hd / 2;
    for i in 0..half {
        let ang = pos as f64 / theta.powf(2.0 * i as f64 / hd as f64);
        let (s, c) = ang.sin_cos();
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

/// Causal multi-head attention (grouped KV heads) of sublayer `2·layer` on normed rows.
fn attention(m: &Ref, layer: usize, xn: &[Vec<f64>], batch: usize, seq: usize) -> Vec<Vec<f64>> {
    let c = &m.m.config;
    let (h, kv, hd, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size);
    let p = format!("model.layers.{layer}.self_attn");
    let (wq, wk, wv, wo) = (
        param(m, &format!("{p}.q_proj.weight")),
        param(m, &format!("{p}.k_proj.weight")),
        param(m, &format!("{p}.v_proj.weight")),
        param(m, &format!("{p}.o_proj.weight")),
    );
    let mut q: Vec<Vec<f64>> = xn.iter().map(|x| linear(x, wq, h * hd)).collect();
    let mut k: Vec<Vec<f64>> = xn.iter().map(|x| linear(x, wk, kv * hd)).collect();
    let v: Vec<Vec<f64>> = xn.iter().map(|x| linear(x, wv, kv * hd)).collect();
    for (r, (qr, kr)) in q.iter_mut().zip(&mut k).enumerate() {
        let pos = r % seq;
        qr.chunks_mut(hd).for_each(|x| rope(x, pos, c.rope_theta));
        kr.chunks_mut(hd).for_each(|x| rope(x, pos, c.rope_theta));
    }
    let mut out = Vec::with_capacity(batch * seq);
    for b in 0..batch {
        for t in 0..seq {
            let mut o = vec![0.0; h * hd];
            for head in 0..h {
                let g = head / (h / kv);
                let qh = &q[b * seq + t][head * hd..(head + 1) * hd];
                let scores: Vec<f64> = (0..=t)
                    .map(|s| {
                        let kh = &k[b * seq + s][g * hd..(g + 1) * hd];
                        qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let w = softmax(&scores);
                for (s, ws) in w.iter().enumerate() {
                    let vh = &v[b * seq + s][g * hd..(g + 1) * hd];
                    for i in 0..hd {
                        o[head * hd + i] += ws * vh[i];
                    }
                }
            }
            out.push(linear(&o, wo, d));
        }
    }
    out
}

/// SwiGLU MLP of sublayer `2·layer + 1` on one normed row.
fn mlp(m: &Ref, layer: usize, x: &[f64]) -> Vec<f64> {
    let (f, d) = (m.m.config.intermediate_size, m.m.config.hidden_size);
    let p = format!("model.layers.{layer}.mlp");
    let g = linear(x, param(m, &format!("{p}.gate_proj.weight")), f);
    let u = linear(x, param(m, &format!("{p}.up_proj.weight")), f);
    let act: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
    linear(&act, param(m, &format!("{p}.down_proj.weight")), d)
}

pub fn softmax(x: &[f64]) -> Vec<f64> {
    let max = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = x.iter().map(|v| (v - max).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

/// Depth attention of one token (docs/method.md §3): softmax over sources of
/// `Σ_d q[d]·γ[d]·v[d] / rms(v)`, applied to the raw sources. Returns the mix and α.
fn depth(sources: &[&[f64]], q: &[f64], gain: &[f64], eps: f64) -> (Vec<f64>, Vec<f64>) {
    let logits: Vec<f64> = sources
        .iter()
        .map(|v| rmsnorm(v, gain, eps).iter().zip(q).map(|(k, q)| k * q).sum())
        .collect();
    let alpha = softmax(&logits);
    let mut h = vec![0.0; sources[0].len()];
    for (a, v) in alpha.iter().zip(sources) {
        h.iter_mut().zip(v.iter()).for_each(|(h, v)| *h += a * v);
    }
    (h, alpha)
}

/// The forward pass of `m` on `batch × seq` token ids. `norm_eps(l)` is the eps of the PreNorm
/// of sublayer `l` (`l = L`: the final norm); the depth key norms use the config's eps.
pub fn forward(
    m: &Ref,
    ids: &[u32],
    batch: usize,
    seq: usize,
    norm_eps: &dyn Fn(usize) -> f64,
) -> RefForward {
    let c = &m.m.config;
    let (d, n_layers) = (c.hidden_size, c.num_hidden_layers);
    let sublayers = 2 * n_layers;
    let rows = batch * seq;
    let emb = param(m, "model.embed_tokens.weight");
    let e: Vec<Vec<f64>> = ids.iter().map(|&t| emb[t as usize * d..][..d].to_vec()).collect();
    let block = match c.residual {
        ResidualKind::Standard => None,
        ResidualKind::Full => Some(1),
        // Blocks of 2 * attn_res_block_size sublayers, the last one shorter, when it is given.
        ResidualKind::Block => {
            Some(c.attn_res_block_size.map_or(sublayers / c.num_blocks, |b| 2 * b))
        }
    };
    let mut r = RefForward {
        inputs: vec![],
        outputs: vec![],
        alpha: vec![],
        final_input: vec![],
        logits: vec![],
    };
    // Standard: the stream. AttnRes: completed sources b_0.. and the partial sum.
    let mut stream = e.clone();
    let mut blocks: Vec<Vec<Vec<f64>>> = vec![e];
    let mut partial: Option<Vec<Vec<f64>>> = None;
    let mix = |name: &str, blocks: &[Vec<Vec<f64>>], partial: &Option<Vec<Vec<f64>>>| {
        let (q, g) =
            (param(m, &format!("{name}_proj.weight")), param(m, &format!("{name}_norm.weight")));
        let mut hs = Vec::with_capacity(rows);
        let mut alphas = Vec::with_capacity(rows);
        for t in 0..rows {
            let mut srcs: Vec<&[f64]> = blocks.iter().map(|b| b[t].as_slice()).collect();
            if let Some(p) = partial {
                srcs.push(&p[t]);
            }
            let (h, a) = depth(&srcs, q, g, c.rms_norm_eps);
            hs.push(h);
            alphas.push(a);
        }
        (hs, alphas)
    };
    for l in 0..sublayers {
        let layer = l / 2;
        let h = match block {
            None => stream.clone(),
            Some(_) => {
                let kind = if l % 2 == 0 { "attn" } else { "mlp" };
                let (h, a) = mix(&format!("model.layers.{layer}.{kind}_res"), &blocks, &partial);
                r.alpha.push(a);
                h
            }
        };
        let gain = if l % 2 == 0 { "input_layernorm" } else { "post_attention_layernorm" };
        let g = param(m, &format!("model.layers.{layer}.{gain}.weight"));
        let xn: Vec<Vec<f64>> = h.iter().map(|x| rmsnorm(x, g, norm_eps(l))).collect();
        let out = if l % 2 == 0 {
            attention(m, layer, &xn, batch, seq)
        } else {
            xn.iter().map(|x| mlp(m, layer, x)).collect()
        };
        match block {
            None => stream.iter_mut().zip(&out).for_each(|(s, o)| add(s, o)),
            Some(s) => {
                let mut p = partial.take().unwrap_or_else(|| vec![vec![0.0; d]; rows]);
                p.iter_mut().zip(&out).for_each(|(p, o)| add(p, o));
                if (l + 1) % s == 0 || l + 1 == sublayers {
                    blocks.push(p);
                } else {
                    partial = Some(p);
                }
            }
        }
        r.inputs.push(h);
        r.outputs.push(out);
    }
    r.final_input = match block {
        None => stream,
        Some(_) => {
            let (h, a) = mix("model.output_attn_res", &blocks, &None);
            r.alpha.push(a);
            h
        }
    };
    let g = param(m, "model.norm.weight");
    let head = if c.tie_word_embeddings { emb } else { param(m, "lm_head.weight") };
    r.logits = r
        .final_input
        .iter()
        .map(|x| linear(&rmsnorm(x, g, norm_eps(sublayers)), head, c.vocab_size))
        .collect();
    r
}

/// Mean cross-entropy of `logits` against `targets`.
pub fn loss(logits: &[Vec<f64>], targets: &[u32]) -> f64 {
    let nll = |row: &[f64], t: u32| {
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln() - row[t as usize]
    };
    logits.iter().zip(targets).map(|(r, &t)| nll(r, t)).sum::<f64>() / targets.len() as f64
}

fn add(a: &mut [f64], b: &[f64]) {
    a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
}

/// Root mean square of one row (no eps).
pub fn rms(x: &[f64]) -> f64 {
    (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64).sqrt()
}

/// How many sources consumer `l` of an AttnRes model with `block` sublayers per block reads
/// (`l = L`: the output aggregation): the embedding, the completed blocks, the partial sum.
pub fn sources_read(l: usize, block: usize) -> usize {
    1 + l / block + usize::from(!l.is_multiple_of(block))
}
