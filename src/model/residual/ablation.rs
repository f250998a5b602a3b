//! The ablations of docs/method.md §5 (`attn_res_*` config keys): per-token queries, other
//! gates, heads or a window, which the two-phase form does not cover. Each consumer runs in the
//! one-pass form of [`crate::kernels::depth::ablation`] over the same sources as the method.

use super::attnres::{depth_params, query_grad, DepthSaved, InputQuery, Sources};
use crate::kernels::depth::ablation::{self as depth_ablation, Gate, Options, Query};
use crate::kernels::matmul::{linear, linear_backward_input, linear_backward_weight};
use crate::kernels::{self, rmsnorm, zeros};
use crate::model::config::{Config, DepthGate, DepthQuery};
use crate::model::params::{DepthParams, Layout};

/// The ablation options, when any is set (the GPU runs them from this description too).
#[derive(Clone, Copy)]
pub(crate) struct Ablation {
    pub options: Options,
    pub query: DepthQuery,
    window: usize,
    /// Number of distinct sources (scalar and dense mixing keep one weight per source).
    pub depth_sources: usize,
}

impl Ablation {
    pub fn of(c: &Config) -> Option<Ablation> {
        if c.block_size().is_none() || c.depth_is_default() {
            return None;
        }
        let gate = match (c.attn_res_query, c.attn_res_gate) {
            (DepthQuery::Dense, _) => Gate::Identity,
            (_, DepthGate::Softmax) => Gate::Softmax,
            (_, DepthGate::Sigmoid) => Gate::Sigmoid,
        };
        Some(Ablation {
            options: Options { key_norm: c.attn_res_key_norm, gate, heads: c.attn_res_heads },
            query: c.attn_res_query,
            window: c.attn_res_window,
            depth_sources: c.depth_sources(),
        })
    }

    pub fn heads(&self) -> usize {
        self.options.heads
    }

    /// The completed sources a consumer reads when `completed` exist: the embedding and the
    /// latest `window` others (all without a window).
    fn blocks_read(&self, completed: usize) -> Vec<usize> {
        std::iter::once(0).chain(self.first_read(completed)..completed).collect()
    }

    /// The first completed source after the embedding that a consumer reads when `completed`
    /// exist (`completed` itself when it reads the embedding alone).
    pub fn first_read(&self, completed: usize) -> usize {
        if self.window > 0 {
            completed.saturating_sub(self.window).max(1)
        } else {
            1
        }
    }

    /// Consumer `l`'s depth attention (one pass over its sources): its input `h` and what
    /// backward needs.
    pub(super) fn forward(
        &self,
        l: usize,
        src: &Sources,
        partial: Option<(&[f32], &[f32])>,
        params: &[f32],
        layout: &Layout,
    ) -> (Vec<f32>, DepthSaved) {
        let blocks = &src.blocks;
        let p = depth_params(layout, l);
        let blocks_read = self.blocks_read(blocks.len());
        let mut sv: Vec<&[f32]> = blocks_read.iter().map(|&i| blocks.get(i)).collect();
        let mut rv: Vec<&[f32]> = blocks_read.iter().map(|&i| blocks.rstd(i)).collect();
        if let Some((v, r)) = partial {
            sv.push(v);
            rv.push(r);
        }
        let (n_sources, nh) = (sv.len(), self.options.heads);
        let (rows, d, eps) = (blocks.rows, blocks.d, blocks.eps);
        let gain = p.gain.as_ref().map(|g| &params[g.clone()]);
        let mut input_query = None;
        let (w, scalars): (Vec<f32>, Vec<f32>) = match self.query {
            DepthQuery::Static => (static_query(p, gain, params), Vec::new()),
            DepthQuery::Input => {
                let (_, xhat, rstd) = normed_sum(&sv, d, eps);
                let q = linear(&xhat, &params[p.query.clone()], rows, d, d);
                let w = times_gain(&q, gain, d);
                input_query = Some(InputQuery { xhat, rstd, q });
                (w, Vec::new())
            }
            DepthQuery::Scalar | DepthQuery::Dense => {
                (Vec::new(), self.scalar_logits(p, &blocks_read, partial.is_some(), params))
            }
        };
        let query = match self.query {
            DepthQuery::Static => Query::Static(&w),
            DepthQuery::Input => Query::PerToken(&w),
            _ => Query::Scalar(&scalars),
        };
        let n = rows * n_sources * nh;
        let (mut h, mut alpha, mut logits) = (zeros(rows * d), zeros(n), zeros(n));
        depth_ablation::forward(&mut h, &mut alpha, &mut logits, &sv, &rv, query, self.options, d);
        let saved =
            DepthSaved { alpha, logits, n_sources, blocks_read, partial: None, input_query };
        (h, saved)
    }

    /// The logits of content-free mixing (scalar, dense) for the given sources.
    fn scalar_logits(
        &self,
        p: &DepthParams,
        blocks_read: &[usize],
        partial: bool,
        params: &[f32],
    ) -> Vec<f32> {
        let q = &params[p.query.clone()];
        let partial = partial.then(|| q[self.depth_sources - 1]);
        blocks_read.iter().map(|&i| q[i]).chain(partial).collect()
    }
}

/// The effective static query `q ⊙ γ` (`q` without key norm).
fn static_query(p: &DepthParams, gain: Option<&[f32]>, params: &[f32]) -> Vec<f32> {
    let q = &params[p.query.clone()];
    gain.map_or_else(|| q.to_vec(), |g| q.iter().zip(g).map(|(a, b)| a * b).collect())
}

/// Per-token queries `[rows, d]` times the key-norm gain, when there is one.
fn times_gain(q: &[f32], gain: Option<&[f32]>, d: usize) -> Vec<f32> {
    match gain {
        Some(g) => q.chunks(d).flat_map(|r| r.iter().zip(g).map(|(a, b)| a * b)).collect(),
        None => q.to_vec(),
    }
}

/// The sum `x` of a consumer's sources, RMS-normalised without gain: `(x, x̂, 1/rms(x))`.
fn normed_sum(sources: &[&[f32]], d: usize, eps: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut x = kernels::copy(sources[0]);
    for s in &sources[1..] {
        kernels::add_assign(&mut x, s);
    }
    let (xhat, rstd) = rmsnorm::forward(&x, &vec![1.0; d], d, eps);
    (x, xhat, rstd)
}

/// The ablations' backward: the gradient of each completed source `b_n`, accumulated consumer
/// by consumer.
pub(super) struct BlockGrads(Vec<Vec<f32>>);

impl BlockGrads {
    /// Zero gradients for `blocks` completed sources of `len` values.
    pub fn new(blocks: usize, len: usize) -> BlockGrads {
        BlockGrads((0..blocks).map(|_| zeros(len)).collect())
    }

    /// The finished gradient of `b_n`.
    pub fn take(&mut self, n: usize) -> Vec<f32> {
        std::mem::take(&mut self.0[n])
    }

    /// The gradient of the embedding `b_0`.
    pub fn embedding_grad(mut self) -> Vec<f32> {
        self.0.swap_remove(0)
    }

    /// Backpropagates `dh`, the gradient of consumer `l`'s input: into the completed sources it
    /// read, its partial sum (`acc`) and its parameters.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &mut self,
        acc: &mut [f32],
        l: usize,
        dh: &[f32],
        ab: &Ablation,
        src: &Sources,
        params: &[f32],
        grads: &mut [f32],
        layout: &Layout,
    ) {
        let blocks = &src.blocks;
        let saved = &src.saved[l];
        let p = depth_params(layout, l);
        let (rows, d, eps) = (blocks.rows, blocks.d, blocks.eps);
        let mut sv: Vec<&[f32]> = saved.blocks_read.iter().map(|&i| blocks.get(i)).collect();
        let mut rv: Vec<&[f32]> = saved.blocks_read.iter().map(|&i| blocks.rstd(i)).collect();
        if saved.reads_partial() {
            let (v, r) = saved.partial.as_ref().expect("forward kept the partial sum");
            sv.push(v);
            rv.push(r);
        }
        // Each source's gradient: its block's, or `acc` for the partial sum.
        let mut by_block: Vec<Option<&mut Vec<f32>>> = self.0.iter_mut().map(Some).collect();
        let mut dsrc: Vec<&mut [f32]> = saved
            .blocks_read
            .iter()
            .map(|&i| by_block[i].take().expect("distinct sources").as_mut_slice())
            .collect();
        if saved.reads_partial() {
            dsrc.push(acc);
        }
        let (alpha, logits, options) = (&saved.alpha, &saved.logits, ab.options);
        let gain = p.gain.as_ref().map(|g| &params[g.clone()]);
        match ab.query {
            DepthQuery::Static => {
                let w = static_query(p, gain, params);
                let mut dw = zeros(d);
                let q = Query::Static(&w);
                depth_ablation::backward(
                    &mut dsrc, &mut dw, dh, &sv, &rv, alpha, logits, q, options, d,
                );
                query_grad(p, &dw, params, grads);
            }
            DepthQuery::Input => {
                let iq = saved.input_query.as_ref().expect("forward kept the input query");
                let w = times_gain(&iq.q, gain, d);
                let mut dw = zeros(rows * d);
                let q = Query::PerToken(&w);
                depth_ablation::backward(
                    &mut dsrc, &mut dw, dh, &sv, &rv, alpha, logits, q, options, d,
                );
                // w = q ⊙ γ: dq = dw ⊙ γ, dγ = Σ_t dw ⊙ q.
                let dq: Vec<f32> = match (gain, &p.gain) {
                    (Some(g), Some(gr)) => {
                        for (dwr, qr) in dw.chunks(d).zip(iq.q.chunks(d)) {
                            grads[gr.clone()]
                                .iter_mut()
                                .zip(dwr.iter().zip(qr))
                                .for_each(|(a, (x, y))| *a += x * y);
                        }
                        times_gain(&dw, Some(g), d)
                    }
                    _ => dw,
                };
                // q = W · x̂, x̂ = rmsnorm(x), x = Σ sources: every source gets dx.
                linear_backward_weight(&mut grads[p.query.clone()], &dq, &iq.xhat, rows, d, d);
                let mut dxhat = zeros(rows * d);
                linear_backward_input(&mut dxhat, &dq, &params[p.query.clone()], rows, d, d, false);
                let (x, _, _) = normed_sum(&sv, d, eps);
                let (mut unused_dgain, ones) = (zeros(d), vec![1.0; d]);
                let dx = rmsnorm::backward(&mut unused_dgain, &dxhat, &x, &ones, &iq.rstd, d, None);
                for g in dsrc.iter_mut() {
                    kernels::add_assign(g, &dx);
                }
            }
            DepthQuery::Scalar | DepthQuery::Dense => {
                let partial = saved.reads_partial();
                let c = ab.scalar_logits(p, &saved.blocks_read, partial, params);
                let mut dc = zeros(c.len());
                let q = Query::Scalar(&c);
                depth_ablation::backward(
                    &mut dsrc, &mut dc, dh, &sv, &rv, alpha, logits, q, options, d,
                );
                let cols = saved.blocks_read.iter().copied();
                let cols = cols.chain(partial.then_some(ab.depth_sources - 1));
                for (col, g) in cols.zip(&dc) {
                    grads[p.query.start + col] += g;
                }
            }
        }
    }
}
