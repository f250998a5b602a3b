//! Optimisers (AdamW and Muon), learning-rate schedules and gradient clipping, over the flat
//! parameter buffer.
//!
//! Parameter groups:
//! - **Muon** (when selected): the 2-D hidden matrices — `q/k/v/o_proj`, `gate/up/down_proj`,
//!   and the `[d, d]` query projections of the input-dependent-query ablation (under AdamW their
//!   d² entries all moving by ~lr per step made the depth logits blow up).
//!   Update `O = NewtonSchulz5(Nesterov momentum)`, scaled by `0.2·sqrt(max(rows, cols))` so its
//!   RMS matches AdamW's and both groups share one learning rate (the scaling Moonshot uses for
//!   Muon at scale), with decoupled weight decay.
//! - **AdamW** for everything else, and for everything when `optimizer = "adamw"`.
//! - **No weight decay** for RMSNorm gains, depth key-norm gains, pseudo-queries and the token
//!   embedding; the untied LM head and the hidden matrices are decayed.

use crate::kernels::adamw::{self, AdamStep};
use crate::kernels::matmul::{matmul, threads};
use crate::model::params::{Init, Layout, ParamSpec};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    Adamw,
    Muon,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// Linear warmup, then cosine decay to `min_lr_ratio · lr`.
    Cosine,
    /// Warmup-stable-decay: linear warmup, constant, then linear decay over the last
    /// `decay_fraction` of the steps to `min_lr_ratio · lr`.
    Wsd,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct OptimConfig {
    pub optimizer: OptimizerKind,
    pub lr: f64,
    pub min_lr_ratio: f64,
    pub warmup_steps: usize,
    pub schedule: ScheduleKind,
    pub decay_fraction: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub adam_eps: f64,
    pub muon_momentum: f64,
    /// Global gradient-norm clip (0 disables).
    pub grad_clip: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            optimizer: OptimizerKind::Adamw,
            lr: 3e-3,
            min_lr_ratio: 0.1,
            warmup_steps: 10,
            schedule: ScheduleKind::Cosine,
            decay_fraction: 0.2,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            adam_eps: 1e-8,
            muon_momentum: 0.95,
            grad_clip: 1.0,
        }
    }
}

impl OptimConfig {
    /// The factor that scales gradients of global norm `norm` down to `grad_clip`, where
    /// clipping is on and they exceed it.
    pub fn clip_factor(&self, norm: f64) -> Option<f32> {
        let max = self.grad_clip;
        (max > 0.0 && norm > max).then(|| (max / (norm + 1e-12)) as f32)
    }
}

/// Learning rate at `step` (0-based) of `total`.
pub fn lr_at(c: &OptimConfig, step: usize, total: usize) -> f64 {
    let min = c.lr * c.min_lr_ratio;
    if step < c.warmup_steps {
        return c.lr * (step + 1) as f64 / c.warmup_steps as f64;
    }
    let total = total.max(c.warmup_steps + 1);
    match c.schedule {
        ScheduleKind::Cosine => {
            let t = (step - c.warmup_steps) as f64 / (total - c.warmup_steps) as f64;
            min + 0.5 * (c.lr - min) * (1.0 + (std::f64::consts::PI * t.min(1.0)).cos())
        }
        ScheduleKind::Wsd => {
            let decay = ((total as f64) * c.decay_fraction).round().max(1.0) as usize;
            let start = total.saturating_sub(decay).max(c.warmup_steps);
            if step < start {
                c.lr
            } else {
                let t = (step - start + 1) as f64 / (total - start) as f64;
                c.lr + (min - c.lr) * t.min(1.0)
            }
        }
    }
}

/// How one parameter tensor is updated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rule {
    Adam { decay: bool },
    Muon { rows: usize, cols: usize },
}

fn rule(spec: &ParamSpec, kind: OptimizerKind) -> Rule {
    let query_matrix = spec.name.contains("res_proj") && spec.shape.len() == 2 && spec.shape[0] > 1;
    let hidden_matrix =
        spec.name.contains(".self_attn.") || spec.name.contains(".mlp.") || query_matrix;
    if kind == OptimizerKind::Muon && hidden_matrix && spec.shape.len() == 2 {
        return Rule::Muon { rows: spec.shape[0], cols: spec.shape[1] };
    }
    let no_decay = spec.init != Init::Normal || spec.name == "model.embed_tokens.weight";
    Rule::Adam { decay: !no_decay }
}

/// Optimiser state, laid out like the parameters.
pub struct Optimizer {
    pub config: OptimConfig,
    /// Updates taken so far.
    pub step: u64,
    /// AdamW first and second moments (zero where Muon applies).
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// Muon momentum (zero where AdamW applies).
    pub momentum: Vec<f32>,
    rules: Vec<(std::ops::Range<usize>, Rule)>,
}

impl Optimizer {
    pub fn new(config: OptimConfig, layout: &Layout) -> Optimizer {
        let rules =
            layout.specs.iter().map(|s| (s.range.clone(), rule(s, config.optimizer))).collect();
        // A pipeline stage's part of the layout may hold copies after the tensors it updates.
        let n = layout.updated();
        Optimizer {
            config,
            step: 0,
            m: vec![0.0; n],
            v: vec![0.0; n],
            momentum: vec![0.0; n],
            rules,
        }
    }

    /// Each tensor's range and how it is updated.
    pub fn rules(&self) -> &[(std::ops::Range<usize>, Rule)] {
        &self.rules
    }

    /// Scales `grads` down to the configured global norm when `norm` (theirs, [`global_norm`])
    /// exceeds it.
    pub fn clip(&self, grads: &mut [f32], norm: f64) {
        if let Some(s) = self.config.clip_factor(norm) {
            grads.par_chunks_mut(1 << 16).for_each(|c| c.iter_mut().for_each(|g| *g *= s));
        }
    }

    /// One update of `params` with learning rate `lr`.
    pub fn update(&mut self, params: &mut [f32], grads: &[f32], lr: f64) {
        self.step += 1;
        let c = self.config.clone();
        let t = self.step as i32;
        for (range, rule) in self.rules.clone() {
            let p = &mut params[range.clone()];
            let g = &grads[range.clone()];
            match rule {
                Rule::Adam { decay } => {
                    let wd = if decay { c.weight_decay } else { 0.0 };
                    let k = AdamStep::at(t, c.beta1, c.beta2, c.adam_eps, lr, wd);
                    let (m, v) = (&mut self.m[range.clone()], &mut self.v[range.clone()]);
                    p.par_chunks_mut(4096)
                        .zip(g.par_chunks(4096))
                        .zip(m.par_chunks_mut(4096).zip(v.par_chunks_mut(4096)))
                        .for_each(|((p, g), (m, v))| {
                            for i in 0..p.len() {
                                adamw::update(&mut p[i], &mut m[i], &mut v[i], g[i], &k);
                            }
                        });
                }
                Rule::Muon { rows, cols } => {
                    let buf = &mut self.momentum[range.clone()];
                    let mu = c.muon_momentum as f32;
                    // Nesterov: B ← μB + G, direction G + μB.
                    let mut dir = vec![0.0f32; g.len()];
                    for i in 0..g.len() {
                        buf[i] = mu * buf[i] + g[i];
                        dir[i] = g[i] + mu * buf[i];
                    }
                    let o = newton_schulz(&dir, rows, cols);
                    let scale = 0.2 * (rows.max(cols) as f64).sqrt();
                    let decay = 1.0 - lr * c.weight_decay;
                    for i in 0..p.len() {
                        p[i] = (p[i] as f64 * decay - lr * scale * o[i] as f64) as f32;
                    }
                }
            }
        }
    }
}

/// Each tensor's sum of squared gradients, in `layout` order: over pieces of 2^16 values
/// (summed in parallel), then the pieces added in order. The same bits for any number of threads,
/// and for a tensor wherever it lies, so that pipeline stages holding different tensors get the
/// bits one process gets.
pub fn tensor_squares(layout: &Layout, grads: &[f32]) -> Vec<f64> {
    layout
        .specs
        .iter()
        .map(|s| {
            let pieces: Vec<f64> = grads[s.range.clone()]
                .par_chunks(1 << 16)
                .map(|c| c.iter().map(|g| (*g as f64) * (*g as f64)).sum::<f64>())
                .collect();
            pieces.iter().sum::<f64>()
        })
        .collect()
}

/// The global L2 norm of the gradients whose [`tensor_squares`] are `squares`: added in order.
pub fn global_norm(squares: &[f64]) -> f64 {
    squares.iter().sum::<f64>().sqrt()
}

/// Approximate orthogonalisation `U Vᵀ` of `g` (`[rows, cols]`) by five quintic Newton–Schulz
/// iterations with the usual coefficients (3.4445, −4.7750, 2.0315), on the wide orientation.
pub fn newton_schulz(g: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let (a, b, c) = (3.4445f32, -4.7750f32, 2.0315f32);
    let tall = rows > cols;
    // Work on X [r, k] with r <= k.
    let (r, k) = if tall { (cols, rows) } else { (rows, cols) };
    let mut x = vec![0.0f32; r * k];
    if tall {
        for i in 0..rows {
            for j in 0..cols {
                x[j * rows + i] = g[i * cols + j];
            }
        }
    } else {
        x.copy_from_slice(g);
    }
    let norm = x.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>().sqrt() as f32 + 1e-7;
    x.iter_mut().for_each(|v| *v /= norm);
    let (mut s, mut s2, mut y) = (vec![0.0f32; r * r], vec![0.0f32; r * r], vec![0.0f32; r * k]);
    for _ in 0..5 {
        // S = X Xᵀ; P = b S + c S²; X ← a X + P X
        matmul(&mut s, &x, false, &x, true, r, k, r, false, threads());
        matmul(&mut s2, &s, false, &s, false, r, r, r, false, threads());
        for i in 0..r * r {
            s2[i] = b * s[i] + c * s2[i];
        }
        matmul(&mut y, &s2, false, &x, false, r, r, k, false, threads());
        for i in 0..r * k {
            x[i] = a * x[i] + y[i];
        }
    }
    if tall {
        let mut out = vec![0.0f32; rows * cols];
        for i in 0..rows {
            for j in 0..cols {
                out[i * cols + j] = x[j * rows + i];
            }
        }
        out
    } else {
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Config, ResidualKind};

    fn cfg(kind: OptimizerKind) -> OptimConfig {
        OptimConfig { optimizer: kind, lr: 0.01, ..OptimConfig::default() }
    }

    #[test]
    fn muon_takes_the_hidden_and_query_matrices() {
        use crate::model::Config;
        let c = Config {
            hidden_size: 16,
            head_dim: 8,
            intermediate_size: 24,
            num_hidden_layers: 1,
            vocab_size: 40,
            residual: crate::model::ResidualKind::Full,
            ..Config::default()
        };
        let input = c.with_overrides(&["attn_res_query=input".to_string()]).unwrap();
        let rule_of =
            |c: &Config, name: &str| rule(Layout::new(c).spec(name).unwrap(), OptimizerKind::Muon);
        assert_eq!(
            rule_of(&c, "model.layers.0.mlp.down_proj.weight"),
            Rule::Muon { rows: 16, cols: 24 }
        );
        assert_eq!(rule_of(&c, "model.layers.0.attn_res_proj.weight"), Rule::Adam { decay: false });
        assert_eq!(
            rule_of(&input, "model.layers.0.attn_res_proj.weight"),
            Rule::Muon { rows: 16, cols: 16 }
        );
        assert_eq!(rule_of(&c, "model.embed_tokens.weight"), Rule::Adam { decay: false });
    }

    #[test]
    fn schedules() {
        let mut c = cfg(OptimizerKind::Adamw);
        assert!((lr_at(&c, 0, 100) - 0.001).abs() < 1e-12);
        assert!((lr_at(&c, 9, 100) - 0.01).abs() < 1e-12);
        assert!((lr_at(&c, 10, 100) - 0.01).abs() < 1e-12);
        assert!((lr_at(&c, 55, 100) - 0.0055).abs() < 1e-9, "{}", lr_at(&c, 55, 100));
        assert!((lr_at(&c, 100, 100) - 0.001).abs() < 1e-12);
        c.schedule = ScheduleKind::Wsd;
        assert_eq!(lr_at(&c, 79, 100), 0.01);
        assert!(lr_at(&c, 80, 100) < 0.01);
        assert!((lr_at(&c, 99, 100) - 0.001).abs() < 1e-12);
    }

    fn small_model(residual: ResidualKind) -> Config {
        Config {
            residual,
            num_blocks: 2,
            vocab_size: 10,
            hidden_size: 8,
            head_dim: 4,
            num_attention_heads: 2,
            num_key_value_heads: 2,
            intermediate_size: 12,
            num_hidden_layers: 1,
            tie_word_embeddings: false,
            ..Config::default()
        }
    }

    /// A gradient that changes size and sign from step to step (so that β1 and β2 leave
    /// different marks), deterministic in `(i, t)`.
    fn gradient(n: usize, t: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let u = ((i * 7919 + t * 104_729) % 201) as f32 / 100.0 - 1.0;
                u * 0.01 * (1.0 + t as f32) * if (i + t).is_multiple_of(3) { -1.0 } else { 1.0 }
            })
            .collect()
    }

    /// Decayed tensors as the module documents them: the hidden matrices and an untied LM
    /// head; never the embedding, gains or pseudo-queries.
    fn decayed(name: &str) -> bool {
        name.contains(".self_attn.") || name.contains(".mlp.") || name == "lm_head.weight"
    }

    /// Textbook AdamW in f64 (Loshchilov & Hutter, with the decay scaled by the learning rate
    /// as the module documents): `m ← β1 m + (1−β1) g`, `v ← β2 v + (1−β2) g²`,
    /// `p ← p − lr·(m/(1−β1^t) / (sqrt(v/(1−β2^t)) + eps) + wd·p)`.
    struct AdamRef {
        m: f64,
        v: f64,
    }

    impl AdamRef {
        fn step(&mut self, c: &OptimConfig, p: f64, g: f64, lr: f64, t: i32, wd: f64) -> f64 {
            self.m = c.beta1 * self.m + (1.0 - c.beta1) * g;
            self.v = c.beta2 * self.v + (1.0 - c.beta2) * g * g;
            let (m_hat, v_hat) =
                (self.m / (1.0 - c.beta1.powi(t)), self.v / (1.0 - c.beta2.powi(t)));
            p - lr * (m_hat / (v_hat.sqrt() + c.adam_eps) + wd * p)
        }
    }

    const LRS: [f64; 4] = [0.01, 0.02, 0.005, 0.015];

    /// A fresh optimiser of `kind` on a small model, and the parameters before and after it
    /// takes `steps` updates with [`gradient`] and [`LRS`].
    fn updated(kind: OptimizerKind, residual: ResidualKind, steps: usize) -> Run {
        let c = small_model(residual);
        let layout = Layout::new(&c);
        let config = cfg(kind);
        let mut opt = Optimizer::new(config.clone(), &layout);
        let before = layout.init(&c, 1);
        let mut after = before.clone();
        for (t, lr) in LRS[..steps].iter().enumerate() {
            opt.update(&mut after, &gradient(before.len(), t), *lr);
        }
        Run { layout, config, before, after }
    }

    struct Run {
        layout: Layout,
        config: OptimConfig,
        before: Vec<f32>,
        after: Vec<f32>,
    }

    #[test]
    fn adamw_matches_a_textbook_reference_under_varying_gradients() {
        let Run { layout: lay, config: oc, before: p0, after: p } =
            updated(OptimizerKind::Adamw, ResidualKind::Block, LRS.len());
        // β1 and β2 swapped: what a constant gradient could not tell apart.
        let swapped = OptimConfig { beta1: oc.beta2, beta2: oc.beta1, ..oc.clone() };
        let mut apart = 0f64;
        for s in &lay.specs {
            let wd = if decayed(&s.name) { oc.weight_decay } else { 0.0 };
            for i in s.range.clone() {
                let (mut a, mut b) = (AdamRef { m: 0.0, v: 0.0 }, AdamRef { m: 0.0, v: 0.0 });
                let (mut want, mut other) = (p0[i] as f64, p0[i] as f64);
                for (t, lr) in LRS.iter().enumerate() {
                    let g = gradient(p.len(), t)[i] as f64;
                    want = a.step(&oc, want, g, *lr, t as i32 + 1, wd);
                    other = b.step(&swapped, other, g, *lr, t as i32 + 1, wd);
                }
                apart = apart.max((want - other).abs());
                // f32 storage of p, m and v: ~1e-7 relative per step.
                assert!(
                    (p[i] as f64 - want).abs() < 1e-6 * (1.0 + want.abs()),
                    "{} [{i}]: {} vs {want}",
                    s.name,
                    p[i]
                );
            }
        }
        assert!(apart > 1e-3, "the gradients must tell β1 from β2 ({apart})");
    }

    /// Five quintic Newton–Schulz iterations in f64, written from the published recipe:
    /// `X ← a X + (b A + c A²) X` with `A = X Xᵀ`, on the wide orientation, after dividing by
    /// the Frobenius norm (+1e-7).
    fn newton_schulz_ref(g: &[f32], rows: usize, cols: usize) -> Vec<f64> {
        let tall = rows > cols;
        let (r, k) = if tall { (cols, rows) } else { (rows, cols) };
        let at = |i: usize, j: usize| (if tall { g[j * cols + i] } else { g[i * cols + j] }) as f64;
        let mut x: Vec<f64> = (0..r * k).map(|e| at(e / k, e % k)).collect();
        let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt() + 1e-7;
        x.iter_mut().for_each(|v| *v /= norm);
        let mul = |a: &[f64], b: &[f64], n: usize, m: usize, p: usize, bt: bool| -> Vec<f64> {
            // [n, m] x [m, p] (or x [p, m]ᵀ when bt)
            (0..n * p)
                .map(|e| {
                    let (i, j) = (e / p, e % p);
                    (0..m)
                        .map(|l| a[i * m + l] * if bt { b[j * m + l] } else { b[l * p + j] })
                        .sum()
                })
                .collect()
        };
        for _ in 0..5 {
            let a = mul(&x, &x, r, k, r, true);
            let a2 = mul(&a, &a, r, r, r, false);
            let poly: Vec<f64> =
                a.iter().zip(&a2).map(|(a, a2)| -4.7750 * a + 2.0315 * a2).collect();
            let px = mul(&poly, &x, r, r, k, false);
            x.iter_mut().zip(&px).for_each(|(x, p)| *x = 3.4445 * *x + p);
        }
        (0..rows * cols)
            .map(|e| {
                let (i, j) = (e / cols, e % cols);
                if tall {
                    x[j * rows + i]
                } else {
                    x[i * cols + j]
                }
            })
            .collect()
    }

    #[test]
    fn newton_schulz_orthogonalises() {
        for (rows, cols) in [(8, 32), (32, 8), (16, 24), (24, 16)] {
            // Pseudo-random entries (a splitmix hash): a full-rank, well-spread spectrum.
            let g: Vec<f32> = (0..(rows * cols) as u64)
                .map(|i| {
                    let mut x = (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    x = (x ^ (x >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
                })
                .collect();
            let o = newton_schulz(&g, rows, cols);
            let want = newton_schulz_ref(&g, rows, cols);
            for (i, (a, w)) in o.iter().zip(&want).enumerate() {
                assert!((*a as f64 - w).abs() < 1e-4, "{rows}x{cols} [{i}]: {a} vs {w}");
            }
            // The whole Gram matrix on the short side (O·Oᵀ wide, Oᵀ·O tall) is near I, but
            // only as near as the quintic goes: its coefficients trade convergence for speed
            // and leave the singular values spread around 1 (about [0.7, 1.2]), so entries,
            // off-diagonals included, deviate from I's by up to ~0.4 (0.39 seen on these
            // shapes); the elementwise comparison above is the precise check.
            let (r, k) = (rows.min(cols), rows.max(cols));
            let el =
                |a: usize, b: usize| if rows <= cols { o[a * cols + b] } else { o[b * cols + a] };
            for a in 0..r {
                for b in 0..r {
                    let dot: f64 = (0..k).map(|l| el(a, l) as f64 * el(b, l) as f64).sum();
                    let want = if a == b { 1.0 } else { 0.0 };
                    assert!((dot - want).abs() < 0.45, "{rows}x{cols}: gram[{a}][{b}] = {dot}");
                }
            }
            // For contrast, the input's own normalised Gram matrix is far from I.
            let gn = (g.iter().map(|v| (*v as f64).powi(2)).sum::<f64>()).sqrt();
            let ge = |a: usize, b: usize| {
                (if rows <= cols { g[a * cols + b] } else { g[b * cols + a] }) as f64 / gn
            };
            let g00: f64 = (0..k).map(|l| ge(0, l) * ge(0, l)).sum();
            assert!(g00 < 0.5, "{rows}x{cols}: input gram[0][0] {g00}");
        }
    }

    /// Muon's whole update against an independent reference over three steps with varying
    /// gradients and learning rates: Nesterov momentum (`B ← μB + G`, direction `G + μB`),
    /// Newton–Schulz, scaling by `0.2·sqrt(max(rows, cols))` and decoupled weight decay
    /// `p ← p·(1 − lr·wd) − lr·scale·O` on the hidden matrices; AdamW on everything else.
    #[test]
    fn muon_matches_an_independent_reference() {
        let Run { layout: lay, config: oc, before: p0, after: p } =
            updated(OptimizerKind::Muon, ResidualKind::Full, 3);
        let lrs = &LRS[..3];
        let mut checked = 0;
        for s in &lay.specs {
            let r = s.range.clone();
            let muon =
                (s.name.contains(".self_attn.") || s.name.contains(".mlp.")) && s.shape.len() == 2;
            let mut want: Vec<f64> = p0[r.clone()].iter().map(|v| *v as f64).collect();
            if muon {
                let (rows, cols) = (s.shape[0], s.shape[1]);
                let mut buf = vec![0f64; r.len()];
                for (t, lr) in lrs.iter().enumerate() {
                    let g = &gradient(p.len(), t)[r.clone()];
                    let mut dir = vec![0f32; r.len()];
                    for i in 0..r.len() {
                        buf[i] = oc.muon_momentum * buf[i] + g[i] as f64;
                        dir[i] = (g[i] as f64 + oc.muon_momentum * buf[i]) as f32;
                    }
                    let o = newton_schulz_ref(&dir, rows, cols);
                    let scale = 0.2 * (rows.max(cols) as f64).sqrt();
                    for (w, o) in want.iter_mut().zip(&o) {
                        *w = *w * (1.0 - lr * oc.weight_decay) - lr * scale * o;
                    }
                }
                checked += 1;
            } else {
                let wd = if decayed(&s.name) { oc.weight_decay } else { 0.0 };
                for (j, w) in want.iter_mut().enumerate() {
                    let mut a = AdamRef { m: 0.0, v: 0.0 };
                    for (t, lr) in lrs.iter().enumerate() {
                        let g = gradient(p.len(), t)[r.start + j] as f64;
                        *w = a.step(&oc, *w, g, *lr, t as i32 + 1, wd);
                    }
                }
            }
            for (j, (a, w)) in p[r].iter().zip(&want).enumerate() {
                // Newton–Schulz in f32 against f64: ~1e-5 of an entry of O, times lr·scale.
                assert!(
                    (*a as f64 - w).abs() < 2e-6 * (1.0 + w.abs()),
                    "{}[{j}]: {a} vs {w}",
                    s.name
                );
            }
        }
        assert_eq!(checked, 7, "q, k, v, o, gate, up, down");
    }

    #[test]
    fn clipping_scales_to_the_limit() {
        let c = Config {
            vocab_size: 10,
            hidden_size: 8,
            head_dim: 4,
            num_attention_heads: 2,
            num_key_value_heads: 2,
            intermediate_size: 8,
            num_hidden_layers: 1,
            ..Config::default()
        };
        let layout = Layout::new(&c);
        let opt = Optimizer::new(cfg(OptimizerKind::Muon), &layout);
        let mut g = vec![1.0f32; layout.total];
        let before = global_norm(&tensor_squares(&layout, &g));
        assert!((before - (g.len() as f64).sqrt()).abs() < 1e-6);
        opt.clip(&mut g, before);
        assert!((global_norm(&tensor_squares(&layout, &g)) - 1.0).abs() < 1e-4);
    }
}
