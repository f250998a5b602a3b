//! The depth attention's ablation options on the GPU, as `crate::model::residual` runs them on
//! the CPU: each consumer in one pass over the sources it reads ([`crate::gpu::depth_ablation`]),
//! with the input-dependent query's own product and norm around it. The sources, partial sums
//! and the order of consumers are the method's ([`super::residual`]); backward sums each
//! completed source's gradient over its readers in f32, and each consumer's depth parameters'
//! gradients in a buffer of their own until the pass ends.

use super::params::Params;
use crate::gpu::act::Act;
use crate::gpu::blas::{DType, Gemm};
use crate::gpu::buffer::{Buf, Slice, SliceMut};
use crate::gpu::depth::product;
use crate::gpu::depth_ablation::{self as kernels, Query, Read};
use crate::gpu::device::Device;
use crate::gpu::gemm::{gemm, linear_backward};
use crate::gpu::rmsnorm::{self, add_column_sums};
use crate::model::config::DepthQuery;
use crate::model::params::DepthParams;
use crate::model::residual::Ablation;
use anyhow::Result;
use std::ops::Range;

/// What an input-dependent query keeps for backward: the normalised sum of the sources read,
/// its 1/rms, and the query `W·x̂` before the gain.
pub struct InputQuery<A: Act> {
    xhat: Buf<A>,
    rstd: Buf<f32>,
    q: Buf<f32>,
}

/// Consumer `l`'s depth parameters.
fn depth_params<'a, A: Act>(p: &Params<'a, A>, l: usize) -> &'a DepthParams {
    p.layout.depth_params(l).expect("AttnRes layout has depth parameters")
}

/// A consumer's static query with the gain applied, made when there is a gain.
enum StaticQuery<'a> {
    Param(Slice<'a, f32>),
    Made(Buf<f32>),
}

impl StaticQuery<'_> {
    fn of<'a, A: Act>(dev: &Device, p: &Params<'a, A>, l: usize) -> Result<StaticQuery<'a>> {
        let dp = depth_params(p, l);
        let q = p.params.slice(dp.query.clone());
        Ok(match &dp.gain {
            None => StaticQuery::Param(q),
            Some(g) => {
                let mut w = dev.output(q.len())?;
                product(dev, &mut w.all_mut(), q, p.params.slice(g.clone()), false)?;
                StaticQuery::Made(w)
            }
        })
    }

    fn slice(&self) -> Slice<'_, f32> {
        match self {
            StaticQuery::Param(s) => *s,
            StaticQuery::Made(b) => b.all(),
        }
    }
}

/// A consumer's input `h`, its weights and logits over the sources it read (`[rows, k,
/// heads]`) and, for an input-dependent query, what that query keeps.
pub struct Mixed<A: Act> {
    pub h: Buf<A>,
    pub alpha: Buf<f32>,
    pub logits: Buf<f32>,
    pub input_query: Option<InputQuery<A>>,
}

/// The norm of an input-dependent query's input has no gain: a gain of ones of `d` values, made
/// once a forward pass when `ab` takes input-dependent queries (backward borrows it).
pub fn unit_gain(dev: &Device, ab: &Ablation, d: usize) -> Result<Option<Buf<f32>>> {
    if ab.query != DepthQuery::Input {
        return Ok(None);
    }
    Ok(Some(dev.upload(&vec![1.0f32; d])?))
}

/// Consumer `l`'s input from the sources it reads (`unit`: the gain of ones of an
/// input-dependent query's norm, [`unit_gain`]).
#[allow(clippy::too_many_arguments)]
pub fn forward<A: Act>(
    dev: &Device,
    ab: &Ablation,
    l: usize,
    read: &Read<A>,
    p: &Params<A>,
    unit: Option<&Buf<f32>>,
    eps: f32,
) -> Result<Mixed<A>> {
    let dp = depth_params(p, l);
    let gain = dp.gain.as_ref().map(|g| p.params.slice(g.clone()));
    let (rows, d) = (read.rows, read.d);
    let mixed = |(h, alpha, logits), input_query| Mixed { h, alpha, logits, input_query };
    match ab.query {
        DepthQuery::Static => {
            let w = StaticQuery::of(dev, p, l)?;
            let query = Query::Static(w.slice());
            Ok(mixed(kernels::forward(dev, read, &query, ab.options)?, None))
        }
        DepthQuery::Input => {
            // q = W·rmsnorm(x), x the sum of the sources read; the gain is the key norm's.
            let x = kernels::read_sum(dev, read)?;
            let ones = unit.expect("a gain of ones for the input query's norm");
            let (xhat, rstd) = rmsnorm::forward(dev, &x, ones.all(), d, eps)?;
            drop(x);
            let mut q = dev.output(rows * d)?;
            let g = Gemm::packed(rows, d, d, false, true).typed(A::TYPE, DType::F32);
            let w = p.weights.slice(dp.query.clone());
            assert!(w.len() == d * d && xhat.len() == rows * d);
            // SAFETY: `x̂` is [rows, d], `W` [d, d] and `q` [rows, d] (checked above and made
            // here), which is what the product spans; `q` is new.
            unsafe { gemm(dev, &g, xhat.arg(), w.arg(), q.arg_mut()) }?;
            let query = Query::PerToken { q: q.all(), gain };
            let out = kernels::forward(dev, read, &query, ab.options)?;
            Ok(mixed(out, Some(InputQuery { xhat, rstd, q })))
        }
        DepthQuery::Scalar | DepthQuery::Dense => {
            let query = scalar_query(ab, p, l);
            Ok(mixed(kernels::forward(dev, read, &query, ab.options)?, None))
        }
    }
}

/// Content-free logits: the consumer's learned scalar per source, the partial sum's last.
fn scalar_query<'a, A: Act>(ab: &Ablation, p: &Params<'a, A>, l: usize) -> Query<'a> {
    let logits = p.params.slice(depth_params(p, l).query.clone());
    Query::Scalar { logits, partial_col: ab.depth_sources - 1 }
}

/// Consumer `l`'s depth parameters' gradients in [`ParamGrads`]'s buffers, and where the
/// parameters lie among the model's.
struct Slot {
    query: Range<usize>,
    gain: Option<Range<usize>>,
    /// The parameters' ranges in the model.
    params: DepthParams,
}

/// The gradients of every consumer's depth parameters, summed over a backward pass and added
/// into the model's at its end: queries (or their matrices, or scalars) in one buffer, key-norm
/// gains in another.
pub struct ParamGrads {
    queries: Buf<f32>,
    gains: Option<Buf<f32>>,
    slots: Vec<Slot>,
}

impl ParamGrads {
    /// Zero gradients for the depth parameters of `consumers` consumers.
    pub fn new<A: Act>(dev: &Device, p: &Params<A>, consumers: usize) -> Result<ParamGrads> {
        let (mut slots, mut queries, mut gains) = (Vec::new(), 0, 0);
        for l in 0..consumers {
            let dp = depth_params(p, l).clone();
            let query = queries..queries + dp.query.len();
            let gain = dp.gain.as_ref().map(|g| gains..gains + g.len());
            queries = query.end;
            gains = gain.as_ref().map_or(gains, |g| g.end);
            slots.push(Slot { query, gain, params: dp });
        }
        let gains = if gains > 0 { Some(dev.zeros(gains)?) } else { None };
        Ok(ParamGrads { queries: dev.zeros(queries)?, gains, slots })
    }

    /// Consumer `l`'s query's and gain's gradients.
    fn of(&mut self, l: usize) -> (SliceMut<'_, f32>, Option<SliceMut<'_, f32>>) {
        let s = &self.slots[l];
        let query = self.queries.slice_mut(s.query.clone());
        let gain = match (&mut self.gains, &s.gain) {
            (Some(b), Some(r)) => Some(b.slice_mut(r.clone())),
            _ => None,
        };
        (query, gain)
    }

    /// Adds every consumer's gradients into the model's, `grads` (each as the column sums of
    /// one row: an addition).
    pub fn add_into(&self, dev: &Device, grads: &mut Buf<f32>) -> Result<()> {
        for s in &self.slots {
            let (r, q) = (&s.params.query, self.queries.slice(s.query.clone()));
            add_column_sums(dev, &mut grads.slice_mut(r.clone()), q, r.len())?;
            if let (Some(b), Some(at), Some(r)) = (&self.gains, &s.gain, &s.params.gain) {
                add_column_sums(
                    dev,
                    &mut grads.slice_mut(r.clone()),
                    b.slice(at.clone()),
                    r.len(),
                )?;
            }
        }
        Ok(())
    }
}

/// What consumer `l`'s forward kept.
pub struct Saved<'a, A: Act> {
    pub alpha: &'a Buf<f32>,
    pub logits: &'a Buf<f32>,
    pub input_query: Option<&'a InputQuery<A>>,
}

/// The backward of consumer `l` from `dh`, the gradient of its input: adds into the gradients
/// of the sources it read (`dvalues`, f32, laid out as `read.values`; `dp`, the partial sum's)
/// and of its depth parameters (`unit`: an input-dependent query's norm's gain of ones, and a
/// buffer its gradient goes to and is dropped, made once a backward pass).
#[allow(clippy::too_many_arguments)]
pub fn backward<A: Act>(
    dev: &Device,
    ab: &Ablation,
    l: usize,
    dh: &Buf<A>,
    read: &Read<A>,
    saved: Saved<A>,
    dvalues: &mut Buf<f32>,
    mut dp: Option<&mut Buf<A>>,
    p: &Params<A>,
    grads: &mut ParamGrads,
    unit: Option<(&Buf<f32>, &mut Buf<f32>)>,
) -> Result<()> {
    let (rows, d, o) = (read.rows, read.d, ab.options);
    let dpar = depth_params(p, l);
    let gain = dpar.gain.as_ref().map(|g| p.params.slice(g.clone()));
    let (alpha, logits) = (saved.alpha, saved.logits);
    let (mut dquery, dgain) = grads.of(l);
    match ab.query {
        DepthQuery::Static => {
            let w = StaticQuery::of(dev, p, l)?;
            let query = Query::Static(w.slice());
            let dq = kernels::backward(dev, dvalues, dp, dh, read, alpha, logits, &query, o)?;
            match (dgain, gain) {
                // w = q ⊙ γ: dq = dw ⊙ γ, dγ = dw ⊙ q.
                (Some(mut dgain), Some(gain)) => {
                    let mut dw = dev.zeros(d)?;
                    add_column_sums(dev, &mut dw.all_mut(), dq.all(), d)?;
                    product(dev, &mut dquery, dw.all(), gain, true)?;
                    let q = p.params.slice(dpar.query.clone());
                    product(dev, &mut dgain, dw.all(), q, true)?;
                }
                _ => add_column_sums(dev, &mut dquery, dq.all(), d)?,
            }
        }
        DepthQuery::Input => {
            let iq = saved.input_query.expect("forward kept the input query");
            let query = Query::PerToken { q: iq.q.all(), gain };
            let dp_now = dp.as_deref_mut();
            let dw = kernels::backward(dev, dvalues, dp_now, dh, read, alpha, logits, &query, o)?;
            // w = q ⊙ γ per token, q = W·x̂, x̂ = rmsnorm(x), x the sum of the sources read.
            let (dq, parts) = kernels::query_backward::<A>(dev, &dw, &iq.q, gain, d)?;
            drop(dw);
            if let (Some(mut dgain), Some(parts)) = (dgain, parts) {
                add_column_sums(dev, &mut dgain, parts.all(), d)?;
            }
            let mut dxhat = dev.output(rows * d)?;
            let w = p.weights.slice(dpar.query.clone());
            linear_backward(dev, &mut dxhat, &mut dquery, &dq, &iq.xhat, w, rows, d, d, false)?;
            drop(dq);
            let x = kernels::read_sum(dev, read)?;
            let (ones, dropped) = unit.expect("a gain of ones for the input query's norm");
            let (ones, dropped) = (ones.all(), &mut dropped.all_mut());
            let dx = rmsnorm::backward(dev, dropped, &dxhat, &x, ones, &iq.rstd, d, None)?;
            kernels::read_spread(dev, dvalues, dp, &dx, read)?;
        }
        DepthQuery::Scalar | DepthQuery::Dense => {
            let query = scalar_query(ab, p, l);
            let dq = kernels::backward(dev, dvalues, dp, dh, read, alpha, logits, &query, o)?;
            add_column_sums(dev, &mut dquery, dq.all(), ab.depth_sources)?;
        }
    }
    Ok(())
}
