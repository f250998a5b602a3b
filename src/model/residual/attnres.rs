//! Full and Block AttnRes (docs/method.md §3, §4, §7): the sources every depth attention reads,
//! the two-phase forward and the backward taken per source.
//!
//! Full AttnRes is Block AttnRes with blocks of one sublayer (§4), so both run through the same
//! code with `block_size` S: the sources of sublayer `l` are `[b_0 .. b_{l/S}]`, plus the
//! running `partial` sum when `l` is not the first sublayer of its block; `b_0` is the
//! embedding, `b_n` the sum of the raw outputs of block n. The output aggregation is one more
//! consumer, reading `[b_0 .. b_N]`.
//!
//! Forward (§7): when a block starts, all of its sublayers score the completed blocks at once
//! (phase 1); each sublayer then merges its partial sum by online softmax (phase 2), so each
//! completed block is read once per block, not once per sublayer.
//!
//! Backward: each consumer's gradient into its partial sum is taken at once (the block's
//! earlier outputs need it), while its gradients into the completed blocks wait: when the
//! backward pass reaches block n, the gradient of `b_n` is taken in one pass from every
//! consumer that read it (all later sublayers and the output), so each completed block is read
//! once and its gradient written once.

use crate::kernels::depth::{self, ConsumerGrad, Phase1, SourceSums};
use crate::kernels::{rmsnorm, zeros};
use crate::model::config::Config;
use crate::model::params::{DepthParams, Layout};
use std::sync::Arc;

/// The depth parameters of consumer `l` (sublayers, then the output aggregation at `L`).
pub(super) fn depth_params(layout: &Layout, l: usize) -> &DepthParams {
    layout.depth_params(l).expect("AttnRes layout has depth parameters")
}

/// The input-dependent query of one consumer: `x̂ = rmsnorm(x)` (no gain) of the sum `x` of its
/// sources, the per-token 1/rms of `x`, and `q = W · x̂` before the key-norm gain.
pub(super) struct InputQuery {
    pub xhat: Vec<f32>,
    pub rstd: Vec<f32>,
    pub q: Vec<f32>,
}

/// The completed sources `b_0 .. b_n`, one after another in one buffer (`[n + 1, rows, d]`),
/// with their per-token 1/rms (`[n + 1, rows]`). One buffer sized up front: decoding builds
/// this for a token or two at a time, where a buffer per block (and the cold allocator state
/// behind each) would cost more than the arithmetic.
pub(super) struct Blocks {
    values: Vec<f32>,
    rstd: Vec<f32>,
    pub rows: usize,
    pub d: usize,
    pub eps: f32,
}

impl Blocks {
    /// Room for `capacity` sources of `rows` tokens.
    fn new(capacity: usize, rows: usize, d: usize, eps: f32) -> Blocks {
        Blocks {
            values: Vec::with_capacity(capacity * rows * d),
            rstd: Vec::with_capacity(capacity * rows),
            rows,
            d,
            eps,
        }
    }

    /// Completed sources so far.
    pub fn len(&self) -> usize {
        self.rstd.len() / self.rows.max(1)
    }

    /// Appends `a + b` (or `a`) and its per-token 1/rms.
    fn push(&mut self, a: &[f32], b: Option<&[f32]>) {
        let (n, r) = (self.values.len(), self.rstd.len());
        self.values.reserve(a.len());
        self.rstd.resize(r + self.rows, 0.0);
        let dst = &mut self.values.spare_capacity_mut()[..a.len()];
        rmsnorm::sum_rstd(dst, a, b, &mut self.rstd[r..], self.d, self.eps);
        // SAFETY: `sum_rstd` wrote all `a.len()` values past the old length.
        unsafe { self.values.set_len(n + a.len()) };
    }

    /// Source `i`, `[rows, d]`.
    pub fn get(&self, i: usize) -> &[f32] {
        let n = self.rows * self.d;
        &self.values[i * n..(i + 1) * n]
    }

    /// Per-token 1/rms of source `i`.
    pub fn rstd(&self, i: usize) -> &[f32] {
        &self.rstd[i * self.rows..(i + 1) * self.rows]
    }
}

/// What one consumer's depth attention saved for backward (and diagnostics).
pub(super) struct DepthSaved {
    /// Weights and logits per token over the sources read (`[rows, n_sources, heads]`).
    pub alpha: Vec<f32>,
    pub logits: Vec<f32>,
    /// Sources read: the completed ones, then the partial sum if any.
    pub n_sources: usize,
    /// The completed sources read, in order (all of them unless an ablation sets a window).
    pub blocks_read: Vec<usize>,
    /// The partial-sum source (value and per-token 1/rms), when it was read.
    pub partial: Option<(Vec<f32>, Vec<f32>)>,
    /// Input-dependent query (an ablation) only: what its backward needs.
    pub input_query: Option<InputQuery>,
}

impl DepthSaved {
    pub fn reads_partial(&self) -> bool {
        self.n_sources > self.blocks_read.len()
    }
}

/// The sources of the depth attentions as the forward pass makes them (§4), and what each
/// consumer saved. The ablations read the same sources.
pub(super) struct Sources {
    pub block_size: usize,
    /// `b_0 = e`, then each completed block sum, with their per-token 1/rms.
    pub blocks: Blocks,
    /// Running sum of the outputs produced so far in the current block, and its per-token
    /// 1/rms (made in the same pass as the sum; meaningful while `partial` is set).
    partial: Option<Vec<f32>>,
    partial_rstd: Vec<f32>,
    /// Consumers run so far.
    pub consumed: usize,
    /// The first consumer this state runs: 0, or where a pipeline stage's chunk starts.
    pub first: usize,
    /// One per consumer run from `first` on (sublayers, then the output aggregation), when kept
    /// for backward.
    pub saved: Vec<DepthSaved>,
    /// Number of distinct sources (`Config::depth_sources`).
    pub depth_sources: usize,
    /// Sublayers of the model.
    pub sublayers: usize,
}

impl Sources {
    /// Starts from the embedding output `e` (`[rows, d]`) with blocks of `block_size` sublayers.
    pub fn new(c: &Config, block_size: usize, e: &[f32]) -> Sources {
        let (d, eps) = (c.hidden_size, c.rms_norm_eps as f32);
        // Completed sources by the output aggregation: the embedding and every block.
        let (capacity, rows) = (c.sublayers().div_ceil(block_size) + 1, e.len() / d);
        let mut blocks = Blocks::new(capacity, rows, d, eps);
        blocks.push(e, None);
        Sources {
            block_size,
            blocks,
            partial: None,
            partial_rstd: vec![0.0; rows],
            consumed: 0,
            first: 0,
            saved: Vec::new(),
            depth_sources: c.depth_sources(),
            sublayers: c.sublayers(),
        }
    }

    /// The state before sublayer `k` as a pipeline stage receives it: the completed sources
    /// `b_0 ..` in order, and the partial sum when `k` lies inside a block. Their 1/rms are
    /// computed again here, as the stage that made them computed them (the same bits).
    pub fn resume(
        c: &Config,
        block_size: usize,
        k: usize,
        completed: &[&[f32]],
        partial: Option<&[f32]>,
    ) -> Sources {
        let mut src = Sources::new(c, block_size, completed[0]);
        for b in &completed[1..] {
            src.blocks.push(b, None);
        }
        if let Some(p) = partial {
            rmsnorm::rstd(&mut src.partial_rstd, p, src.blocks.d, src.blocks.eps);
            src.partial = Some(p.to_vec());
        }
        (src.consumed, src.first) = (k, k);
        src
    }

    /// What consumer `l` saved.
    pub fn saved(&self, l: usize) -> &DepthSaved {
        &self.saved[l - self.first]
    }

    /// The partial sum's values, when the current block has one.
    pub fn partial_values(&self) -> Option<&[f32]> {
        self.partial.as_deref()
    }

    /// The partial sum and its per-token 1/rms, when the current block has one.
    pub fn partial(&self) -> Option<(&[f32], &[f32])> {
        self.partial.as_deref().map(|p| (p, self.partial_rstd.as_slice()))
    }

    /// Adds the raw output of sublayer `l`: to the partial sum, or, at the end of its block, to
    /// the block sum that becomes the next completed source. `keep`: save the partial sum this
    /// sublayer read (backward needs it).
    pub fn push_output(&mut self, l: usize, out: Vec<f32>, keep: bool) {
        let (d, eps) = (self.blocks.d, self.blocks.eps);
        let last = (l + 1).is_multiple_of(self.block_size) || l + 1 == self.sublayers;
        let p = self.partial.take();
        // Backward needs the partial sum this sublayer read (its 1/rms is overwritten below).
        let read_rstd = (keep && p.is_some()).then(|| self.partial_rstd.clone());
        if last {
            self.blocks.push(&out, p.as_deref());
        } else {
            // The new partial sum is `out` plus the old one, made in place.
            let mut next = out;
            rmsnorm::add_assign_rstd(&mut next, p.as_deref(), &mut self.partial_rstd, d, eps);
            self.partial = Some(next);
        }
        if let (Some(p), Some(r)) = (p, read_rstd) {
            self.saved[l - self.first].partial = Some((p, r));
        }
    }

    /// The column of each source a consumer read among the model's distinct sources: completed
    /// sources keep their index, the partial sum is the last column.
    pub fn columns(&self, s: &DepthSaved) -> Vec<usize> {
        let partial = s.reads_partial().then_some(self.depth_sources - 1);
        s.blocks_read.iter().copied().chain(partial).collect()
    }
}

/// The method's forward state beyond the sources: phase-1 results and the effective queries.
pub(super) struct TwoPhase {
    /// Phase-1 results of the current block's sublayers (then of the output aggregation).
    phase1: Phase1,
    /// Effective query `q ⊙ γ` of every consumer (`[L + 1, d]`), made on first use unless
    /// given (decoding keeps them for its whole run).
    pub queries: Arc<[f32]>,
}

impl TwoPhase {
    /// Buffers for blocks of `block_size` consumers over `rows` tokens.
    pub fn new(c: &Config, block_size: usize, rows: usize) -> TwoPhase {
        let completed = c.sublayers().div_ceil(block_size) + 1;
        TwoPhase {
            phase1: Phase1::with_capacity(block_size, rows, completed),
            queries: Arc::from([]),
        }
    }

    fn ensure_queries(&mut self, params: &[f32], layout: &Layout) {
        if self.queries.is_empty() {
            self.queries = Arc::from(effective_queries(params, layout));
        }
    }

    /// The input `h_l` of sublayer `l`; saves its weights in `src` when `keep`.
    pub fn input(
        &mut self,
        src: &mut Sources,
        l: usize,
        params: &[f32],
        layout: &Layout,
        keep: bool,
    ) -> Vec<f32> {
        let d = src.blocks.d;
        self.ensure_queries(params, layout);
        let s = src.block_size;
        let blocks = &src.blocks;
        if l.is_multiple_of(s) || l == src.first {
            // Phase 1 for every sublayer of the block that starts here (or, on a pipeline stage
            // whose chunk starts inside a block, of that whole block: the same pass as the
            // stage before made, so the same bits).
            // The last block may be shorter.
            let b = l - l % s;
            let ws = &self.queries[b * d..(b + s).min(src.sublayers) * d];
            depth::phase1(&mut self.phase1, &blocks.values, &blocks.rstd, ws, blocks.rows, d);
        }
        let w = &self.queries[l * d..(l + 1) * d];
        let partial = src.partial.as_deref().map(|p| (p, src.partial_rstd.as_slice()));
        let n_sources = blocks.len() + partial.is_some() as usize;
        let saved = keep.then_some(&mut src.saved);
        consumer_phase2(&mut self.phase1, l % s, partial, w, n_sources, blocks.len(), saved, d)
    }

    /// The output aggregation over `[b_0 .. b_N]`.
    pub fn output(
        &mut self,
        src: &mut Sources,
        params: &[f32],
        layout: &Layout,
        keep: bool,
    ) -> Vec<f32> {
        let d = src.blocks.d;
        self.ensure_queries(params, layout);
        let blocks = &src.blocks;
        let w = &self.queries[self.queries.len() - d..];
        depth::phase1(&mut self.phase1, &blocks.values, &blocks.rstd, w, blocks.rows, d);
        let n = blocks.len();
        consumer_phase2(&mut self.phase1, 0, None, w, n, n, keep.then_some(&mut src.saved), d)
    }
}

/// Phase 2 of consumer `j` of the block `phase1` scored, reading `n_sources` sources
/// (`completed` blocks, then the partial sum if given): returns its input `h`. The weights and
/// logits go to a new [`DepthSaved`] in `saved` when backward needs them; inference skips them.
#[allow(clippy::too_many_arguments)]
fn consumer_phase2(
    phase1: &mut Phase1,
    j: usize,
    partial: Option<(&[f32], &[f32])>,
    w: &[f32],
    n_sources: usize,
    completed: usize,
    saved: Option<&mut Vec<DepthSaved>>,
    d: usize,
) -> Vec<f32> {
    let Some(saved) = saved else {
        return depth::phase2(None, phase1, j, partial, w, d);
    };
    let n = phase1.rows() * n_sources;
    let (mut alpha, mut logits) = (zeros(n), zeros(n));
    let h = depth::phase2(Some((&mut alpha, &mut logits)), phase1, j, partial, w, d);
    saved.push(DepthSaved {
        alpha,
        logits,
        n_sources,
        blocks_read: (0..completed).collect(),
        partial: None,
        input_query: None,
    });
    h
}

/// The effective queries `q ⊙ γ` of every consumer in order (sublayers, then the output),
/// `[L + 1, d]` (§3: the query and the key-norm gain fold into one vector).
pub(super) fn effective_queries(params: &[f32], layout: &Layout) -> Vec<f32> {
    let sublayers = 2 * layout.layers.len();
    let consumers =
        || (0..sublayers).map(|l| depth_params(layout, l)).chain(layout.output_depth.as_ref());
    // Every query is `[1, d]` (a pipeline stage's part leaves those it does not hold empty).
    let d = consumers().map(|p| p.query.len()).max().unwrap_or(0);
    let mut out = Vec::with_capacity((sublayers + 1) * d);
    for p in consumers() {
        if p.query.is_empty() {
            // A pipeline stage holds only its own consumers' queries; where its chunk starts
            // inside a block, phase 1 scores the block's earlier consumers too, but their rows
            // (each its own query's alone) are never read here.
            out.resize(out.len() + d, 0.0);
            continue;
        }
        let gain = p.gain.clone().expect("the method's depth attention has key-norm gains");
        out.extend(params[p.query.clone()].iter().zip(&params[gain]).map(|(q, g)| q * g));
    }
    out
}

/// Gradient of the effective query `w = q ⊙ γ` (or `w = q` without key norm) into the
/// pseudo-query and the gain: `dq = dw ⊙ γ`, `dγ = dw ⊙ q`.
pub(super) fn query_grad(p: &DepthParams, dw: &[f32], params: &[f32], grads: &mut [f32]) {
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

/// A consumer whose gradient into the completed blocks is still owed.
struct Pending {
    l: usize,
    dh: Vec<f32>,
    dh_dot_h: Vec<f32>,
    w: Vec<f32>,
    /// Gradient of `w`: from the partial sum at once, from each completed block when the
    /// backward pass reaches it.
    dw: Vec<f32>,
}

/// The method's backward: every consumer backpropagated so far. Their gradients into a
/// completed block are taken all at once when the backward pass reaches that block. On a
/// pipeline stage, `from[n]` holds the sums of block n's gradient over the consumers of later
/// stages, which this stage continues.
#[derive(Default)]
pub(super) struct PendingGrads {
    owed: Vec<Pending>,
    pub from: Vec<Option<SourceSums>>,
}

impl PendingGrads {
    /// Takes consumer `l`'s gradient into its partial sum now (into `acc`, the gradient of the
    /// block's earlier outputs) and records what its completed-block gradients need.
    pub fn owe(
        &mut self,
        acc: &mut [f32],
        l: usize,
        dh: Vec<f32>,
        dh_dot_h: Vec<f32>,
        src: &Sources,
        tp: &TwoPhase,
    ) {
        let d = src.blocks.d;
        let saved = src.saved(l);
        let w = tp.queries[l * d..(l + 1) * d].to_vec();
        assert_eq!(dh_dot_h.len() * d, dh.len(), "one dh_dot_h per token");
        let mut dw = vec![0.0f32; d];
        if let Some((pv, pr)) = &saved.partial {
            let g = consumer_grad(saved, &dh, &dh_dot_h, &w);
            depth::backward_partial(acc, &mut dw, &g, saved.n_sources - 1, pv, pr, d);
        }
        self.owed.push(Pending { l, dh, dh_dot_h, w, dw });
    }

    /// The gradient of block sum `b_n`, once every consumer that read it is backpropagated:
    /// all consumers owed so far (those of later blocks and the output aggregation).
    pub fn block_grad(&mut self, n: usize, src: &Sources) -> Vec<f32> {
        self.source_pass(n, src, true).acc
    }

    /// The sums of block `n`'s gradient over the consumers owed so far (continuing those of
    /// later stages), for the pipeline stage before this one.
    pub fn block_sums(&mut self, n: usize, src: &Sources) -> SourceSums {
        self.source_pass(n, src, false)
    }

    fn source_pass(&mut self, n: usize, src: &Sources, finish: bool) -> SourceSums {
        let from = self.from.get_mut(n).and_then(Option::take);
        let (consumers, mut dws): (Vec<ConsumerGrad>, Vec<&mut [f32]>) = self
            .owed
            .iter_mut()
            .map(|Pending { l, dh, dh_dot_h, w, dw }| {
                (consumer_grad(src.saved(*l), dh, dh_dot_h, w), dw.as_mut_slice())
            })
            .unzip();
        let (blocks, d) = (&src.blocks, src.blocks.d);
        // The whole model's pass over block n takes every consumer after it and the output.
        let pass = src.sublayers.saturating_sub(n * src.block_size) + 1;
        let (v, r) = (blocks.get(n), blocks.rstd(n));
        depth::backward_source(&mut dws, &consumers, n, v, r, d, pass, from.as_ref(), finish)
    }

    /// Adds the query gradients of the consumers owed into `grads`, once every source they read
    /// is backpropagated.
    pub fn query_grads(&self, params: &[f32], grads: &mut [f32], layout: &Layout) {
        for p in &self.owed {
            query_grad(depth_params(layout, p.l), &p.dw, params, grads);
        }
    }

    /// Gradient of the embedding `b_0`, every consumer's last source; their query gradients
    /// are then complete and go into `grads`.
    pub fn embedding_grad(
        mut self,
        src: &Sources,
        params: &[f32],
        grads: &mut [f32],
        layout: &Layout,
    ) -> Vec<f32> {
        let de = self.block_grad(0, src);
        self.query_grads(params, grads, layout);
        de
    }
}

fn consumer_grad<'a>(
    saved: &'a DepthSaved,
    dh: &'a [f32],
    dh_dot_h: &'a [f32],
    w: &'a [f32],
) -> ConsumerGrad<'a> {
    ConsumerGrad {
        dh,
        dh_dot_h,
        alpha: &saved.alpha,
        logits: &saved.logits,
        n_sources: saved.n_sources,
        w,
    }
}
