//! The AdamW update of one parameter: its moments and the step, in f64, each operation rounded
//! on its own. The optimiser (`train::optim`) runs it on the CPU and the GPU's kernel
//! (`src/gpu/kernels/adamw.cu`) does the same operations in the same order, so both give the
//! same bits.

/// What one step's updates share.
#[derive(Clone, Copy, Debug)]
pub struct AdamStep {
    pub beta1: f64,
    pub beta2: f64,
    /// The bias corrections `1 − β1^t` and `1 − β2^t` at step `t` (from 1).
    pub bc1: f64,
    pub bc2: f64,
    pub eps: f64,
    pub lr: f64,
    /// Decoupled weight decay (0 for the parameters that take none).
    pub weight_decay: f64,
}

impl AdamStep {
    pub fn at(step: i32, beta1: f64, beta2: f64, eps: f64, lr: f64, weight_decay: f64) -> AdamStep {
        let (bc1, bc2) = (1.0 - beta1.powi(step), 1.0 - beta2.powi(step));
        AdamStep { beta1, beta2, bc1, bc2, eps, lr, weight_decay }
    }
}

/// `p ← p − lr·(m̂ / (sqrt(v̂) + eps) + wd·p)` with the moments updated from `g` first; the
/// moments are kept in f32.
#[inline(always)]
pub fn update(p: &mut f32, m: &mut f32, v: &mut f32, g: f32, k: &AdamStep) {
    let g = g as f64;
    let mi = k.beta1 * *m as f64 + (1.0 - k.beta1) * g;
    let vi = k.beta2 * *v as f64 + (1.0 - k.beta2) * g * g;
    *m = mi as f32;
    *v = vi as f32;
    let step = (mi / k.bc1) / ((vi / k.bc2).sqrt() + k.eps) + k.weight_decay * *p as f64;
    *p = (*p as f64 - k.lr * step) as f32;
}
