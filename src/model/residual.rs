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
//!
//! Forward uses the two-phase computation of SPEC §7: when a block starts, all of its sublayers
//! score the completed blocks at once (phase 1); each sublayer then merges its partial sum by
//! online softmax (phase 2), so each completed block is read once per block, not once per
//! sublayer. Backward: each sublayer's gradient into its partial sum is taken at once (the
//! block's earlier outputs need it), while its gradients into the completed blocks wait: when
//! the backward pass reaches block n, the gradient of `b_n` is taken in one pass from every
//! consumer that read it (all later sublayers and the output), so each completed block is read
//! once and its gradient written once.
//!
//! The ablations of SPEC §5 (`attn_res_*` config keys) need per-token queries, other gates,
//! heads or a window, which the two-phase form does not cover: they run each consumer in the
//! plain one-pass form of [`depth_variants`] over the same blocks and partial sums.

use super::config::{Config, DepthGate, DepthQuery};
use super::params::{DepthParams, Layout};
use crate::kernels::depth::{self, ConsumerGrad, Phase1};
use crate::kernels::depth_variants::{self, Gate, Options, Query};
use crate::kernels::matmul::{linear_backward_input, linear_backward_weight, linear_forward};
use crate::kernels::{self, rmsnorm, zeros};
use std::sync::Arc;

/// What one depth attention saved for backward.
struct DepthCall {
    alpha: Vec<f32>,
    logits: Vec<f32>,
    /// Number of sources read (completed blocks, then the partial sum if any).
    k: usize,
    /// The partial-sum source (value and per-token 1/rms), when it was read.
    partial: Option<(Vec<f32>, Vec<f32>)>,
    /// The completed sources read, in order (all of them unless a window is set).
    srcs: Vec<usize>,
    /// Input-dependent query only: what its backward needs.
    input_query: Option<InputQuery>,
}

/// The input-dependent query of one consumer: `x̂ = rmsnorm(x)` (no gain) of the sum `x` of its
/// sources, the per-token 1/rms of `x`, and `q = W · x̂` before the key-norm gain.
struct InputQuery {
    xhat: Vec<f32>,
    rstd: Vec<f32>,
    q: Vec<f32>,
}

/// The ablation options of SPEC §5, when any is set: the depth attention then runs in the
/// plain one-pass form of [`depth_variants`].
#[derive(Clone, Copy)]
struct Ablation {
    options: Options,
    query: DepthQuery,
    window: usize,
    /// Number of distinct sources (scalar and dense mixing keep one weight per source).
    columns: usize,
}

impl Ablation {
    fn of(c: &Config) -> Option<Ablation> {
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
            columns: c.depth_sources(),
        })
    }

    /// The completed sources a consumer reads when `completed` exist: the embedding and the
    /// latest `window` others (all without a window).
    fn sources(&self, completed: usize) -> Vec<usize> {
        let first = if self.window > 0 { completed.saturating_sub(self.window).max(1) } else { 1 };
        std::iter::once(0).chain(first..completed).collect()
    }
}

// One per forward pass: the size of the larger variant does not matter.
#[allow(clippy::large_enum_variant)]
enum State {
    /// The residual stream `h_l`.
    Standard { stream: Vec<f32> },
    Depth {
        block_size: usize,
        /// `b_0 = e`, then each completed block sum, with their per-token 1/rms.
        blocks: Sources,
        /// Running sum of the outputs produced so far in the current block, and its per-token
        /// 1/rms (computed in the same pass as the sum; meaningful while `partial` is set).
        partial: Option<Vec<f32>>,
        partial_rstd: Vec<f32>,
        /// Phase-1 results of the current block's sublayers (then of the output aggregation).
        phase1: Phase1,
        /// Effective query `q ⊙ γ` of every consumer (`[L + 1, d]`), made on first use unless
        /// given (decoding keeps them for its whole run).
        queries: Arc<[f32]>,
        /// Consumers run so far.
        consumed: usize,
        /// One per consumer run (sublayers, then the output aggregation), when kept for backward.
        calls: Vec<DepthCall>,
        /// Set when an ablation option replaces the method's depth attention.
        ablation: Option<Ablation>,
        /// Number of distinct sources (`Config::depth_sources`).
        columns: usize,
    },
}

pub struct ResidualForward {
    state: State,
    d: usize,
    eps: f32,
    /// Keep the partial sums each sublayer read (backward needs them; inference does not).
    for_backward: bool,
    /// Mean per-token RMS of each sublayer's raw output, when recording (diagnostics).
    output_rms: Option<Vec<f64>>,
}

/// The depth-attention statistics of a forward pass, for diagnostics: per consumer (sublayers
/// in order, then the output aggregation) the weights `alpha[rows, K, heads]` and the column of
/// each of its `K` sources among the model's distinct sources (see `Config::depth_sources`:
/// the embedding, the completed blocks, then the partial sum).
pub struct DepthWeights<'a> {
    pub alpha: Vec<&'a [f32]>,
    pub columns: Vec<Vec<usize>>,
    pub heads: usize,
}

/// The completed sources `b_0 .. b_n`, one after another in one buffer (`[n + 1, rows, d]`),
/// with their per-token 1/rms (`[n + 1, rows]`). One buffer sized up front: decoding builds
/// this for a token or two at a time, where a buffer per block (and the cold allocator state
/// behind each) would cost more than the arithmetic.
struct Sources {
    values: Vec<f32>,
    rstd: Vec<f32>,
    rows: usize,
    d: usize,
    eps: f32,
}

impl Sources {
    /// Room for `capacity` sources of `rows` tokens.
    fn new(capacity: usize, rows: usize, d: usize, eps: f32) -> Sources {
        Sources {
            values: Vec::with_capacity(capacity * rows * d),
            rstd: Vec::with_capacity(capacity * rows),
            rows,
            d,
            eps,
        }
    }

    fn len(&self) -> usize {
        self.rstd.len() / self.rows.max(1)
    }

    /// Appends `a + b` (or `a`) and its per-token 1/rms.
    fn push(&mut self, a: &[f32], b: Option<&[f32]>) {
        let (n, r) = (self.values.len(), self.rstd.len());
        self.values.extend_from_slice(a);
        self.rstd.resize(r + self.rows, 0.0);
        rmsnorm::add_assign_rstd(&mut self.values[n..], b, &mut self.rstd[r..], self.d, self.eps);
    }

    /// Source `i`, `[rows, d]`.
    fn get(&self, i: usize) -> &[f32] {
        let n = self.rows * self.d;
        &self.values[i * n..(i + 1) * n]
    }

    /// Per-token 1/rms of source `i`.
    fn rstd(&self, i: usize) -> &[f32] {
        &self.rstd[i * self.rows..(i + 1) * self.rows]
    }
}

impl ResidualForward {
    /// Starts from the embedding output `e` (`[rows, d]`). `for_backward`: keep what
    /// [`ResidualBackward`] needs.
    pub fn new(c: &Config, e: Vec<f32>, for_backward: bool) -> Self {
        let (d, eps) = (c.hidden_size, c.rms_norm_eps as f32);
        let ablation = Ablation::of(c);
        let state = match c.block_size() {
            None => State::Standard { stream: e },
            Some(s) => {
                // Completed sources by the output aggregation: the embedding and every block.
                let (sources, rows) = (c.sublayers() / s + 1, e.len() / d);
                let mut blocks = Sources::new(sources, rows, d, eps);
                blocks.push(&e, None);
                State::Depth {
                    block_size: s,
                    phase1: match ablation {
                        None => Phase1::with_capacity(s, rows, sources),
                        Some(_) => Phase1::default(),
                    },
                    blocks,
                    partial: None,
                    partial_rstd: vec![0.0; rows],
                    queries: Arc::from([]),
                    consumed: 0,
                    calls: Vec::new(),
                    ablation,
                    columns: c.depth_sources(),
                }
            }
        };
        ResidualForward { state, d, eps, for_backward, output_rms: None }
    }

    /// The effective queries of the method's depth attention for [`Self::with_queries`], or
    /// `None` when the model has none (standard) or runs an ablation.
    pub fn queries_of(c: &Config, params: &[f32], layout: &Layout) -> Option<Arc<[f32]>> {
        (c.block_size().is_some() && Ablation::of(c).is_none())
            .then(|| Arc::from(effective_queries(params, layout)))
    }

    /// Uses `queries` (from [`Self::queries_of`] on the current parameters) instead of computing
    /// them on first use: decoding makes them once for a whole generation.
    pub fn with_queries(mut self, queries: Arc<[f32]>) -> Self {
        if let State::Depth { queries: q, ablation: None, .. } = &mut self.state {
            *q = queries;
        }
        self
    }

    /// The input `h_l` of sublayer `l` (sublayers must be visited in order).
    pub fn input(&mut self, l: usize, params: &[f32], layout: &Layout) -> Vec<f32> {
        let (d, eps, keep) = (self.d, self.eps, self.for_backward);
        match &mut self.state {
            State::Standard { stream } => kernels::copy(stream),
            State::Depth {
                ablation: Some(ab),
                blocks,
                partial,
                partial_rstd,
                consumed,
                calls,
                ..
            } => {
                debug_assert_eq!(*consumed, l);
                *consumed += 1;
                let part = partial.as_deref().map(|p| (p, partial_rstd.as_slice()));
                let (h, call) = ablation_forward(ab, l, blocks, part, params, layout, d, eps);
                if keep {
                    calls.push(call);
                }
                h
            }
            State::Depth {
                block_size,
                blocks,
                partial,
                partial_rstd,
                phase1,
                queries,
                consumed,
                calls,
                ablation: None,
                ..
            } => {
                debug_assert_eq!(*consumed, l);
                *consumed += 1;
                if queries.is_empty() {
                    *queries = Arc::from(effective_queries(params, layout));
                }
                let s = *block_size;
                if l.is_multiple_of(s) {
                    // Phase 1 for every sublayer of the block that starts here.
                    depth::phase1(
                        phase1,
                        &blocks.values,
                        &blocks.rstd,
                        &queries[l * d..(l + s) * d],
                        blocks.rows,
                        d,
                    );
                }
                let w = &queries[l * d..(l + 1) * d];
                let k = blocks.len() + partial.is_some() as usize;
                let part = partial.as_deref().map(|p| (p, partial_rstd.as_slice()));
                consumer_phase2(phase1, l % s, part, w, k, blocks.len(), keep.then_some(calls), d)
            }
        }
    }

    /// From now on, record the RMS of every sublayer output (see [`Self::output_rms`]).
    pub fn record_output_rms(&mut self) {
        self.output_rms = Some(Vec::new());
    }

    /// Mean over tokens of each recorded sublayer output's RMS, in sublayer order.
    pub fn output_rms(&self) -> Option<&[f64]> {
        self.output_rms.as_deref()
    }

    /// Records the raw output of sublayer `l`.
    pub fn push_output(&mut self, l: usize, out: Vec<f32>) {
        let (d, eps, keep) = (self.d, self.eps, self.for_backward);
        if let Some(rms) = &mut self.output_rms {
            rms.push(mean_rms(&out, d));
        }
        match &mut self.state {
            State::Standard { stream } => kernels::add_assign(stream, &out),
            State::Depth { block_size, blocks, partial, partial_rstd, calls, .. } => {
                let last = (l + 1).is_multiple_of(*block_size);
                let p = partial.take();
                // Backward needs the partial sum this sublayer read (its 1/rms is overwritten below).
                let read_rstd = (keep && p.is_some()).then(|| partial_rstd.clone());
                if last {
                    blocks.push(&out, p.as_deref());
                } else {
                    // The new partial sum is `out` plus the old one, made in place.
                    let mut next = out;
                    rmsnorm::add_assign_rstd(&mut next, p.as_deref(), partial_rstd, d, eps);
                    *partial = Some(next);
                }
                if let (Some(p), Some(r)) = (p, read_rstd) {
                    calls[l].partial = Some((p, r));
                }
            }
        }
    }

    /// The vector fed to the final norm: the stream, or the output aggregation over
    /// `[b_0 .. b_N]`.
    pub fn output(&mut self, params: &[f32], layout: &Layout) -> Vec<f32> {
        let (d, keep) = (self.d, self.for_backward);
        match &mut self.state {
            State::Standard { stream } => kernels::copy(stream),
            State::Depth { ablation: Some(ab), blocks, consumed, calls, .. } => {
                let (h, call) =
                    ablation_forward(ab, *consumed, blocks, None, params, layout, d, self.eps);
                *consumed += 1;
                if keep {
                    calls.push(call);
                }
                h
            }
            State::Depth { blocks, phase1, queries, consumed, calls, .. } => {
                *consumed += 1;
                if queries.is_empty() {
                    *queries = Arc::from(effective_queries(params, layout));
                }
                let w = &queries[queries.len() - d..];
                depth::phase1(phase1, &blocks.values, &blocks.rstd, w, blocks.rows, d);
                consumer_phase2(
                    phase1,
                    0,
                    None,
                    w,
                    blocks.len(),
                    blocks.len(),
                    keep.then_some(calls),
                    d,
                )
            }
        }
    }

    /// Depth-attention weights of every consumer, or `None` for the standard residual.
    pub fn depth_weights(&self) -> Option<DepthWeights<'_>> {
        match &self.state {
            State::Standard { .. } => None,
            State::Depth { calls, ablation, columns, .. } => {
                // Completed sources keep their index; the partial sum is the last column.
                let columns = calls
                    .iter()
                    .map(|c| {
                        c.srcs
                            .iter()
                            .copied()
                            .chain((c.k > c.srcs.len()).then_some(columns - 1))
                            .collect()
                    })
                    .collect();
                let heads = ablation.map_or(1, |a| a.options.heads);
                Some(DepthWeights {
                    alpha: calls.iter().map(|c| c.alpha.as_slice()).collect(),
                    columns,
                    heads,
                })
            }
        }
    }
}

/// Mean over the rows of `v` (`[rows, d]`) of each row's root mean square.
pub fn mean_rms(v: &[f32], d: usize) -> f64 {
    let rows = v.len() / d;
    let total: f64 = v
        .chunks(d)
        .map(|r| (r.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / d as f64).sqrt())
        .sum();
    total / rows.max(1) as f64
}

fn depth_param(layout: &Layout, l: usize) -> &DepthParams {
    layout.depth_params(l).expect("AttnRes layout has depth parameters")
}

/// Phase 2 of consumer `j` of the block `phase1` scored, reading `k` sources (`completed`
/// blocks, then the partial sum if given): returns its input `h`. The weights and logits go to
/// a new [`DepthCall`] in `calls` when backward needs them; inference skips them.
fn consumer_phase2(
    phase1: &mut Phase1,
    j: usize,
    partial: Option<(&[f32], &[f32])>,
    w: &[f32],
    k: usize,
    completed: usize,
    calls: Option<&mut Vec<DepthCall>>,
    d: usize,
) -> Vec<f32> {
    let Some(calls) = calls else {
        return depth::phase2(None, phase1, j, partial, w, d);
    };
    let n = phase1.rows() * k;
    let (mut alpha, mut logits) = (zeros(n), zeros(n));
    let h = depth::phase2(Some((&mut alpha, &mut logits)), phase1, j, partial, w, d);
    calls.push(DepthCall {
        alpha,
        logits,
        k,
        partial: None,
        srcs: (0..completed).collect(),
        input_query: None,
    });
    h
}

/// The effective queries `q ⊙ γ` of every consumer in order (sublayers, then the output),
/// `[L + 1, d]` (SPEC §3: the query and the key-norm gain fold into one vector).
fn effective_queries(params: &[f32], layout: &Layout) -> Vec<f32> {
    let sublayers = 2 * layout.layers.len();
    let consumers =
        (0..sublayers).map(|l| depth_param(layout, l)).chain(layout.output_depth.as_ref());
    let d = layout.output_depth.as_ref().map_or(0, |p| p.query.len());
    let mut out = Vec::with_capacity((sublayers + 1) * d);
    for p in consumers {
        let gain = p.gain.clone().expect("the method's depth attention has key-norm gains");
        out.extend(params[p.query.clone()].iter().zip(&params[gain]).map(|(q, g)| q * g));
    }
    out
}

/// Gradient of the effective query `w = q ⊙ γ` (or `w = q` without key norm) into the
/// pseudo-query and the gain.
fn query_grad(p: &DepthParams, dw: &[f32], params: &[f32], grads: &mut [f32]) {
    match &p.gain {
        Some(gain) => {
            for (j, dwj) in dw.iter().enumerate() {
                grads[p.query.start + j] += dwj * params[gain.start + j];
                grads[gain.start + j] += dwj * params[p.query.start + j];
            }
        }
        None => grads[p.query.clone()].iter_mut().zip(dw).for_each(|(g, d)| *g += d),
    }
}

/// The sum `x` of a consumer's sources, RMS-normalised without gain: `(x, x̂, 1/rms(x))`.
fn normed_sum(sources: &[&[f32]], d: usize, eps: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut x = kernels::copy(sources[0]);
    for s in &sources[1..] {
        kernels::add_assign(&mut x, s);
    }
    let rows = x.len() / d;
    let (mut xhat, mut rstd) = (zeros(rows * d), zeros(rows));
    rmsnorm::forward(&mut xhat, &mut rstd, &x, &vec![1.0; d], d, eps);
    (x, xhat, rstd)
}

/// The logits of content-free mixing (scalar, dense) for the given sources.
fn scalar_logits(
    ab: &Ablation,
    p: &DepthParams,
    srcs: &[usize],
    partial: bool,
    params: &[f32],
) -> Vec<f32> {
    let q = &params[p.query.clone()];
    srcs.iter().map(|&i| q[i]).chain(partial.then(|| q[ab.columns - 1])).collect()
}

/// Consumer `l`'s depth attention under an ablation (one pass over its sources).
#[allow(clippy::too_many_arguments)]
fn ablation_forward(
    ab: &Ablation,
    l: usize,
    blocks: &Sources,
    partial: Option<(&[f32], &[f32])>,
    params: &[f32],
    layout: &Layout,
    d: usize,
    eps: f32,
) -> (Vec<f32>, DepthCall) {
    let p = depth_param(layout, l);
    let srcs = ab.sources(blocks.len());
    let mut sv: Vec<&[f32]> = srcs.iter().map(|&i| blocks.get(i)).collect();
    let mut rv: Vec<&[f32]> = srcs.iter().map(|&i| blocks.rstd(i)).collect();
    if let Some((v, r)) = partial {
        sv.push(v);
        rv.push(r);
    }
    let (k, nh) = (sv.len(), ab.options.heads);
    let rows = blocks.rows;
    let gain = p.gain.as_ref().map(|g| &params[g.clone()]);
    let mut input_query = None;
    let (w, scalars): (Vec<f32>, Vec<f32>) = match ab.query {
        DepthQuery::Static => {
            let q = &params[p.query.clone()];
            (
                gain.map_or_else(|| q.to_vec(), |g| q.iter().zip(g).map(|(a, b)| a * b).collect()),
                Vec::new(),
            )
        }
        DepthQuery::Input => {
            let (_, xhat, rstd) = normed_sum(&sv, d, eps);
            let mut q = zeros(rows * d);
            linear_forward(&mut q, &xhat, &params[p.query.clone()], rows, d, d);
            let w = match gain {
                Some(g) => q.chunks(d).flat_map(|r| r.iter().zip(g).map(|(a, b)| a * b)).collect(),
                None => q.clone(),
            };
            input_query = Some(InputQuery { xhat, rstd, q });
            (w, Vec::new())
        }
        DepthQuery::Scalar | DepthQuery::Dense => {
            (Vec::new(), scalar_logits(ab, p, &srcs, partial.is_some(), params))
        }
    };
    let query = match ab.query {
        DepthQuery::Static => Query::Static(&w),
        DepthQuery::Input => Query::PerToken(&w),
        _ => Query::Scalar(&scalars),
    };
    let (mut h, mut alpha, mut logits) =
        (zeros(rows * d), zeros(rows * k * nh), zeros(rows * k * nh));
    depth_variants::forward(&mut h, &mut alpha, &mut logits, &sv, &rv, query, ab.options, d);
    (h, DepthCall { alpha, logits, k, partial: None, srcs, input_query })
}

/// A consumer whose gradient into the completed blocks is still owed.
struct Owed {
    l: usize,
    dh: Vec<f32>,
    mean: Vec<f32>,
    w: Vec<f32>,
    /// Gradient of `w`: from the partial sum at once, from each completed block when the
    /// backward pass reaches it.
    dw: Vec<f32>,
}

/// Gradients flowing back through the residual connection.
pub struct ResidualBackward {
    /// Standard: gradient of the stream. Depth: gradient of the output of the sublayer being
    /// processed (its block's gradient plus those of the partial sums it fed).
    acc: Vec<f32>,
    /// Ablations only: gradient of each `b_n`, accumulated consumer by consumer.
    g_blocks: Vec<Vec<f32>>,
    /// The method only: every consumer backpropagated so far. Their gradients into a completed
    /// block are taken all at once when the backward pass reaches that block.
    owed: Vec<Owed>,
}

impl ResidualBackward {
    /// Starts from `dh`, the gradient of the final norm's input `h` (what
    /// [`ResidualForward::output`] returned); backpropagates the output aggregation into `grads`.
    /// `dh_dot_h` holds, per token, `⟨dh, h⟩` (the depth attention's backward needs it; the
    /// final norm's backward makes it in passing); only the method's depth attention reads it.
    pub fn new(
        fwd: &ResidualForward,
        dh: Vec<f32>,
        dh_dot_h: Vec<f32>,
        params: &[f32],
        grads: &mut [f32],
        layout: &Layout,
    ) -> Self {
        match &fwd.state {
            State::Standard { .. } => {
                ResidualBackward { acc: dh, g_blocks: Vec::new(), owed: Vec::new() }
            }
            State::Depth { blocks, calls, ablation: Some(_), .. } => {
                let g_blocks = (0..blocks.len()).map(|_| zeros(dh.len())).collect();
                let mut rb = ResidualBackward { acc: Vec::new(), g_blocks, owed: Vec::new() };
                rb.ablation_backward(calls.len() - 1, &dh, fwd, params, grads, layout);
                rb
            }
            State::Depth { calls, .. } => {
                let mut rb =
                    ResidualBackward { acc: Vec::new(), g_blocks: Vec::new(), owed: Vec::new() };
                rb.owe(calls.len() - 1, dh, dh_dot_h, fwd);
                rb
            }
        }
    }

    /// Gradient of the raw output of sublayer `l` (sublayers visited from last to first).
    pub fn output_grad(&mut self, l: usize, fwd: &ResidualForward) -> &[f32] {
        if let State::Depth { block_size, ablation, .. } = &fwd.state {
            if (l + 1).is_multiple_of(*block_size) {
                // Last sublayer of its block: start from the gradient of that block's sum.
                let n = l / block_size + 1;
                self.acc = match ablation {
                    Some(_) => std::mem::take(&mut self.g_blocks[n]),
                    None => self.block_grad(n, fwd),
                };
            }
        }
        &self.acc
    }

    /// Backpropagates `dh`, the gradient of the input `h` of sublayer `l`; `dh_dot_h` as in
    /// [`Self::new`].
    #[allow(clippy::too_many_arguments)]
    pub fn input_grad(
        &mut self,
        l: usize,
        dh: Vec<f32>,
        dh_dot_h: Vec<f32>,
        fwd: &ResidualForward,
        params: &[f32],
        grads: &mut [f32],
        layout: &Layout,
    ) {
        match &fwd.state {
            State::Standard { .. } => kernels::add_assign(&mut self.acc, &dh),
            State::Depth { ablation: Some(_), .. } => {
                self.ablation_backward(l, &dh, fwd, params, grads, layout)
            }
            State::Depth { .. } => self.owe(l, dh, dh_dot_h, fwd),
        }
    }

    /// Takes consumer `l`'s gradient into its partial sum now (into `acc`, the gradient of the
    /// block's earlier outputs) and records what its completed-block gradients need.
    fn owe(&mut self, l: usize, dh: Vec<f32>, mean: Vec<f32>, fwd: &ResidualForward) {
        let State::Depth { calls, queries, .. } = &fwd.state else { unreachable!("depth state") };
        let d = fwd.d;
        let call = &calls[l];
        let w = queries[l * d..(l + 1) * d].to_vec();
        assert_eq!(mean.len() * d, dh.len(), "one <dh, h> per token");
        let mut dw = vec![0.0f32; d];
        if let Some((pv, pr)) = &call.partial {
            let g = ConsumerGrad {
                dh: &dh,
                mean: &mean,
                alpha: &call.alpha,
                logits: &call.logits,
                k: call.k,
                w: &w,
            };
            depth::backward_one(&mut self.acc, &mut dw, &g, call.k - 1, pv, pr, d);
        }
        self.owed.push(Owed { l, dh, mean, w, dw });
    }

    /// The gradient of block sum `b_n`, once every consumer that read it is backpropagated:
    /// all consumers owed so far (those of later blocks and the output aggregation).
    fn block_grad(&mut self, n: usize, fwd: &ResidualForward) -> Vec<f32> {
        let State::Depth { blocks, calls, .. } = &fwd.state else { unreachable!("depth state") };
        let (consumers, mut dws): (Vec<ConsumerGrad>, Vec<&mut [f32]>) = self
            .owed
            .iter_mut()
            .map(|Owed { l, dh, mean, w, dw }| {
                let call = &calls[*l];
                (
                    ConsumerGrad {
                        dh,
                        mean,
                        alpha: &call.alpha,
                        logits: &call.logits,
                        k: call.k,
                        w,
                    },
                    dw.as_mut_slice(),
                )
            })
            .unzip();
        depth::backward_source(&mut dws, &consumers, n, blocks.get(n), blocks.rstd(n), fwd.d)
    }

    /// Backpropagates consumer `l`'s depth attention under an ablation: into the completed
    /// blocks it read, its partial sum (`acc`) and its parameters.
    fn ablation_backward(
        &mut self,
        l: usize,
        dh: &[f32],
        fwd: &ResidualForward,
        params: &[f32],
        grads: &mut [f32],
        layout: &Layout,
    ) {
        let State::Depth { blocks, calls, ablation: Some(ab), .. } = &fwd.state else {
            unreachable!("ablation state")
        };
        let (d, eps) = (fwd.d, fwd.eps);
        let call = &calls[l];
        let p = depth_param(layout, l);
        let rows = dh.len() / d;
        let mut sv: Vec<&[f32]> = call.srcs.iter().map(|&i| blocks.get(i)).collect();
        let mut rv: Vec<&[f32]> = call.srcs.iter().map(|&i| blocks.rstd(i)).collect();
        if call.k > call.srcs.len() {
            let (v, r) = call.partial.as_ref().expect("forward kept the partial sum");
            sv.push(v);
            rv.push(r);
        }
        // Each source's gradient: its block's, or `acc` for the partial sum.
        let mut by_block: Vec<Option<&mut Vec<f32>>> = self.g_blocks.iter_mut().map(Some).collect();
        let mut dsrc: Vec<&mut [f32]> = call
            .srcs
            .iter()
            .map(|&i| by_block[i].take().expect("distinct sources").as_mut_slice())
            .collect();
        if call.k > call.srcs.len() {
            dsrc.push(self.acc.as_mut_slice());
        }
        let gain = p.gain.as_ref().map(|g| &params[g.clone()]);
        match ab.query {
            DepthQuery::Static => {
                let q = &params[p.query.clone()];
                let w: Vec<f32> = gain
                    .map_or_else(|| q.to_vec(), |g| q.iter().zip(g).map(|(a, b)| a * b).collect());
                let mut dw = zeros(d);
                depth_variants::backward(
                    &mut dsrc,
                    &mut dw,
                    dh,
                    &sv,
                    &rv,
                    &call.alpha,
                    &call.logits,
                    Query::Static(&w),
                    ab.options,
                    d,
                );
                query_grad(p, &dw, params, grads);
            }
            DepthQuery::Input => {
                let iq = call.input_query.as_ref().expect("forward kept the input query");
                let w: Vec<f32> = match gain {
                    Some(g) => {
                        iq.q.chunks(d).flat_map(|r| r.iter().zip(g).map(|(a, b)| a * b)).collect()
                    }
                    None => iq.q.clone(),
                };
                let mut dw = zeros(rows * d);
                depth_variants::backward(
                    &mut dsrc,
                    &mut dw,
                    dh,
                    &sv,
                    &rv,
                    &call.alpha,
                    &call.logits,
                    Query::PerToken(&w),
                    ab.options,
                    d,
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
                        dw.chunks(d).flat_map(|r| r.iter().zip(g).map(|(a, b)| a * b)).collect()
                    }
                    _ => dw,
                };
                // q = W · x̂, x̂ = rmsnorm(x), x = Σ sources: every source gets dx.
                linear_backward_weight(&mut grads[p.query.clone()], &dq, &iq.xhat, rows, d, d);
                let mut dxhat = zeros(rows * d);
                linear_backward_input(&mut dxhat, &dq, &params[p.query.clone()], rows, d, d, false);
                let (x, _, _) = normed_sum(&sv, d, eps);
                let (mut dx, mut unused_dgain) = (zeros(rows * d), zeros(d));
                rmsnorm::backward(
                    &mut dx,
                    &mut unused_dgain,
                    &dxhat,
                    &x,
                    &vec![1.0; d],
                    &iq.rstd,
                    d,
                    None,
                );
                for g in dsrc.iter_mut() {
                    kernels::add_assign(g, &dx);
                }
            }
            DepthQuery::Scalar | DepthQuery::Dense => {
                let partial = call.k > call.srcs.len();
                let c = scalar_logits(ab, p, &call.srcs, partial, params);
                let mut dc = zeros(c.len());
                depth_variants::backward(
                    &mut dsrc,
                    &mut dc,
                    dh,
                    &sv,
                    &rv,
                    &call.alpha,
                    &call.logits,
                    Query::Scalar(&c),
                    ab.options,
                    d,
                );
                let cols = call.srcs.iter().copied().chain(partial.then_some(ab.columns - 1));
                for (col, g) in cols.zip(&dc) {
                    grads[p.query.start + col] += g;
                }
            }
        }
    }

    /// Gradient of the embedding output.
    pub fn embedding_grad(
        mut self,
        fwd: &ResidualForward,
        params: &[f32],
        grads: &mut [f32],
        layout: &Layout,
    ) -> Vec<f32> {
        match &fwd.state {
            State::Standard { .. } => self.acc,
            State::Depth { ablation: Some(_), .. } => self.g_blocks.swap_remove(0),
            State::Depth { .. } => {
                let de = self.block_grad(0, fwd);
                // b_0 was every consumer's last source: their query gradients are complete.
                for o in &self.owed {
                    // With w = q ⊙ γ: dq = dw ⊙ γ and dγ = dw ⊙ q.
                    query_grad(depth_param(layout, o.l), &o.dw, params, grads);
                }
                de
            }
        }
    }
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
            hidden_size: 2,
            head_dim: 2,
            num_attention_heads: 1,
            num_key_value_heads: 1,
            num_hidden_layers: 2,
            residual: ResidualKind::Block,
            num_blocks: 2,
            ..Config::default()
        };
        let lay = Layout::new(&c);
        let params = lay.init(&c, 0);
        let mut r = ResidualForward::new(&c, vec![1.0, 1.0], true);
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
            hidden_size: 2,
            head_dim: 2,
            num_attention_heads: 1,
            num_key_value_heads: 1,
            num_hidden_layers: 1,
            residual: ResidualKind::Full,
            ..Config::default()
        };
        let lay = Layout::new(&c);
        let params = lay.init(&c, 0);
        let mut r = ResidualForward::new(&c, vec![1.0, 1.0], true);
        assert_eq!(r.input(0, &params, &lay)[0], 1.0);
        r.push_output(0, vec![10.0, 10.0]);
        assert!((r.input(1, &params, &lay)[0] - 5.5).abs() < 1e-5);
        r.push_output(1, vec![100.0, 100.0]);
        assert!((r.output(&params, &lay)[0] - 37.0).abs() < 1e-4);
    }
}
