//! The residual connection: the one place where `standard`, `full` and `block` differ.
//!
//! The transformer asks [`ResidualForward::input`] for the input `h_l` of sublayer `l`, hands
//! back its raw output with [`ResidualForward::push_output`], and finally asks for
//! [`ResidualForward::output`], the vector that goes into the final norm. Backward mirrors this
//! with [`ResidualBackward`]. A pipeline stage picks both up in the middle of the model
//! ([`ResidualForward::resume`], [`ResidualBackward::resume`]) and hands them on
//! ([`ResidualForward::source`], [`ResidualBackward::hand_back`]; docs/pipeline.md).
//!
//! `standard` (docs/method.md §2) is the running stream, here. Full and Block AttnRes, the
//! method, are in `attnres.rs`: its sources, two-phase forward and per-source backward. The
//! ablations of §5 are in `ablation.rs`: they read the same sources, one pass per consumer.

mod ablation;
mod attnres;

pub(crate) use self::ablation::Ablation;
use self::ablation::BlockGrads;
use self::attnres::{effective_queries, PendingGrads, Sources, TwoPhase};
use super::config::Config;
use super::params::Layout;
use crate::kernels;
pub use crate::kernels::depth::SourceSums;
use std::sync::Arc;

// One per forward pass: the size of the larger variant does not matter.
#[allow(clippy::large_enum_variant)]
enum State {
    /// The residual stream `h_l`.
    Standard { stream: Vec<f32> },
    /// AttnRes: the sources, and how each consumer mixes them.
    Depth { sources: Sources, mix: Mix },
}

/// How the consumers of an AttnRes model mix their sources.
enum Mix {
    /// The method, in the two-phase form.
    TwoPhase(TwoPhase),
    /// An ablation option is set: one pass per consumer.
    Ablation(Ablation),
}

pub struct ResidualForward {
    state: State,
    /// Keep what backward needs (inference does not).
    for_backward: bool,
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

/// The depth-attention weights of one token: per consumer (sublayers in order, then the output
/// aggregation), the weight it gave each of the model's distinct sources
/// (`Config::depth_sources`), `None` for a source it does not read. Several depth heads are
/// averaged.
pub type DepthMap = Vec<Vec<Option<f32>>>;

impl DepthWeights<'_> {
    /// The weights of token `row` over `sources` distinct sources.
    pub fn of_row(&self, row: usize, sources: usize) -> DepthMap {
        let heads = self.heads;
        let consumer = |(alpha, cols): (&&[f32], &Vec<usize>)| {
            let k = cols.len() * heads;
            let mut out = vec![None; sources];
            for (i, x) in alpha[row * k..(row + 1) * k].iter().enumerate() {
                let w: &mut Option<f32> = &mut out[cols[i / heads]];
                *w = Some(w.unwrap_or(0.0) + x / heads as f32);
            }
            out
        };
        self.alpha.iter().zip(&self.columns).map(consumer).collect()
    }
}

impl ResidualForward {
    /// Starts from the embedding output `e` (`[rows, d]`). `for_backward`: keep what
    /// [`ResidualBackward`] needs.
    pub fn new(c: &Config, e: Vec<f32>, for_backward: bool) -> Self {
        let state = match c.block_size() {
            None => State::Standard { stream: e },
            Some(s) => {
                let sources = Sources::new(c, s, &e);
                let mix = match Ablation::of(c) {
                    None => Mix::TwoPhase(TwoPhase::new(c, s, sources.blocks.rows)),
                    Some(ab) => Mix::Ablation(ab),
                };
                State::Depth { sources, mix }
            }
        };
        ResidualForward { state, for_backward }
    }

    /// The state before sublayer `k` as a pipeline stage receives it from the stage before:
    /// for the standard residual `completed` is the stream alone; for AttnRes it holds the
    /// completed sources `b_0 ..` in order, with the partial sum when `k` lies inside a block.
    /// Keeps what backward needs. Not for the ablations (one pass per consumer).
    pub fn resume(c: &Config, k: usize, completed: &[&[f32]], partial: Option<&[f32]>) -> Self {
        let state = match c.block_size() {
            None => State::Standard { stream: completed[0].to_vec() },
            Some(s) => {
                assert!(Ablation::of(c).is_none(), "pipeline stages run the method itself");
                let sources = Sources::resume(c, s, k, completed, partial);
                let mix = Mix::TwoPhase(TwoPhase::new(c, s, sources.blocks.rows));
                State::Depth { sources, mix }
            }
        };
        ResidualForward { state, for_backward: true }
    }

    /// Source `n` as a pipeline stage sends it: the stream (standard, `n` = 0), or the
    /// embedding (`n` = 0) or completed block `n` (AttnRes).
    pub fn source(&self, n: usize) -> &[f32] {
        match &self.state {
            State::Standard { stream } => stream,
            State::Depth { sources, .. } => sources.blocks.get(n),
        }
    }

    /// Completed sources held (the stream counts as one).
    pub fn completed(&self) -> usize {
        match &self.state {
            State::Standard { .. } => 1,
            State::Depth { sources, .. } => sources.blocks.len(),
        }
    }

    /// The running partial sum of the current block, when it has one.
    pub fn partial(&self) -> Option<&[f32]> {
        match &self.state {
            State::Standard { .. } => None,
            State::Depth { sources, .. } => sources.partial_values(),
        }
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
        if let State::Depth { mix: Mix::TwoPhase(tp), .. } = &mut self.state {
            tp.queries = queries;
        }
        self
    }

    /// The input `h_l` of sublayer `l` (sublayers must be visited in order).
    pub fn input(&mut self, l: usize, params: &[f32], layout: &Layout) -> Vec<f32> {
        let keep = self.for_backward;
        match &mut self.state {
            State::Standard { stream } => kernels::copy(stream),
            State::Depth { sources, mix } => {
                debug_assert_eq!(sources.consumed, l);
                sources.consumed += 1;
                match mix {
                    Mix::TwoPhase(tp) => tp.input(sources, l, params, layout, keep),
                    Mix::Ablation(ab) => {
                        let partial = sources.partial();
                        let (h, saved) = ab.forward(l, sources, partial, params, layout);
                        if keep {
                            sources.saved.push(saved);
                        }
                        h
                    }
                }
            }
        }
    }

    /// Records the raw output of sublayer `l`.
    pub fn push_output(&mut self, l: usize, out: Vec<f32>) {
        match &mut self.state {
            State::Standard { stream } => kernels::add_assign(stream, &out),
            State::Depth { sources, .. } => sources.push_output(l, out, self.for_backward),
        }
    }

    /// The vector fed to the final norm: the stream, or the output aggregation over
    /// `[b_0 .. b_N]`.
    pub fn output(&mut self, params: &[f32], layout: &Layout) -> Vec<f32> {
        let keep = self.for_backward;
        match &mut self.state {
            State::Standard { stream } => kernels::copy(stream),
            State::Depth { sources, mix } => {
                let l = sources.consumed;
                sources.consumed += 1;
                match mix {
                    Mix::TwoPhase(tp) => tp.output(sources, params, layout, keep),
                    Mix::Ablation(ab) => {
                        let (h, saved) = ab.forward(l, sources, None, params, layout);
                        if keep {
                            sources.saved.push(saved);
                        }
                        h
                    }
                }
            }
        }
    }

    /// Depth-attention weights of every consumer, or `None` for the standard residual.
    pub fn depth_weights(&self) -> Option<DepthWeights<'_>> {
        let State::Depth { sources, mix } = &self.state else { return None };
        Some(DepthWeights {
            alpha: sources.saved.iter().map(|s| s.alpha.as_slice()).collect(),
            columns: sources.saved.iter().map(|s| sources.columns(s)).collect(),
            heads: match mix {
                Mix::TwoPhase(_) => 1,
                Mix::Ablation(ab) => ab.heads(),
            },
        })
    }
}

/// Gradients flowing back through the residual connection.
pub struct ResidualBackward {
    /// Standard: gradient of the stream. AttnRes: gradient of the output of the sublayer being
    /// processed (its block's gradient plus those of the partial sums it fed).
    acc: Vec<f32>,
    grads: Grads,
}

enum Grads {
    Standard,
    TwoPhase(PendingGrads),
    Ablation(BlockGrads),
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
            State::Standard { .. } => ResidualBackward { acc: dh, grads: Grads::Standard },
            State::Depth { sources, mix } => {
                let out = sources.first + sources.saved.len() - 1;
                let mut rb = ResidualBackward { acc: Vec::new(), grads: Grads::Standard };
                match mix {
                    Mix::TwoPhase(tp) => {
                        let mut pending = PendingGrads::default();
                        pending.owe(&mut rb.acc, out, dh, dh_dot_h, sources, tp);
                        rb.grads = Grads::TwoPhase(pending);
                    }
                    Mix::Ablation(ab) => {
                        let mut g = BlockGrads::new(sources.blocks.len(), dh.len());
                        g.backward(&mut rb.acc, out, &dh, ab, sources, params, grads, layout);
                        rb.grads = Grads::Ablation(g);
                    }
                }
                rb
            }
        }
    }

    /// Gradient of the raw output of sublayer `l` (sublayers visited from last to first).
    pub fn output_grad(&mut self, l: usize, fwd: &ResidualForward) -> &[f32] {
        if let State::Depth { sources, .. } = &fwd.state {
            let s = sources.block_size;
            if (l + 1).is_multiple_of(s) || l + 1 == sources.sublayers {
                // Last sublayer of its block: start from the gradient of that block's sum.
                let n = l / s + 1;
                self.acc = match &mut self.grads {
                    Grads::TwoPhase(pending) => pending.block_grad(n, sources),
                    Grads::Ablation(g) => g.take(n),
                    Grads::Standard => unreachable!("AttnRes gradients"),
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
        match (&fwd.state, &mut self.grads) {
            (State::Standard { .. }, _) => kernels::add_assign(&mut self.acc, &dh),
            (State::Depth { sources, mix: Mix::TwoPhase(tp) }, Grads::TwoPhase(pending)) => {
                pending.owe(&mut self.acc, l, dh, dh_dot_h, sources, tp)
            }
            (State::Depth { sources, mix: Mix::Ablation(ab) }, Grads::Ablation(g)) => {
                g.backward(&mut self.acc, l, &dh, ab, sources, params, grads, layout)
            }
            _ => unreachable!("backward state of another residual"),
        }
    }

    /// Starts the backward pass of a pipeline stage at the end of its chunk from what the stage
    /// after sent: `acc`, the gradient of the stream (standard) or of the partial sum the next
    /// chunk read (AttnRes; zeros when it read none), and `from[n]`, the sums of source `n`'s
    /// gradient over the consumers of the later stages (none: no consumer there).
    pub fn resume(fwd: &ResidualForward, acc: Vec<f32>, from: Vec<Option<SourceSums>>) -> Self {
        let grads = match &fwd.state {
            State::Standard { .. } => Grads::Standard,
            State::Depth { .. } => {
                let mut pending = PendingGrads::default();
                pending.from = from;
                Grads::TwoPhase(pending)
            }
        };
        ResidualBackward { acc, grads }
    }

    /// Ends the backward pass of a pipeline stage at the start of its chunk (not the first):
    /// what goes back to the stage before, the gradient of the stream or of the partial sum
    /// (`acc`, see [`Self::resume`]) and the sums of the gradient of every source completed
    /// before the chunk, continued over this stage's consumers. Their query gradients, now
    /// complete, go into `grads`.
    pub fn hand_back(
        self,
        fwd: &ResidualForward,
        params: &[f32],
        grads: &mut [f32],
        layout: &Layout,
    ) -> (Vec<f32>, Vec<SourceSums>) {
        match (&fwd.state, self.grads) {
            (State::Standard { .. }, _) => (self.acc, Vec::new()),
            (State::Depth { sources, .. }, Grads::TwoPhase(mut pending)) => {
                let before = sources.first / sources.block_size + 1;
                let mut sums: Vec<SourceSums> =
                    (0..before).rev().map(|n| pending.block_sums(n, sources)).collect();
                sums.reverse();
                pending.query_grads(params, grads, layout);
                (self.acc, sums)
            }
            (State::Depth { .. }, _) => unreachable!("pipeline stages run the method itself"),
        }
    }

    /// Gradient of the embedding output.
    pub fn embedding_grad(
        self,
        fwd: &ResidualForward,
        params: &[f32],
        grads: &mut [f32],
        layout: &Layout,
    ) -> Vec<f32> {
        match (&fwd.state, self.grads) {
            (State::Standard { .. }, _) => self.acc,
            (State::Depth { sources, .. }, Grads::TwoPhase(pending)) => {
                pending.embedding_grad(sources, params, grads, layout)
            }
            (State::Depth { .. }, Grads::Ablation(g)) => g.embedding_grad(),
            (State::Depth { .. }, Grads::Standard) => unreachable!("AttnRes gradients"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::{Config, ResidualKind};

    /// With zero pseudo-queries each depth attention is the plain average of its sources, so
    /// hand-picked outputs show exactly which sources each sublayer reads (docs/method.md §4):
    /// the embedding once, block sums at boundaries every S sublayers, the partial sum inside
    /// one.
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
