//! The residual connection on the GPU, as `crate::model::residual` runs it on the CPU: the
//! standard stream, or the sources of Full and Block AttnRes with the two-phase forward of
//! their depth attention and its backward taken per source.
//!
//! Full AttnRes is Block AttnRes with blocks of one sublayer, so both run through the same code
//! with blocks of S sublayers: sublayer `l` reads the completed sources `b_0 .. b_{l/S}` (the
//! embedding, then block sums) and, inside a block, the running partial sum; the output
//! aggregation reads every completed source. When a block starts, phase 1 scores its completed
//! sources for all of the block's consumers at once; phase 2 makes each consumer's partial sum,
//! merges it and normalises the result in one pass. Either way the residual hands each
//! sublayer its input and that input's RMSNorm at once.
//! Backward takes each consumer's partial-sum gradient at once, with its norm's backward, and
//! a completed source's gradient from all of its readers: a block of readers at a time, or
//! all of them together when the backward pass reaches the source ([`DepthBackward`]).
//! With the ablation options the sources are the same, and each consumer is taken in one pass
//! over those it reads, both ways ([`super::ablation`], [`AblationBackward`]).

use super::ablation::{self, InputQuery, ParamGrads};
use super::params::Params;
use crate::gpu::act::Act;
use crate::gpu::buffer::{Buf, Slice, SliceMut};
use crate::gpu::depth::{self, ConsumerGrad, Normed, PartialSum, Phase1, Source, Weights};
use crate::gpu::depth_ablation::{self, Read};
use crate::gpu::device::Device;
use crate::gpu::rmsnorm;
use crate::model::params::Layout;
use crate::model::residual::Ablation;
use crate::model::Config;
use anyhow::Result;

/// Where consumer `l`'s pseudo-query and key-norm gain lie among the parameters: the effective
/// query is their product.
fn query_and_gain(layout: &Layout, l: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    let p = layout.depth_params(l).expect("AttnRes layout has depth parameters");
    (p.query.clone(), p.gain.clone().expect("the method's depth attention has key-norm gains"))
}

/// A consumer's input `h` with its RMSNorm (`xn`, per-token `rstd`), as the sublayer, or the
/// final norm's product, takes it.
pub struct NormedInput<A: Act> {
    pub h: Buf<A>,
    pub xn: Buf<A>,
    pub rstd: Buf<f32>,
}

/// The residual state of a forward pass.
// One per pass: the size of the larger variant does not matter.
#[allow(clippy::large_enum_variant)]
pub enum ResidualForward<A: Act> {
    /// The residual stream: each sublayer keeps its input `h_l`, the stream there.
    Standard {
        eps: f32,
    },
    Depth(DepthForward<A>),
}

/// What one consumer of the depth attention saved for backward.
struct ConsumerSaved<A: Act> {
    /// `[rows, K]` each (`[rows, K, heads]` with heads): weights and logits over the sources
    /// read (completed first).
    alpha: Buf<f32>,
    logits: Buf<f32>,
    n_sources: usize,
    /// The partial sum it read, values and per-token 1/rms.
    partial: Option<(Buf<A>, Buf<f32>)>,
    /// The completed sources it read: the embedding, then `first..completed`.
    first: usize,
    completed: usize,
    /// An ablation's input-dependent query.
    input_query: Option<InputQuery<A>>,
}

/// The sources of Full or Block AttnRes as the forward pass makes them, and what each consumer
/// saved.
pub struct DepthForward<A: Act> {
    block_size: usize,
    sublayers: usize,
    rows: usize,
    d: usize,
    eps: f32,
    /// Effective query `q ⊙ γ` of every consumer (sublayers, then the output), `[L + 1, d]`;
    /// none with the ablation options, which are run one consumer at a time instead.
    queries: Option<Buf<f32>>,
    /// The ablation options, when the model sets any (`super::ablation`), and the gain of ones
    /// of their input-dependent queries' norm (`ablation::unit_gain`).
    ablation: Option<Ablation>,
    unit_gain: Option<Buf<f32>>,
    /// The completed sources `b_0 ..` (`[capacity, rows, d]`) and their 1/rms.
    values: Buf<A>,
    rstd: Buf<f32>,
    completed: usize,
    /// The running sum of the current block's outputs, and its 1/rms.
    partial: Option<(Buf<A>, Buf<f32>)>,
    /// Phase 1 of the current block.
    phase1: Option<Phase1<A>>,
    saved: Vec<ConsumerSaved<A>>,
}

impl<A: Act> ResidualForward<A> {
    /// Starts from the embedding output `e` (`[rows, d]`): the state, and the first sublayer's
    /// input normalised with gain `g`.
    pub fn new(
        dev: &Device,
        c: &Config,
        p: &Params<A>,
        e: Buf<A>,
        g: Slice<f32>,
    ) -> Result<(Self, NormedInput<A>)> {
        let (d, sublayers, eps) = (c.hidden_size, c.sublayers(), c.rms_norm_eps as f32);
        let Some(s) = c.block_size() else {
            let (xn, rstd) = rmsnorm::forward(dev, &e, g, d, eps)?;
            return Ok((ResidualForward::Standard { eps }, NormedInput { h: e, xn, rstd }));
        };
        let rows = e.len() / d;
        let ablation = Ablation::of(c);
        let queries = match ablation {
            Some(_) => None,
            None => {
                let mut queries = dev.output((sublayers + 1) * d)?;
                for l in 0..=sublayers {
                    let (q, g) = query_and_gain(p.layout, l);
                    let (q, g) = (p.params.slice(q), p.params.slice(g));
                    depth::product(dev, &mut queries.slice_mut(l * d..(l + 1) * d), q, g, false)?;
                }
                Some(queries)
            }
        };
        // The embedding and every block: what the output aggregation reads.
        let capacity = sublayers.div_ceil(s) + 1;
        let mut f = DepthForward {
            block_size: s,
            sublayers,
            rows,
            d,
            eps,
            queries,
            ablation,
            unit_gain: ablation.map(|ab| ablation::unit_gain(dev, &ab, d)).transpose()?.flatten(),
            values: dev.output(capacity * rows * d)?,
            rstd: dev.output(capacity * rows)?,
            completed: 0,
            partial: None,
            phase1: None,
            saved: Vec::new(),
        };
        f.complete(dev, &e, None)?;
        let first = f.input(dev, 0, None, g, p)?;
        Ok((ResidualForward::Depth(f), first))
    }

    /// Records the raw output `out` of sublayer `l`, whose input was `h`, and hands over the
    /// next consumer's input normalised with gain `g`: sublayer `l + 1`'s, or after the last
    /// sublayer the final norm's.
    pub fn next(
        &mut self,
        dev: &Device,
        l: usize,
        h: &Buf<A>,
        out: Buf<A>,
        g: Slice<f32>,
        p: &Params<A>,
    ) -> Result<NormedInput<A>> {
        match self {
            ResidualForward::Standard { eps } => {
                let (h, xn, rstd) = rmsnorm::add_forward(dev, h, &out, g, g.len(), *eps)?;
                Ok(NormedInput { h, xn, rstd })
            }
            ResidualForward::Depth(f) => f.next(dev, l, out, g, p),
        }
    }
}

impl<A: Act> DepthForward<A> {
    /// Whether sublayer `l` is the last of its block (the last block may be shorter).
    fn ends_block(&self, l: usize) -> bool {
        (l + 1).is_multiple_of(self.block_size) || l + 1 == self.sublayers
    }

    /// Consumer `l`'s effective query.
    fn query(&self, l: usize) -> Slice<'_, f32> {
        let queries = self.queries.as_ref().expect("the method's queries");
        queries.slice(l * self.d..(l + 1) * self.d)
    }

    /// What a consumer of the ablations reads: the embedding, the completed sources
    /// `first..completed`, and `partial`.
    fn read<'a>(
        &'a self,
        first: usize,
        completed: usize,
        partial: Option<&'a (Buf<A>, Buf<f32>)>,
    ) -> Read<'a, A> {
        Read {
            values: self.values.all(),
            rstds: self.rstd.all(),
            partial: partial.map(|(v, r)| (v.all(), r.all())),
            first,
            completed,
            rows: self.rows,
            d: self.d,
        }
    }

    /// Source `n` (`[rows, d]`) and its 1/rms.
    fn source(&self, n: usize) -> Source<'_, A> {
        let (rows, d) = (self.rows, self.d);
        Source {
            v: self.values.slice(n * rows * d..(n + 1) * rows * d),
            rstd: self.rstd.slice(n * rows..(n + 1) * rows),
        }
    }

    /// Appends the completed source `a + b` (or `a`).
    fn complete(&mut self, dev: &Device, a: &Buf<A>, b: Option<&Buf<A>>) -> Result<()> {
        let (n, rows, d) = (self.completed, self.rows, self.d);
        let out = &mut self.values.slice_mut(n * rows * d..(n + 1) * rows * d);
        let rstd = &mut self.rstd.slice_mut(n * rows..(n + 1) * rows);
        depth::sum_rstd(dev, out, rstd, a.all(), b.map(|b| b.all()), d, self.eps)?;
        self.completed += 1;
        Ok(())
    }

    /// The normalised input of consumer `l` (a sublayer, or the output at `L`; consumers in
    /// order), its weights saved; `partial`: the partial sum it reads, which it makes.
    fn input(
        &mut self,
        dev: &Device,
        l: usize,
        partial: Option<PartialSum<A>>,
        g: Slice<f32>,
        p: &Params<A>,
    ) -> Result<NormedInput<A>> {
        let (s, rows, d) = (self.block_size, self.rows, self.d);
        debug_assert_eq!(self.saved.len(), l, "consumers in order");
        if let Some(ab) = self.ablation {
            return self.ablation_input(dev, &ab, l, g, p);
        }
        let is_output = l == self.sublayers;
        if is_output || l.is_multiple_of(s) {
            debug_assert!(partial.is_none(), "a block's first consumer reads no partial sum");
            // Phase 1 for every consumer of the block that starts here (the last block may be
            // shorter; the output aggregation is a block of its own).
            let last = if is_output { l + 1 } else { (l + s).min(self.sublayers) };
            let c = self.completed;
            let ws = self.queries.as_ref().expect("the method's queries").slice(l * d..last * d);
            let (v, r) = (self.values.slice(0..c * rows * d), self.rstd.slice(0..c * rows));
            self.phase1 = Some(depth::phase1(dev, v, r, ws, rows, d)?);
        }
        let p1 = self.phase1.as_ref().expect("phase 1 ran at the block's start");
        let n_sources = self.completed + partial.is_some() as usize;
        let w = self.query(l);
        let j = if is_output { 0 } else { l % s };
        let x = depth::input(dev, p1, j, partial, w, g, d, self.eps)?;
        let (alpha, logits, completed) = (x.alpha, x.logits, self.completed);
        let (partial, first, input_query) = (None, 1, None);
        let saved =
            ConsumerSaved { alpha, logits, n_sources, partial, first, completed, input_query };
        self.saved.push(saved);
        Ok(NormedInput { h: x.h, xn: x.xn, rstd: x.rstd })
    }

    /// [`Self::input`] with the ablation options: consumer `l` reads the embedding, the latest
    /// completed sources (all of them without a window) and the current partial sum, in one
    /// pass.
    fn ablation_input(
        &mut self,
        dev: &Device,
        ab: &Ablation,
        l: usize,
        g: Slice<f32>,
        p: &Params<A>,
    ) -> Result<NormedInput<A>> {
        let (completed, d, eps) = (self.completed, self.d, self.eps);
        let first = ab.first_read(completed);
        let read = self.read(first, completed, self.partial.as_ref());
        let n_sources = read.k();
        let x = ablation::forward(dev, ab, l, &read, p, self.unit_gain.as_ref(), eps)?;
        let (xn, rstd) = rmsnorm::forward(dev, &x.h, g, d, eps)?;
        let (alpha, logits, input_query, partial) = (x.alpha, x.logits, x.input_query, None);
        let saved =
            ConsumerSaved { alpha, logits, n_sources, partial, first, completed, input_query };
        self.saved.push(saved);
        Ok(NormedInput { h: x.h, xn, rstd })
    }

    /// Records the raw output of sublayer `l`: at the end of its block, the block's sum becomes
    /// the next completed source; inside it, `out` becomes the next partial sum (in place).
    /// Then consumer `l + 1`'s normalised input. The partial sum `l` read goes to its saved
    /// state.
    fn next(
        &mut self,
        dev: &Device,
        l: usize,
        mut out: Buf<A>,
        g: Slice<f32>,
        p: &Params<A>,
    ) -> Result<NormedInput<A>> {
        let read = self.partial.take();
        if self.ends_block(l) {
            self.complete(dev, &out, read.as_ref().map(|(v, _)| v))?;
            self.saved[l].partial = read;
            return self.input(dev, l + 1, None, g, p);
        }
        let mut rstd = dev.output(self.rows)?;
        let prev = read.as_ref().map(|(v, _)| v.all());
        if self.ablation.is_some() {
            // The next partial sum first, which the next consumer then reads.
            let mut sum = dev.output(out.len())?;
            let (all, d, eps) = (&mut sum.all_mut(), self.d, self.eps);
            depth::sum_rstd(dev, all, &mut rstd.all_mut(), out.all(), prev, d, eps)?;
            self.saved[l].partial = read;
            self.partial = Some((sum, rstd));
            return self.input(dev, l + 1, None, g, p);
        }
        let update = PartialSum { sum: &mut out, rstd: &mut rstd, prev };
        let x = self.input(dev, l + 1, Some(update), g, p)?;
        self.saved[l].partial = read;
        self.partial = Some((out, rstd));
        Ok(x)
    }
}

/// Gradients flowing back through the residual connection.
#[allow(clippy::large_enum_variant)]
pub enum ResidualBackward<A: Act> {
    /// The gradient of the stream.
    Standard {
        acc: Buf<A>,
    },
    Depth(DepthBackward<A>),
    Ablation(AblationBackward<A>),
}

/// The backward of the ablation options, a consumer at a time: each completed source's
/// gradient summed over its readers in f32, and each consumer's depth parameters'.
pub struct AblationBackward<A: Act> {
    /// The gradient of the output of the sublayer being processed, as [`DepthBackward`]'s.
    acc: Option<Buf<A>>,
    /// The completed sources' gradients, laid out as their values.
    dvalues: Buf<f32>,
    params: ParamGrads,
    /// Where the gradient of the input-dependent queries' norm's gain of ones goes, dropped.
    unit_grad: Option<Buf<f32>>,
}

/// A consumer backpropagated, whose gradients into completed sources are still owed.
struct Owed<A: Act> {
    l: usize,
    dh: Buf<A>,
    dh_dot_h: Buf<f32>,
}

/// Blocks of at least this many sublayers take their readers' gradients into the completed
/// sources a block at a time (see [`DepthBackward`]).
const BY_BLOCK_FROM: usize = 4;

/// The depth attention's backward.
///
/// A completed source's gradient sums those of all of its readers: the consumers of every
/// later block and the output aggregation. With blocks of [`BY_BLOCK_FROM`] sublayers or more
/// they are taken a block of readers at a time: once the backward pass has taken every
/// consumer of a block (the output aggregation first), one launch adds their gradients into
/// every source they read, so each reader's `dh` is read once and then freed. With smaller
/// blocks (Full AttnRes: blocks of one) each source's gradient is taken from all of its
/// readers together when the backward pass reaches it, so each source is read once. For a
/// block of S readers over C sources, the first reads S + 3C rows (the readers' gradients,
/// each source, and its gradient read and written), the second S·C; over a model's blocks
/// the first reads less from S = 4 on.
pub struct DepthBackward<A: Act> {
    /// The gradient of the output of the sublayer being processed: its block's gradient plus
    /// those of the partial sums it fed.
    acc: Option<Buf<A>>,
    /// Consumers backpropagated whose gradients into the completed sources are still owed,
    /// last first.
    owed: Vec<Owed<A>>,
    /// A block at a time: the gradients of the completed sources not yet reached, in order,
    /// as summed so far.
    by_block: Option<Vec<Buf<A>>>,
    /// The effective queries' gradients (`[L + 1, d]`).
    dws: Buf<f32>,
    /// Per consumer and token, the coefficients of its query gradient from a source: `[L + 1,
    /// rows]` for the source at hand, or a block at a time one such slab per completed source.
    b: Buf<A>,
}

/// The gradient of a consumer's input `x.h` from that of its normalised input, `dxn` (the
/// norm's gain `g`, whose gradient goes into `dg`), with each token's `⟨dh, h⟩`, which the
/// depth attention's backward takes.
fn input_grad_of<A: Act>(
    dev: &Device,
    dxn: &Buf<A>,
    x: &NormedInput<A>,
    g: Slice<f32>,
    dg: &mut SliceMut<f32>,
) -> Result<(Buf<A>, Buf<f32>)> {
    let mut dhh = dev.output(x.rstd.len())?;
    let dh = rmsnorm::backward(dev, dg, dxn, &x.h, g, &x.rstd, g.len(), Some(&mut dhh))?;
    Ok((dh, dhh))
}

impl<A: Act> ResidualBackward<A> {
    /// Starts from `dxn`, the gradient of the final norm's output (whose input and gain were
    /// `x` and `g`; the gain's gradient goes into `dg`): backpropagates the final norm and the
    /// output aggregation.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dev: &Device,
        fwd: &ResidualForward<A>,
        dxn: &Buf<A>,
        x: &NormedInput<A>,
        g: Slice<f32>,
        dg: &mut SliceMut<f32>,
        p: &Params<A>,
    ) -> Result<Self> {
        let ResidualForward::Depth(f) = fwd else {
            let acc = rmsnorm::backward(dev, dg, dxn, &x.h, g, &x.rstd, g.len(), None)?;
            return Ok(ResidualBackward::Standard { acc });
        };
        let (consumers, rows, d) = (f.sublayers + 1, f.rows, f.d);
        if f.ablation.is_some() {
            let dh = rmsnorm::backward(dev, dg, dxn, &x.h, g, &x.rstd, d, None)?;
            let mut b = AblationBackward {
                acc: None,
                dvalues: dev.zeros(f.values.len())?,
                params: ParamGrads::new(dev, p, consumers)?,
                unit_grad: f.unit_gain.as_ref().map(|_| dev.zeros(d)).transpose()?,
            };
            b.consumer(dev, f, f.sublayers, &dh, p)?;
            return Ok(ResidualBackward::Ablation(b));
        }
        let (dh, dh_dot_h) = input_grad_of(dev, dxn, x, g, dg)?;
        let by_block = f.block_size >= BY_BLOCK_FROM;
        let slabs = if by_block { f.completed } else { 1 };
        let mut b = DepthBackward {
            acc: None,
            owed: Vec::new(),
            by_block: None,
            dws: dev.zeros(consumers * d)?,
            b: dev.output(slabs * consumers * rows)?,
        };
        if by_block {
            let sources = (0..f.completed).map(|_| dev.output(rows * d));
            b.by_block = Some(sources.collect::<Result<_>>()?);
        }
        // The output aggregation is a block of its own: it reads no partial sum.
        b.owe(dev, f, Owed { l: f.sublayers, dh, dh_dot_h })?;
        Ok(ResidualBackward::Depth(b))
    }

    /// The gradient of the raw output of sublayer `l` (sublayers from last to first).
    pub fn output_grad(
        &mut self,
        dev: &Device,
        l: usize,
        fwd: &ResidualForward<A>,
    ) -> Result<&Buf<A>> {
        match (self, fwd) {
            (ResidualBackward::Standard { acc }, _) => Ok(acc),
            (ResidualBackward::Depth(b), ResidualForward::Depth(f)) => {
                if f.ends_block(l) {
                    // The last sublayer of its block: start from the gradient of its block sum.
                    b.acc = Some(b.source_grad(dev, f, l / f.block_size + 1)?);
                }
                Ok(b.acc.as_ref().expect("a block's last sublayer comes first"))
            }
            (ResidualBackward::Ablation(b), ResidualForward::Depth(f)) => {
                if f.ends_block(l) {
                    let n = l / f.block_size + 1;
                    let plane = f.rows * f.d;
                    let grad = b.dvalues.slice(n * plane..(n + 1) * plane);
                    b.acc = Some(depth_ablation::narrow(dev, grad)?);
                }
                Ok(b.acc.as_ref().expect("a block's last sublayer comes first"))
            }
            _ => unreachable!("backward state of another residual"),
        }
    }

    /// Backpropagates `dxn`, the gradient of sublayer `l`'s normalised input (its input and
    /// the norm's gain were `x` and `g`; the gain's gradient goes into `dg`), through the norm
    /// and into the residual: the standard stream's gradient takes the input's in the norm's
    /// own pass.
    #[allow(clippy::too_many_arguments)]
    pub fn input_grad(
        &mut self,
        dev: &Device,
        l: usize,
        dxn: &Buf<A>,
        x: &NormedInput<A>,
        g: Slice<f32>,
        dg: &mut SliceMut<f32>,
        fwd: &ResidualForward<A>,
        p: &Params<A>,
    ) -> Result<()> {
        match (self, fwd) {
            (ResidualBackward::Standard { acc }, _) => {
                rmsnorm::backward_into(dev, acc, true, dg, dxn, &x.h, g, &x.rstd, g.len(), None)
            }
            (ResidualBackward::Depth(b), ResidualForward::Depth(f)) => {
                b.input_grad(dev, f, l, dxn, x, g, dg)
            }
            (ResidualBackward::Ablation(b), ResidualForward::Depth(f)) => {
                let dh = rmsnorm::backward(dev, dg, dxn, &x.h, g, &x.rstd, f.d, None)?;
                b.consumer(dev, f, l, &dh, p)
            }
            _ => unreachable!("backward state of another residual"),
        }
    }

    /// The gradient of the embedding output; the depth queries' and gains' gradients go into
    /// `grads`.
    pub fn embedding_grad(
        self,
        dev: &Device,
        fwd: &ResidualForward<A>,
        params: &Buf<f32>,
        grads: &mut Buf<f32>,
        layout: &Layout,
    ) -> Result<Buf<A>> {
        match (self, fwd) {
            (ResidualBackward::Standard { acc }, _) => Ok(acc),
            (ResidualBackward::Depth(mut b), ResidualForward::Depth(f)) => {
                let de = b.source_grad(dev, f, 0)?;
                let d = f.d;
                for l in 0..=f.sublayers {
                    let (query, gain) = query_and_gain(layout, l);
                    let dw = b.dws.slice(l * d..(l + 1) * d);
                    let (q, g) = (params.slice(query.clone()), params.slice(gain.clone()));
                    depth::product(dev, &mut grads.slice_mut(query), dw, g, true)?;
                    depth::product(dev, &mut grads.slice_mut(gain), dw, q, true)?;
                }
                Ok(de)
            }
            (ResidualBackward::Ablation(b), ResidualForward::Depth(f)) => {
                let de = depth_ablation::narrow(dev, b.dvalues.slice(0..f.rows * f.d))?;
                b.params.add_into(dev, grads)?;
                Ok(de)
            }
            _ => unreachable!("backward state of another residual"),
        }
    }
}

impl<A: Act> AblationBackward<A> {
    /// Backpropagates `dh`, the gradient of consumer `l`'s input, into the sources it read
    /// (the partial sum's into `acc`) and its depth parameters.
    fn consumer(
        &mut self,
        dev: &Device,
        f: &DepthForward<A>,
        l: usize,
        dh: &Buf<A>,
        p: &Params<A>,
    ) -> Result<()> {
        let ab = f.ablation.as_ref().expect("a model with the ablation options");
        let saved = &f.saved[l];
        let read = f.read(saved.first, saved.completed, saved.partial.as_ref());
        let acc = "a partial sum's reader follows a block's end";
        let dp = saved.partial.as_ref().map(|_| self.acc.as_mut().expect(acc));
        let kept = ablation::Saved {
            alpha: &saved.alpha,
            logits: &saved.logits,
            input_query: saved.input_query.as_ref(),
        };
        let unit = f.unit_gain.as_ref().zip(self.unit_grad.as_mut());
        let (dvalues, grads) = (&mut self.dvalues, &mut self.params);
        ablation::backward(dev, ab, l, dh, &read, kept, dvalues, dp, p, grads, unit)
    }
}

/// What consumer `l`'s forward kept for its backward.
fn weights_of<A: Act>(f: &DepthForward<A>, l: usize) -> Weights<'_> {
    let saved = &f.saved[l];
    Weights {
        alpha: &saved.alpha,
        logits: &saved.logits,
        n_sources: saved.n_sources,
        w: f.query(l),
    }
}

/// The owed consumers as the completed sources' backward reads them.
fn readers<'a, A: Act>(
    f: &'a DepthForward<A>,
    owed: &'a [Owed<A>],
) -> Vec<(usize, ConsumerGrad<'a, A>)> {
    let grad = |o: &'a Owed<A>| ConsumerGrad {
        dh: &o.dh,
        dh_dot_h: &o.dh_dot_h,
        weights: weights_of(f, o.l),
    };
    owed.iter().map(|o| (o.l, grad(o))).collect()
}

impl<A: Act> DepthBackward<A> {
    /// Backpropagates consumer `l`'s norm (as [`ResidualBackward::input_grad`]), with its
    /// gradient into the partial sum it reads at once (into `acc`, the gradient of the block's
    /// earlier outputs), and owes the rest.
    #[allow(clippy::too_many_arguments)]
    fn input_grad(
        &mut self,
        dev: &Device,
        f: &DepthForward<A>,
        l: usize,
        dxn: &Buf<A>,
        x: &NormedInput<A>,
        g: Slice<f32>,
        dg: &mut SliceMut<f32>,
    ) -> Result<()> {
        let d = f.d;
        let (dh, dh_dot_h) = match &f.saved[l].partial {
            None => input_grad_of(dev, dxn, x, g, dg)?,
            Some((pv, pr)) => {
                let partial = Source { v: pv.all(), rstd: pr.all() };
                let acc = self.acc.as_mut().expect("a partial sum's reader follows a block's end");
                let dw = &mut self.dws.slice_mut(l * d..(l + 1) * d);
                let normed = Normed { h: &x.h, rstd: &x.rstd, g };
                let read = weights_of(f, l);
                depth::partial_backward(dev, acc, dg, dw, dxn, normed, read, partial)?
            }
        };
        self.owe(dev, f, Owed { l, dh, dh_dot_h })
    }

    /// Owes consumer `o`'s gradients into the completed sources. A block at a time, the first
    /// consumer of a block (the last the backward pass takes) pays what the block owes.
    fn owe(&mut self, dev: &Device, f: &DepthForward<A>, o: Owed<A>) -> Result<()> {
        let starts_block = o.l == f.sublayers || o.l.is_multiple_of(f.block_size);
        self.owed.push(o);
        let Some(sources) = self.by_block.as_mut().filter(|_| starts_block) else { return Ok(()) };
        let (n, rows, d) = (sources.len(), f.rows, f.d);
        let src = Source { v: f.values.slice(0..n * rows * d), rstd: f.rstd.slice(0..n * rows) };
        // The output aggregation comes first and reads every source: the sums start there.
        let accumulate = self.owed[0].l != f.sublayers;
        let readers = readers(f, &self.owed);
        let consumers = f.sublayers + 1;
        depth::source_grads(dev, sources, accumulate, &mut self.b, consumers, &readers, 0, src, d)?;
        self.owed.clear();
        Ok(())
    }

    /// The gradient of completed source `n` from all of its readers (consumers `n·S ..= L`,
    /// or the output alone after a shorter last block), and their query gradients from it.
    fn source_grad(&mut self, dev: &Device, f: &DepthForward<A>, n: usize) -> Result<Buf<A>> {
        let (rows, d, consumers) = (f.rows, f.d, f.sublayers + 1);
        let first = (n * f.block_size).min(f.sublayers);
        let src = f.source(n);
        let (out, slab) = match self.by_block.as_mut() {
            Some(sources) => {
                debug_assert_eq!(sources.len(), n + 1, "sources reached last first");
                (sources.pop().expect("a source not yet reached"), n)
            }
            None => {
                // Every consumer owed so far, which are exactly the source's readers.
                debug_assert_eq!(self.owed.last().map(|o| o.l), Some(first), "readers of {n}");
                let readers = readers(f, &self.owed);
                let mut out = [dev.output(rows * d)?];
                depth::source_grads(
                    dev,
                    &mut out,
                    false,
                    &mut self.b,
                    consumers,
                    &readers,
                    n,
                    src,
                    d,
                )?;
                let [out] = out;
                (out, 0)
            }
        };
        let at = slab * consumers;
        let b = self.b.slice((at + first) * rows..(at + consumers) * rows);
        let dws = &mut self.dws.slice_mut(first * d..consumers * d);
        depth::query_grads(dev, dws, b, src.v, rows, d)?;
        Ok(out)
    }
}
