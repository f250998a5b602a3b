//! The residual connection: the one place where `standard`, `full` and `block` differ.
//!
//! The transformer asks [`ResidualForward::input`] for the input `h_l` of sublayer `l`, hands
//! back its raw output with [`ResidualForward::push_output`], and finally asks for
//! [`ResidualForward::output`], the vector that goes into the final norm. Backward mirrors this
//! with [`ResidualBackward`].
//!
//! Full AttnRes is Block AttnRes with blocks of one sublayer (SPEC §4), so both run through the
//! same code with `block_size` S: sources of sublayer `l` are `[b_0 .. b_{l/S}]`, plus the
//! running `partial` sum when `l` is not the first sublayer of its block; `b_0` is the
//! embedding, `b_n` the sum of the raw outputs of block n.

use super::params::{DepthParams, Layout};
use crate::kernels::{self, depth, rmsnorm, zeros};

/// What one depth attention saved for backward.
struct DepthCall {
    alpha: Vec<f32>,
    logits: Vec<f32>,
    /// The partial-sum source (value and per-token 1/rms), when it was read.
    partial: Option<(Vec<f32>, Vec<f32>)>,
}

enum State {
    /// The residual stream `h_l`.
    Standard { stream: Vec<f32> },
    Depth {
        block_size: usize,
        /// `b_0 = e`, then each completed block sum, with their per-token 1/rms.
        blocks: Vec<Vec<f32>>,
        block_rstd: Vec<Vec<f32>>,
        /// Running sum of the outputs produced so far in the current block.
        partial: Option<Vec<f32>>,
        /// Per-token 1/rms of `partial`, computed when a sublayer reads it.
        partial_rstd: Option<Vec<f32>>,
        /// One per sublayer, then one for the output aggregation.
        calls: Vec<DepthCall>,
    },
}

pub struct ResidualForward {
    state: State,
    d: usize,
    eps: f32,
}

/// The depth-attention statistics of a forward pass, for diagnostics: `alpha[rows, K]` per
/// consumer (sublayers in order, then the output aggregation).
pub struct DepthWeights<'a> {
    pub alpha: Vec<&'a [f32]>,
}

impl ResidualForward {
    /// Starts from the embedding output `e` (`[rows, d]`).
    pub fn new(block_size: Option<usize>, e: Vec<f32>, d: usize, eps: f32) -> Self {
        let state = match block_size {
            None => State::Standard { stream: e },
            Some(s) => {
                let mut r = zeros(e.len() / d);
                rmsnorm::rstd(&mut r, &e, d, eps);
                State::Depth {
                    block_size: s,
                    blocks: vec![e],
                    block_rstd: vec![r],
                    partial: None,
                    partial_rstd: None,
                    calls: Vec::new(),
                }
            }
        };
        ResidualForward { state, d, eps }
    }

    /// The input `h_l` of sublayer `l` (sublayers must be visited in order).
    pub fn input(&mut self, l: usize, params: &[f32], layout: &Layout) -> Vec<f32> {
        let (d, eps) = (self.d, self.eps);
        match &mut self.state {
            State::Standard { stream } => kernels::copy(stream),
            State::Depth { block_size, blocks, block_rstd, partial, partial_rstd, calls } => {
                debug_assert_eq!(calls.len(), l);
                debug_assert_eq!(blocks.len(), l / *block_size + 1);
                let p = layout.depth_params(l).expect("AttnRes layout has depth parameters");
                if let Some(part) = partial.as_ref() {
                    let mut r = zeros(part.len() / d);
                    rmsnorm::rstd(&mut r, part, d, eps);
                    *partial_rstd = Some(r);
                }
                let (h, call) = mix(blocks, block_rstd, partial.as_deref().zip(partial_rstd.as_deref()), p, params, d);
                calls.push(call);
                h
            }
        }
    }

    /// Records the raw output of sublayer `l`.
    pub fn push_output(&mut self, l: usize, out: Vec<f32>) {
        let d = self.d;
        let eps = self.eps;
        match &mut self.state {
            State::Standard { stream } => kernels::add_assign(stream, &out),
            State::Depth { block_size, blocks, block_rstd, partial, partial_rstd, calls } => {
                let next = match partial.take() {
                    None => out,
                    Some(p) => {
                        let sum = kernels::sum(&p, &out);
                        calls[l].partial = Some((p, partial_rstd.take().expect("partial was read")));
                        sum
                    }
                };
                if (l + 1) % *block_size == 0 {
                    let mut r = zeros(next.len() / d);
                    rmsnorm::rstd(&mut r, &next, d, eps);
                    blocks.push(next);
                    block_rstd.push(r);
                } else {
                    *partial = Some(next);
                }
            }
        }
    }

    /// The vector fed to the final norm: the stream, or the output aggregation over
    /// `[b_0 .. b_N]`.
    pub fn output(&mut self, params: &[f32], layout: &Layout) -> Vec<f32> {
        let d = self.d;
        match &mut self.state {
            State::Standard { stream } => kernels::copy(stream),
            State::Depth { blocks, block_rstd, calls, .. } => {
                let p = layout.output_depth.as_ref().expect("AttnRes layout has output depth parameters");
                let (h, call) = mix(blocks, block_rstd, None, p, params, d);
                calls.push(call);
                h
            }
        }
    }

    /// Depth-attention weights of every consumer, or `None` for the standard residual.
    pub fn depth_weights(&self) -> Option<DepthWeights<'_>> {
        match &self.state {
            State::Standard { .. } => None,
            State::Depth { calls, .. } => Some(DepthWeights { alpha: calls.iter().map(|c| c.alpha.as_slice()).collect() }),
        }
    }
}

/// One depth attention over the completed blocks and, optionally, the partial sum.
fn mix(
    blocks: &[Vec<f32>],
    block_rstd: &[Vec<f32>],
    partial: Option<(&[f32], &[f32])>,
    p: &DepthParams,
    params: &[f32],
    d: usize,
) -> (Vec<f32>, DepthCall) {
    let mut srcs: Vec<&[f32]> = blocks.iter().map(|b| b.as_slice()).collect();
    let mut rs: Vec<&[f32]> = block_rstd.iter().map(|b| b.as_slice()).collect();
    if let Some((v, r)) = partial {
        srcs.push(v);
        rs.push(r);
    }
    let rows = blocks[0].len() / d;
    let k = srcs.len();
    let mut h = zeros(rows * d);
    let (mut alpha, mut logits) = (zeros(rows * k), zeros(rows * k));
    depth::forward(&mut h, &mut alpha, &mut logits, &srcs, &rs, &params[p.query.clone()], &params[p.gain.clone()], d);
    (h, DepthCall { alpha, logits, partial: None })
}

/// Gradients flowing back through the residual connection.
pub struct ResidualBackward {
    /// Standard: gradient of the stream. Depth: gradient of the output of the sublayer being
    /// processed (its block's gradient plus those of the partial sums it fed).
    acc: Vec<f32>,
    /// Depth only: gradient of each `b_n`.
    g_blocks: Vec<Vec<f32>>,
}

impl ResidualBackward {
    /// Starts from the gradient of the final norm's input; backpropagates the output
    /// aggregation into `grads`.
    pub fn new(fwd: &ResidualForward, dh: Vec<f32>, params: &[f32], grads: &mut [f32], layout: &Layout) -> Self {
        match &fwd.state {
            State::Standard { .. } => ResidualBackward { acc: dh, g_blocks: Vec::new() },
            State::Depth { blocks, block_rstd, calls, .. } => {
                let mut g_blocks: Vec<Vec<f32>> = (0..blocks.len()).map(|_| zeros(dh.len())).collect();
                let call = calls.last().expect("output aggregation ran");
                let p = layout.output_depth.as_ref().expect("AttnRes layout");
                unmix(&mut g_blocks, None, &dh, blocks, block_rstd, call, p, params, grads, fwd.d);
                ResidualBackward { acc: Vec::new(), g_blocks }
            }
        }
    }

    /// Gradient of the raw output of sublayer `l` (sublayers visited from last to first).
    pub fn output_grad(&mut self, l: usize, fwd: &ResidualForward) -> &[f32] {
        if let State::Depth { block_size, .. } = &fwd.state {
            if (l + 1) % block_size == 0 {
                // Last sublayer of its block: start from the gradient of that block's sum.
                self.acc = std::mem::take(&mut self.g_blocks[l / block_size + 1]);
            }
        }
        &self.acc
    }

    /// Backpropagates `dh`, the gradient of the input `h_l` of sublayer `l`.
    pub fn input_grad(&mut self, l: usize, dh: &[f32], fwd: &ResidualForward, params: &[f32], grads: &mut [f32], layout: &Layout) {
        match &fwd.state {
            State::Standard { .. } => kernels::add_assign(&mut self.acc, dh),
            State::Depth { block_size, blocks, block_rstd, calls, .. } => {
                let n = l / block_size + 1;
                let call = &calls[l];
                let p = layout.depth_params(l).expect("AttnRes layout");
                let partial_grad = call.partial.as_ref().map(|_| &mut self.acc);
                unmix(&mut self.g_blocks[..n], partial_grad, dh, &blocks[..n], &block_rstd[..n], call, p, params, grads, fwd.d);
            }
        }
    }

    /// Gradient of the embedding output.
    pub fn embedding_grad(self) -> Vec<f32> {
        if self.g_blocks.is_empty() {
            self.acc
        } else {
            self.g_blocks.into_iter().next().expect("b_0 exists")
        }
    }
}

/// Backward of [`mix`]: accumulates into the block gradients, the partial's gradient, and the
/// depth parameters' gradients.
#[allow(clippy::too_many_arguments)]
fn unmix(
    g_blocks: &mut [Vec<f32>],
    g_partial: Option<&mut Vec<f32>>,
    dh: &[f32],
    blocks: &[Vec<f32>],
    block_rstd: &[Vec<f32>],
    call: &DepthCall,
    p: &DepthParams,
    params: &[f32],
    grads: &mut [f32],
    d: usize,
) {
    let mut srcs: Vec<&[f32]> = blocks.iter().map(|b| b.as_slice()).collect();
    let mut rs: Vec<&[f32]> = block_rstd.iter().map(|b| b.as_slice()).collect();
    let mut dsrc: Vec<&mut [f32]> = g_blocks.iter_mut().map(|g| g.as_mut_slice()).collect();
    if let (Some((v, r)), Some(g)) = (&call.partial, g_partial) {
        srcs.push(v);
        rs.push(r);
        dsrc.push(g.as_mut_slice());
    }
    // The pseudo-query precedes its gain in the layout, so one split separates their gradients.
    debug_assert!(p.query.end <= p.gain.start);
    let (lo, hi) = grads.split_at_mut(p.gain.start);
    let dq = &mut lo[p.query.clone()];
    let dg = &mut hi[..p.gain.len()];
    depth::backward(&mut dsrc, dq, dg, dh, &srcs, &rs, &call.alpha, &call.logits, &params[p.query.clone()], &params[p.gain.clone()], d);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::{Config, ResidualKind};

    /// With zero pseudo-queries each depth attention is the plain average of its sources, so
    /// hand-picked outputs show exactly which sources each sublayer reads (SPEC §4): the
    /// embedding once, block sums at boundaries every S sublayers, the partial sum inside one.
    #[test]
    fn block_sources_by_hand() {
        let c = Config {
            hidden_size: 2, head_dim: 2, num_attention_heads: 1, num_key_value_heads: 1,
            num_hidden_layers: 2, residual: ResidualKind::Block, num_blocks: 2, ..Config::default()
        };
        let lay = Layout::new(&c);
        let params = lay.init(&c, 0);
        let mut r = ResidualForward::new(c.block_size(), vec![1.0, 1.0], 2, 1e-6);
        let mut seen = Vec::new();
        for l in 0..4 {
            seen.push(r.input(l, &params, &lay)[0]);
            let o = 10f32.powi(l as i32 + 1);
            r.push_output(l, vec![o, o]);
        }
        seen.push(r.output(&params, &lay)[0]);
        // l0: [e]; l1: [e, 10]; l2: [e, b1=110]; l3: [e, b1, 1000]; out: [e, b1, b2=11000].
        let want = [1.0, 5.5, 55.5, 1111.0 / 3.0, 11111.0 / 3.0];
        for (s, w) in seen.iter().zip(want) {
            assert!((s - w).abs() < 1e-3 * w, "{seen:?} vs {want:?}");
        }
    }

    #[test]
    fn full_reads_every_earlier_output() {
        let c = Config {
            hidden_size: 2, head_dim: 2, num_attention_heads: 1, num_key_value_heads: 1,
            num_hidden_layers: 1, residual: ResidualKind::Full, ..Config::default()
        };
        let lay = Layout::new(&c);
        let params = lay.init(&c, 0);
        let mut r = ResidualForward::new(c.block_size(), vec![1.0, 1.0], 2, 1e-6);
        assert_eq!(r.input(0, &params, &lay)[0], 1.0);
        r.push_output(0, vec![10.0, 10.0]);
        assert!((r.input(1, &params, &lay)[0] - 5.5).abs() < 1e-5);
        r.push_output(1, vec![100.0, 100.0]);
        assert!((r.output(&params, &lay)[0] - 37.0).abs() < 1e-4);
    }
}
