//! One optimiser step: forward and backward over each micro-batch, the mean gradient, clipping
//! and the update, with the checks that stop a diverging run and say what to change. The
//! training loop ([`super::run`]) and the ranks of a parallel job ([`super::parallel`]) both
//! take their steps through these.

use super::optim::{global_norm, tensor_squares, OptimConfig, Optimizer};
use super::tokens::{Tokens, WindowOrder};
use crate::kernels;
use crate::model::params::Layout as ParamLayout;
use crate::model::Model;
use anyhow::{bail, ensure, Result};

/// What one optimiser step produced.
pub struct StepOutcome {
    /// The learning rate of the step.
    pub lr: f64,
    /// The mean loss over the step's micro-batches.
    pub train_loss: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// The gradient norm of each sublayer's own weights, before clipping.
    pub sublayer_grad_norms: Vec<f64>,
    /// Under pipeline parallelism: bytes all ranks sent in pipeline transfers.
    pub pipeline_bytes: Option<u64>,
}

/// How each micro-batch of a step goes through the model: `rows` sequences of token ids, and
/// with `recompute`, backward recomputes each sublayer's work from its input instead of keeping
/// it from forward ([`Model::forward_with`]; `TrainConfig::recompute`).
#[derive(Clone, Copy, Debug)]
pub struct Pass {
    pub rows: usize,
    pub recompute: bool,
}

impl Pass {
    /// `rows` sequences per micro-batch, everything kept from forward.
    pub fn rows(rows: usize) -> Pass {
        Pass { rows, recompute: false }
    }
}

/// One optimiser step as training takes it: forward and backward over each micro-batch (as
/// `pass` says, with their targets), the mean gradient, clipping, then the update at learning
/// rate `lr`. `step` (from 0) names the step in the error for a non-finite loss.
pub fn optimizer_step(
    model: &mut Model,
    opt: &mut Optimizer,
    micro_batches: &[(Vec<u32>, Vec<u32>)],
    pass: Pass,
    lr: f64,
    step: usize,
) -> Result<StepOutcome> {
    ensure!(!micro_batches.is_empty(), "a step needs at least one micro-batch");
    let mut grads = kernels::zeros(model.params.len());
    let losses = backward_each(model, &opt.config, micro_batches, pass, step, |g| {
        kernels::add_assign(&mut grads, &g)
    })?;
    apply_gradients(model, opt, grads, &losses, lr, step, &whole_norms)
}

/// Each tensor's sum of squared gradients and each sublayer's gradient norm, of the whole
/// model, from the gradients `grads` of the tensors of `layout`: in one process these are all
/// of them; a pipeline stage gathers the other stages' ([`Group`]).
pub(crate) type Norms<'a> = &'a dyn Fn(&ParamLayout, &[f32]) -> (Vec<f64>, Vec<f64>);

/// [`Norms`] of one process, which holds every tensor.
pub(crate) fn whole_norms(layout: &ParamLayout, grads: &[f32]) -> (Vec<f64>, Vec<f64>) {
    (tensor_squares(layout, grads), crate::model::diagnostics::sublayer_grad_norms(layout, grads))
}

/// Forward and backward over each micro-batch in order: hands each gradient to `take` and
/// returns the losses; a non-finite loss is an error naming step `step` (from 0).
pub(crate) fn backward_each(
    model: &Model,
    o: &OptimConfig,
    micro_batches: &[(Vec<u32>, Vec<u32>)],
    pass: Pass,
    step: usize,
    mut take: impl FnMut(Vec<f32>),
) -> Result<Vec<f32>> {
    let mut losses = Vec::with_capacity(micro_batches.len());
    for (ids, targets) in micro_batches {
        let rows = pass.rows;
        let fwd = model.forward_with(ids, rows, ids.len() / rows, pass.recompute)?;
        let (loss, g) = model.backward(&fwd, targets)?;
        check_loss(loss, o, step)?;
        losses.push(loss);
        take(g);
    }
    Ok(losses)
}

/// Refuses a non-finite loss of step `step` (from 0).
pub(crate) fn check_loss(loss: f32, o: &OptimConfig, step: usize) -> Result<()> {
    // Steps are numbered from 1 in errors, as in metrics.jsonl.
    ensure!(
        loss.is_finite(),
        "the training loss became {loss} at step {}; {}",
        step + 1,
        non_finite_advice(o, step, false)
    );
    Ok(())
}

/// The rest of a step once `grads` holds the sum of the gradients of the step's micro-batches
/// (`losses`: theirs, in order): the mean, clipping (by the whole model's norm, from
/// `norms`), the update.
pub(crate) fn apply_gradients(
    model: &mut Model,
    opt: &mut Optimizer,
    mut grads: Vec<f32>,
    losses: &[f32],
    lr: f64,
    step: usize,
    norms: Norms,
) -> Result<StepOutcome> {
    let loss_sum: f64 = losses.iter().fold(0.0, |s, &l| s + l as f64);
    let n = step + 1;
    let accum = losses.len();
    if accum > 1 {
        let s = 1.0 / accum as f32;
        grads.iter_mut().for_each(|g| *g *= s);
    }
    let (squares, sublayer_grad_norms) = norms(&model.layout, &grads);
    let grad_norm = global_norm(&squares);
    opt.clip(&mut grads, grad_norm);
    if !grad_norm.is_finite() {
        bail!(
            "the gradient norm became {grad_norm} at step {n} (first in {}); {}",
            first_non_finite(&model.layout, &grads).unwrap_or("another pipeline stage's tensors"),
            non_finite_advice(&opt.config, step, false)
        );
    }
    opt.update(&mut model.params, &grads, lr);
    if let Some(name) = first_non_finite(&model.layout, &model.params) {
        bail!(
            "the weights became non-finite in the update of step {n} (first in {name}); {}",
            non_finite_advice(&opt.config, step, true)
        );
    }
    Ok(StepOutcome {
        lr,
        train_loss: loss_sum / accum as f64,
        grad_norm,
        sublayer_grad_norms,
        pipeline_bytes: None,
    })
}

/// The name of the first tensor of `layout` holding a non-finite value of `values`.
pub(crate) fn first_non_finite<'a>(
    layout: &'a crate::model::params::Layout,
    values: &[f32],
) -> Option<&'a str> {
    layout
        .specs
        .iter()
        .find(|s| values[s.range.clone()].iter().any(|x| !x.is_finite()))
        .map(|s| s.name.as_str())
}

/// What to change when a value of step `step` (from 0) became non-finite; `updated`: it
/// appeared in the update itself rather than in the forward or backward pass.
pub(crate) fn non_finite_advice(o: &OptimConfig, step: usize, updated: bool) -> String {
    if step == 0 && !updated {
        // No update has happened yet: the settings of the model itself overflow.
        "the untrained model already overflows: check the model settings (rope_theta, initializer_range, rms_norm_eps, hidden_size)".to_string()
    } else if o.adam_eps == 0.0 {
        "adam_eps = 0 divides by zero wherever a gradient is zero: set adam_eps > 0 (e.g. 1e-8)"
            .to_string()
    } else {
        format!(
            "training diverged: lower lr (now {}){}",
            o.lr,
            if o.grad_clip == 0.0 { " or enable grad_clip" } else { "" }
        )
    }
}

/// The `micro_batch` training windows from position `first` of the data order: inputs and
/// their next-token targets.
pub(crate) fn micro_batch(
    tokens: &Tokens,
    order: &mut WindowOrder,
    first: u64,
    micro_batch: usize,
) -> (Vec<u32>, Vec<u32>) {
    let seq = order.seq;
    let (mut ids, mut targets) =
        (Vec::with_capacity(micro_batch * seq), Vec::with_capacity(micro_batch * seq));
    for w in 0..micro_batch as u64 {
        let s = order.start(first + w);
        let w = tokens.train(s..s + seq + 1);
        ids.extend_from_slice(&w[..seq]);
        targets.extend_from_slice(&w[1..]);
    }
    (ids, targets)
}
