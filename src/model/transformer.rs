//! The decoder-only transformer (Hugging Face `LlamaForCausalLM` semantics) with a selectable
//! residual connection: forward keeps what backward needs, backward yields every gradient.
//!
//! Longer than most files on purpose: one layer's forward and its backward mirror each other
//! step by step, and are checked against each other by reading them together.

use super::config::Config;
use super::params::{LayerParams, Layout};
use super::residual::{ResidualBackward, ResidualForward};
use crate::base::profile::phase;
use crate::kernels::attention::{self, AttnShape};
use crate::kernels::matmul::{linear, linear_backward};
use crate::kernels::quant::matrix::QuantMatrix;
use crate::kernels::rmsnorm::mean_rms;
use crate::kernels::rope::{self, Positions, RopeTable};
use crate::kernels::{cross_entropy, embedding, rmsnorm, swiglu, zeros};
use anyhow::{ensure, Result};
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::ops::Range;

pub struct Model {
    pub config: Config,
    pub layout: Layout,
    /// Every f32 tensor's values, laid out by `layout`. The ranges of quantised matrices are
    /// left at zero (allocated, never touched, so the pages cost no memory).
    pub params: Vec<f32>,
    /// Matrices kept in block formats, by the start of their range in `layout`
    /// ([`Layout::matrices`]); empty for an f32 model.
    pub quant: BTreeMap<usize, QuantMatrix>,
    pub(crate) rope: RopeTable,
}

/// What the attention sublayer saved: its input, and what it computed from it unless
/// backward is to recompute that (`recompute`).
pub(super) struct AttnSaved {
    h: Vec<f32>,
    inner: Option<AttnInner>,
}

/// The attention sublayer's work on its input up to the output projection: norm statistics,
/// normed input, rotated q/k with v, the attention's softmax statistics and its output.
pub(super) struct AttnInner {
    rstd: Vec<f32>,
    xn: Vec<f32>,
    qkv: Vec<f32>,
    stats: Vec<f32>,
    o: Vec<f32>,
}

/// What the MLP sublayer saved, as [`AttnSaved`].
pub(crate) struct MlpSaved {
    h: Vec<f32>,
    inner: Option<MlpInner>,
}

/// The MLP's work on its input up to the down projection: norm statistics, normed input,
/// gate/up pre-activations and the activation fed to `down_proj`.
pub(crate) struct MlpInner {
    rstd: Vec<f32>,
    xn: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
}

/// A forward pass over `batch` sequences of `seq` tokens, with everything backward needs.
pub struct Forward {
    pub batch: usize,
    pub seq: usize,
    ids: Vec<u32>,
    attn: Vec<AttnSaved>,
    mlp: Vec<MlpSaved>,
    pub residual: ResidualForward,
    h_final: Vec<f32>,
    rstd_final: Vec<f32>,
    xn_final: Vec<f32>,
    /// `[batch·seq, vocab]`.
    pub logits: Vec<f32>,
    /// Probed passes only: mean per-token RMS of each sublayer's raw output.
    output_rms: Option<Vec<f64>>,
}

impl Forward {
    /// The input `h_l` each sublayer read, in sublayer order (`[rows, d]` each).
    pub fn sublayer_inputs(&self) -> Vec<&[f32]> {
        self.attn
            .iter()
            .zip(&self.mlp)
            .flat_map(|(a, m)| [a.h.as_slice(), m.h.as_slice()])
            .collect()
    }

    /// The vector fed to the final norm (`[rows, d]`).
    pub fn final_input(&self) -> &[f32] {
        &self.h_final
    }

    /// Mean over tokens of each sublayer output's RMS, in sublayer order (probed passes only).
    pub fn output_rms(&self) -> Option<&[f64]> {
        self.output_rms.as_deref()
    }
}

impl Model {
    pub fn new(config: Config, params: Vec<f32>) -> Result<Model> {
        config.validate()?;
        let layout = Layout::new(&config);
        ensure!(
            params.len() == layout.total,
            "parameter buffer has {} values, the config needs {}",
            params.len(),
            layout.total
        );
        Ok(Model::assemble(config, layout, params))
    }

    /// A pipeline stage's part of a model: the tensors of `layout` (a [`Layout::part`] of the
    /// config's), whose values `params` holds.
    pub fn part(config: Config, layout: Layout, params: Vec<f32>) -> Result<Model> {
        ensure!(
            params.len() == layout.total,
            "the stage's parameter buffer has {} values, its part of the model {}",
            params.len(),
            layout.total
        );
        Ok(Model::assemble(config, layout, params))
    }

    /// The model of checked parts, with the rotary table its config asks for.
    fn assemble(config: Config, layout: Layout, params: Vec<f32>) -> Model {
        let rope =
            RopeTable::new(config.head_dim, config.max_position_embeddings, config.rope_theta);
        Model { config, layout, params, rope, quant: BTreeMap::new() }
    }

    /// `x · Wᵀ` for the matrix at `range` (`[n, d_in]` → `[n, d_out]`), from its blocks when
    /// the model keeps it quantised.
    pub(crate) fn linear(
        &self,
        x: &[f32],
        range: &Range<usize>,
        n: usize,
        d_in: usize,
        d_out: usize,
    ) -> Vec<f32> {
        match self.quant.get(&range.start) {
            Some(q) => q.matmul(x, n),
            None => linear(x, &self.params[range.clone()], n, d_in, d_out),
        }
    }

    /// The embedding rows of `ids` into `out` (`[ids, d]`).
    pub(crate) fn embed_rows(&self, out: &mut [f32], ids: &[u32]) {
        let d = self.config.hidden_size;
        match self.quant.get(&self.layout.embed.start) {
            Some(q) => out.par_chunks_mut(d).zip(ids.par_iter()).for_each(|(row, &id)| {
                let mut v = Vec::with_capacity(d);
                q.row_into(id as usize, &mut v);
                row.copy_from_slice(&v);
            }),
            None => embedding::forward(out, &self.params[self.layout.embed.clone()], ids, d),
        }
    }

    /// A freshly initialised model (see [`Layout::init`]).
    pub fn init(config: Config, seed: u64) -> Result<Model> {
        config.validate()?;
        let params = Layout::new(&config).init(&config, seed);
        Model::new(config, params)
    }

    pub(super) fn attn_shape(&self, batch: usize, seq: usize) -> AttnShape {
        self.config.attn_shape(batch, seq)
    }

    /// Checks a batch of token ids against the vocabulary and the context length.
    pub fn check_batch(&self, ids: &[u32], batch: usize, seq: usize) -> Result<()> {
        ensure!(batch > 0 && seq > 0, "empty batch");
        ensure!(ids.len() == batch * seq, "batch has {} ids, expected {batch} x {seq}", ids.len());
        ensure!(
            seq <= self.config.max_position_embeddings,
            "sequence length {seq} exceeds max_position_embeddings = {}",
            self.config.max_position_embeddings
        );
        if let Some((i, &t)) =
            ids.iter().enumerate().find(|(_, &t)| t as usize >= self.config.vocab_size)
        {
            anyhow::bail!(
                "token id {t} at position {i} is out of range for vocab_size = {}",
                self.config.vocab_size
            );
        }
        Ok(())
    }

    /// The attention sublayer up to the attention itself: RMSNorm of `h`, the fused q/k/v
    /// projection and the rotary embedding at `positions`. Returns the normed input, its 1/rms
    /// and `qkv`.
    pub(crate) fn attn_project(
        &self,
        lp: &LayerParams,
        h: &[f32],
        positions: Positions,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let c = &self.config;
        let (d, qw) = (c.hidden_size, c.qkv_width());
        let n = h.len() / d;
        let p = &self.params;
        let (xn, rstd) = phase("fwd rmsnorm", || {
            rmsnorm::forward(h, &p[lp.input_norm.clone()], d, c.rms_norm_eps as f32)
        });
        let mut qkv = phase("fwd linear", || self.linear(&xn, &lp.qkv, n, d, qw));
        let heads = c.num_attention_heads + c.num_key_value_heads;
        phase("fwd rope", || rope::apply(&mut qkv, qw, 0, heads, positions, &self.rope, false));
        (xn, rstd, qkv)
    }

    /// The MLP sublayer on its input `h`: what backward needs, and the raw output.
    pub(crate) fn mlp_sublayer(&self, lp: &LayerParams, h: Vec<f32>) -> (MlpSaved, Vec<f32>) {
        let c = &self.config;
        let (d, f) = (c.hidden_size, c.intermediate_size);
        let n = h.len() / d;
        let inner = self.mlp_inner(lp, &h);
        let out = phase("fwd linear", || self.linear(&inner.act, &lp.down, n, f, d));
        (MlpSaved { h, inner: Some(inner) }, out)
    }

    /// The MLP on its input `h` up to the down projection.
    fn mlp_inner(&self, lp: &LayerParams, h: &[f32]) -> MlpInner {
        let c = &self.config;
        let (d, f) = (c.hidden_size, c.intermediate_size);
        let n = h.len() / d;
        let p = &self.params;
        let (xn, rstd) = phase("fwd rmsnorm", || {
            rmsnorm::forward(h, &p[lp.post_norm.clone()], d, c.rms_norm_eps as f32)
        });
        let gu = phase("fwd linear", || self.linear(&xn, &lp.gate_up, n, d, 2 * f));
        let act = phase("fwd swiglu", || swiglu::forward(&gu, f));
        MlpInner { rstd, xn, gu, act }
    }

    /// Final RMSNorm and LM head on `h` (`[rows, d]`): the normed input, its 1/rms, and the
    /// logits `[rows, vocab]`.
    pub(crate) fn head(&self, h: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let c = &self.config;
        let (d, v) = (c.hidden_size, c.vocab_size);
        let n = h.len() / d;
        let p = &self.params;
        let (xn, rstd) = phase("fwd rmsnorm", || {
            rmsnorm::forward(h, &p[self.layout.final_norm.clone()], d, c.rms_norm_eps as f32)
        });
        let logits = phase("fwd head", || self.linear(&xn, &self.layout.head, n, d, v));
        (xn, rstd, logits)
    }

    pub fn forward(&self, ids: &[u32], batch: usize, seq: usize) -> Result<Forward> {
        self.forward_inner(ids, batch, seq, false, false)
    }

    /// [`Self::forward`] that keeps, with `recompute`, only each sublayer's input: backward
    /// then recomputes the sublayer's work from it (activation recomputation; the same bits,
    /// about one more forward pass of the sublayers, and per layer two `[rows, d]` buffers
    /// held instead of everything the sublayers computed).
    pub fn forward_with(
        &self,
        ids: &[u32],
        batch: usize,
        seq: usize,
        recompute: bool,
    ) -> Result<Forward> {
        self.forward_inner(ids, batch, seq, false, recompute)
    }

    /// [`Self::forward`] that also records each sublayer output's RMS
    /// ([`Forward::output_rms`]), for diagnostics. It keeps of each sublayer only its input (as
    /// with recomputation): diagnostics read those, and no backward pass follows.
    pub fn forward_probed(&self, ids: &[u32], batch: usize, seq: usize) -> Result<Forward> {
        self.forward_inner(ids, batch, seq, true, true)
    }

    fn forward_inner(
        &self,
        ids: &[u32],
        batch: usize,
        seq: usize,
        probe: bool,
        recompute: bool,
    ) -> Result<Forward> {
        let d = self.config.hidden_size;
        let p = &self.params;
        let sh = self.attn_shape(batch, seq);
        let mut res = self.embed(ids, batch, seq)?;
        let mut output_rms = probe.then(Vec::new);
        let mut record = |out: &[f32]| {
            if let Some(rms) = output_rms.as_mut() {
                rms.push(mean_rms(out, d));
            }
        };
        let (mut attn, mut mlp) = (Vec::new(), Vec::new());
        for i in 0..self.layout.layers.len() {
            attn.push(self.attn_forward(2 * i, &mut res, sh, recompute, &mut record));
            mlp.push(self.mlp_forward(2 * i + 1, &mut res, recompute, &mut record));
        }
        let h_final = phase("fwd residual", || res.output(p, &self.layout));
        let (xn_final, rstd_final, logits) = self.head(&h_final);
        Ok(Forward {
            batch,
            seq,
            ids: ids.to_vec(),
            attn,
            mlp,
            residual: res,
            h_final,
            rstd_final,
            xn_final,
            logits,
            output_rms,
        })
    }

    /// Attention sublayer `l` on the residual state: its input, the sublayer, its output back
    /// into the state. `record` sees the raw output. With `recompute`, only the input is kept.
    pub(super) fn attn_forward(
        &self,
        l: usize,
        res: &mut ResidualForward,
        sh: AttnShape,
        recompute: bool,
        record: &mut impl FnMut(&[f32]),
    ) -> AttnSaved {
        let (p, lp, d) = (&self.params, &self.layout.layers[l / 2], self.config.hidden_size);
        let (n, ow) = (sh.batch * sh.seq, sh.out_width());
        let h = phase("fwd residual", || res.input(l, p, &self.layout));
        let inner = self.attn_inner(lp, &h, sh);
        let out = phase("fwd linear", || self.linear(&inner.o, &lp.o_proj, n, ow, d));
        record(&out);
        phase("fwd residual", || res.push_output(l, out));
        AttnSaved { h, inner: (!recompute).then_some(inner) }
    }

    /// The attention sublayer on its input `h` up to the output projection.
    fn attn_inner(&self, lp: &LayerParams, h: &[f32], sh: AttnShape) -> AttnInner {
        let (xn, rstd, qkv) = self.attn_project(lp, h, Positions::Packed(sh.seq));
        let (o, stats) = phase("fwd attention", || attention::forward(&qkv, sh));
        AttnInner { rstd, xn, qkv, stats, o }
    }

    /// MLP sublayer `l` on the residual state, as [`Self::attn_forward`].
    pub(super) fn mlp_forward(
        &self,
        l: usize,
        res: &mut ResidualForward,
        recompute: bool,
        record: &mut impl FnMut(&[f32]),
    ) -> MlpSaved {
        let h = phase("fwd residual", || res.input(l, &self.params, &self.layout));
        let (mut saved, out) = self.mlp_sublayer(&self.layout.layers[l / 2], h);
        record(&out);
        phase("fwd residual", || res.push_output(l, out));
        if recompute {
            saved.inner = None;
        }
        saved
    }

    /// Checks targets against the vocabulary.
    pub fn check_targets(&self, targets: &[u32], fwd: &Forward) -> Result<()> {
        ensure!(
            targets.len() == fwd.ids.len(),
            "targets have {} ids, inputs have {}",
            targets.len(),
            fwd.ids.len()
        );
        if let Some((i, &t)) =
            targets.iter().enumerate().find(|(_, &t)| t as usize >= self.config.vocab_size)
        {
            anyhow::bail!(
                "target id {t} at position {i} is out of range for vocab_size = {}",
                self.config.vocab_size
            );
        }
        Ok(())
    }

    /// Mean cross-entropy of the forward pass against `targets`.
    pub fn loss(&self, fwd: &Forward, targets: &[u32]) -> Result<f32> {
        self.check_targets(targets, fwd)?;
        let loss = cross_entropy::loss(&fwd.logits, targets, self.config.vocab_size);
        if !loss.is_finite() {
            self.check_finite(&fwd.logits)?;
        }
        Ok(loss)
    }

    /// An error when `logits` hold a value that is not finite: the forward pass overflowed
    /// f32 (weights or activations too large), which must not pass for a result. It names the
    /// f32 tensor of largest magnitude, the likeliest cause.
    pub fn check_finite(&self, logits: &[f32]) -> Result<()> {
        // A test of every value's exponent bits, without an early exit, vectorises: a decoding
        // step of 64 sequences checks 3 million logits.
        let exponent = 0x7f80_0000;
        if !logits.iter().fold(false, |any, x| any | (x.to_bits() & exponent == exponent)) {
            return Ok(());
        }
        let Some(i) = logits.iter().position(|x| !x.is_finite()) else { return Ok(()) };
        let v = self.config.vocab_size;
        let largest = self
            .layout
            .specs
            .iter()
            .map(|s| (s, self.params[s.range.clone()].iter().fold(0f32, |m, x| m.max(x.abs()))))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let hint = largest.map_or(String::new(), |(s, m)| {
            format!(" (the largest f32 weight: {m:e} in {})", s.name)
        });
        anyhow::bail!(
            "the forward pass overflowed: the logits of token {} hold a non-finite value ({}){hint}",
            i / v,
            logits[i]
        )
    }

    /// Loss and the gradient of every parameter (same layout as `params`).
    pub fn backward(&self, fwd: &Forward, targets: &[u32]) -> Result<(f32, Vec<f32>)> {
        ensure!(
            !self.is_quantized(),
            "the model is quantised: gradients need its f32 weights (start from the f32 original)"
        );
        self.check_targets(targets, fwd)?;
        let lay = &self.layout;
        let sh = self.attn_shape(fwd.batch, fwd.seq);
        let mut g = zeros(lay.total);
        let head = HeadSaved {
            h: &fwd.h_final,
            rstd: &fwd.rstd_final,
            xn: &fwd.xn_final,
            logits: &fwd.logits,
        };
        let (loss, dh, dh_dot_h) = self.head_backward(&head, targets, &mut g);
        let p = &self.params;
        let mut res = phase("bwd residual", || {
            ResidualBackward::new(&fwd.residual, dh, dh_dot_h, p, &mut g, lay)
        });
        let mut scratch = Scratch::new(&self.config, sh);
        for i in (0..lay.layers.len()).rev() {
            let r = &fwd.residual;
            self.mlp_backward(2 * i + 1, &fwd.mlp[i], &mut res, r, &mut scratch, &mut g);
            self.attn_backward(2 * i, &fwd.attn[i], &mut res, r, sh, &mut scratch, &mut g);
        }
        let de = phase("bwd residual", || res.embedding_grad(&fwd.residual, p, &mut g, lay));
        self.embedding_backward(&mut g, &de, &fwd.ids);
        Ok((loss, g))
    }

    /// Loss, LM head and final norm backward: the loss, the gradient of the final norm's input
    /// and, per token, its dot product with that input (see [`ResidualBackward::new`]).
    pub(super) fn head_backward(
        &self,
        s: &HeadSaved,
        targets: &[u32],
        g: &mut [f32],
    ) -> (f32, Vec<f32>, Vec<f32>) {
        let c = &self.config;
        let (d, v) = (c.hidden_size, c.vocab_size);
        let n = s.h.len() / d;
        let (p, lay) = (&self.params, &self.layout);
        let (loss, dlogits) =
            phase("cross-entropy", || cross_entropy::loss_and_grad(s.logits, targets, v));
        let mut dxn = zeros(n * d);
        phase("bwd head", || {
            linear_backward(
                &mut dxn,
                &mut g[lay.head.clone()],
                &dlogits,
                s.xn,
                &p[lay.head.clone()],
                n,
                d,
                v,
                false,
            );
        });
        drop(dlogits);
        // `dh_dot_h` (⟨dh, h⟩ per token) for the depth attention's backward, taken inside each
        // norm's backward.
        let mut dh_dot_h = per_token(c, n);
        let dh = rmsnorm::backward(
            &mut g[lay.final_norm.clone()],
            &dxn,
            s.h,
            &p[lay.final_norm.clone()],
            s.rstd,
            d,
            non_empty(&mut dh_dot_h),
        );
        (loss, dh, dh_dot_h)
    }

    /// Backward of MLP sublayer `l` (what it saved: `s`), from and into the residual gradients.
    pub(super) fn mlp_backward(
        &self,
        l: usize,
        s: &MlpSaved,
        res: &mut ResidualBackward,
        fwd: &ResidualForward,
        sc: &mut Scratch,
        g: &mut [f32],
    ) {
        let c = &self.config;
        let (d, f) = (c.hidden_size, c.intermediate_size);
        let n = s.h.len() / d;
        let (p, lp) = (&self.params, &self.layout.layers[l / 2]);
        let recomputed;
        let s_inner = match &s.inner {
            Some(inner) => inner,
            None => {
                recomputed = self.mlp_inner(lp, &s.h);
                &recomputed
            }
        };
        let dout = phase("bwd residual", || res.output_grad(l, fwd));
        phase("bwd linear", || {
            linear_backward(
                &mut sc.dact,
                &mut g[lp.down.clone()],
                dout,
                &s_inner.act,
                &p[lp.down.clone()],
                n,
                f,
                d,
                false,
            );
        });
        phase("bwd swiglu", || swiglu::backward(&mut sc.dgu, &sc.dact, &s_inner.gu, f));
        phase("bwd linear", || {
            linear_backward(
                &mut sc.dxn,
                &mut g[lp.gate_up.clone()],
                &sc.dgu,
                &s_inner.xn,
                &p[lp.gate_up.clone()],
                n,
                d,
                2 * f,
                false,
            );
        });
        self.norm_backward(l, lp.post_norm.clone(), &s.h, &s_inner.rstd, res, fwd, sc, g);
    }

    /// Backward of attention sublayer `l`, as [`Self::mlp_backward`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attn_backward(
        &self,
        l: usize,
        s: &AttnSaved,
        res: &mut ResidualBackward,
        fwd: &ResidualForward,
        sh: AttnShape,
        sc: &mut Scratch,
        g: &mut [f32],
    ) {
        let c = &self.config;
        let d = c.hidden_size;
        let (n, qw, ow) = (sh.batch * sh.seq, sh.qkv_width(), sh.out_width());
        let (p, lp) = (&self.params, &self.layout.layers[l / 2]);
        let recomputed;
        let s_inner = match &s.inner {
            Some(inner) => inner,
            None => {
                recomputed = self.attn_inner(lp, &s.h, sh);
                &recomputed
            }
        };
        let dout = phase("bwd residual", || res.output_grad(l, fwd));
        phase("bwd linear", || {
            linear_backward(
                &mut sc.do_,
                &mut g[lp.o_proj.clone()],
                dout,
                &s_inner.o,
                &p[lp.o_proj.clone()],
                n,
                ow,
                d,
                false,
            );
        });
        phase("bwd attention", || {
            attention::backward(&mut sc.dqkv, &sc.do_, &s_inner.qkv, &s_inner.stats, sh)
        });
        phase("bwd rope", || {
            rope::apply(
                &mut sc.dqkv,
                qw,
                0,
                sh.heads + sh.kv_heads,
                Positions::Packed(sh.seq),
                &self.rope,
                true,
            )
        });
        phase("bwd linear", || {
            linear_backward(
                &mut sc.dxn,
                &mut g[lp.qkv.clone()],
                &sc.dqkv,
                &s_inner.xn,
                &p[lp.qkv.clone()],
                n,
                d,
                qw,
                false,
            );
        });
        self.norm_backward(l, lp.input_norm.clone(), &s.h, &s_inner.rstd, res, fwd, sc, g);
    }
}

impl Model {
    /// The input norm of sublayer `l` (its gain `norm`, input `h`, 1/rms `rstd`) backward from
    /// the gradient in `sc.dxn`, into the residual gradients.
    #[allow(clippy::too_many_arguments)]
    fn norm_backward(
        &self,
        l: usize,
        norm: std::ops::Range<usize>,
        h: &[f32],
        rstd: &[f32],
        res: &mut ResidualBackward,
        fwd: &ResidualForward,
        sc: &mut Scratch,
        g: &mut [f32],
    ) {
        let (c, p, lay) = (&self.config, &self.params, &self.layout);
        let (d, n) = (c.hidden_size, rstd.len());
        let mut dh_dot_h = per_token(c, n);
        let dh = phase("bwd rmsnorm", || {
            rmsnorm::backward(
                &mut g[norm.clone()],
                &sc.dxn,
                h,
                &p[norm],
                rstd,
                d,
                non_empty(&mut dh_dot_h),
            )
        });
        phase("bwd residual", || res.input_grad(l, dh, dh_dot_h, fwd, p, g, lay));
    }
}

/// What the LM head's backward reads of the forward pass.
pub(super) struct HeadSaved<'a> {
    pub h: &'a [f32],
    pub rstd: &'a [f32],
    pub xn: &'a [f32],
    pub logits: &'a [f32],
}

/// Scratch buffers of the sublayers' backward, reused across sublayers.
pub(super) struct Scratch {
    dxn: Vec<f32>,
    dact: Vec<f32>,
    dgu: Vec<f32>,
    do_: Vec<f32>,
    dqkv: Vec<f32>,
}

impl Scratch {
    pub(super) fn new(c: &Config, sh: AttnShape) -> Scratch {
        let (n, f) = (sh.batch * sh.seq, c.intermediate_size);
        Scratch {
            dxn: zeros(n * c.hidden_size),
            dact: zeros(n * f),
            dgu: zeros(n * 2 * f),
            do_: zeros(n * sh.out_width()),
            dqkv: zeros(n * sh.qkv_width()),
        }
    }
}

/// A buffer for ⟨dh, h⟩ per token where the depth attention needs it (else empty).
pub(super) fn per_token(c: &Config, n: usize) -> Vec<f32> {
    if c.block_size().is_some() {
        zeros(n)
    } else {
        Vec::new()
    }
}

/// `Some(v)` unless `v` is empty.
fn non_empty(v: &mut [f32]) -> Option<&mut [f32]> {
    (!v.is_empty()).then_some(v)
}
