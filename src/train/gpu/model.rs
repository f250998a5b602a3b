//! The engine's transformer on the GPU: the same config, parameter layout and numbers as
//! `crate::model::Model` (the oracle), forward keeping what backward needs and backward adding
//! every parameter's gradient into one buffer laid out as the parameters are. fp32 throughout.
//!
//! The standard residual, Full and Block AttnRes with or without the depth attention's ablation
//! options (the residual connection is [`super::residual`] and [`super::ablation`]).

use super::params::Params;
use super::residual::{NormedInput, ResidualBackward, ResidualForward};
use crate::gpu::act::Act;
use crate::gpu::attention;
use crate::gpu::buffer::Buf;
use crate::gpu::cross_entropy;
use crate::gpu::device::{Device, Ids};
use crate::gpu::elementwise::{embedding_backward, embedding_forward};
use crate::gpu::elementwise::{swiglu_backward, swiglu_forward};
use crate::gpu::gemm::{linear, linear_backward};
use crate::gpu::optim::Weights;
use crate::gpu::rope::{self, RopeTables};
use crate::kernels::attention::AttnShape;
use crate::model::params::{LayerParams, Layout};
use crate::model::{Config, Model};
use anyhow::{ensure, Result};

/// A model's parameters on the GPU, with what its forward pass needs beside them.
pub struct GpuModel<A: Act = f32> {
    pub config: Config,
    pub layout: Layout,
    /// Every tensor, laid out as `Model::params`.
    pub params: Buf<f32>,
    /// The weights the matrix products take, where they are not `params` themselves: their
    /// bf16 copy ([`Act::refresh`]), which each update writes beside the master weights
    /// ([`Self::weights_mut`]).
    weights: Option<Buf<A>>,
    rope: RopeTables,
    /// Forward keeps only each sublayer's input, and backward recomputes the sublayer's work
    /// from it (the training setting `recompute`): the same gradients for less memory.
    pub recompute: bool,
}

/// What the attention sublayer keeps for backward: its input with the norm's 1/rms and output
/// and, unless backward recomputes it, its work.
struct AttnSaved<A: Act> {
    x: NormedInput<A>,
    work: Option<AttnWork<A>>,
}

/// The attention's work: the rotated q/k with v, the attention's output and softmax statistics.
struct AttnWork<A: Act> {
    qkv: Buf<A>,
    o: Buf<A>,
    stats: Buf<f32>,
}

/// What the MLP keeps, as the attention: its input and, unless recomputed, its work.
struct MlpSaved<A: Act> {
    x: NormedInput<A>,
    work: Option<MlpWork<A>>,
}

/// The MLP's work: gate/up and the activation.
struct MlpWork<A: Act> {
    gu: Buf<A>,
    act: Buf<A>,
}

/// A forward pass over `batch` sequences of `seq` tokens.
pub struct GpuForward<A: Act = f32> {
    pub batch: usize,
    pub seq: usize,
    ids: Ids,
    /// Each row's position in its sequence, for the rotary embedding both ways.
    positions: Ids,
    attn: Vec<AttnSaved<A>>,
    mlp: Vec<MlpSaved<A>>,
    residual: ResidualForward<A>,
    /// The final norm's input and output.
    last: NormedInput<A>,
    /// `[batch·seq, vocab]`.
    pub logits: Buf<A>,
}

impl<A: Act> GpuModel<A> {
    /// `model`'s parameters on `dev`; an error for what the GPU does not run yet.
    pub fn upload(dev: &Device, model: &Model) -> Result<GpuModel<A>> {
        let c = &model.config;
        ensure!(
            !model.is_quantized(),
            "the model is quantised: the GPU trains and evaluates f32 models"
        );
        ensure!(model.layout.total == model.params.len(), "a pipeline stage's part of a model");
        let mut gm = GpuModel {
            config: c.clone(),
            layout: model.layout.clone(),
            params: dev.upload(&model.params)?,
            weights: None,
            rope: RopeTables::upload(dev, &model.rope)?,
            recompute: false,
        };
        gm.refresh_weights(dev)?;
        Ok(gm)
    }

    /// Makes the weights the matrix products take agree with `params`.
    fn refresh_weights(&mut self, dev: &Device) -> Result<()> {
        A::refresh(dev, &mut self.weights, &self.params)
    }

    /// The weights as an update writes them: the master weights and their bf16 copy, which
    /// the update keeps in step.
    pub fn weights_mut(&mut self) -> Weights<'_> {
        Weights { master: &mut self.params, copy: A::bf16_copy(&mut self.weights) }
    }

    /// The weights the matrix products take.
    fn weights(&self) -> &Buf<A> {
        A::weights(&self.params, &self.weights)
    }

    /// The parameters as the residual connection reads them.
    fn view(&self) -> Params<'_, A> {
        Params { params: &self.params, weights: self.weights(), layout: &self.layout }
    }

    /// The parameters back on the host, laid out as `Model::params`.
    pub fn download_params(&self, dev: &Device) -> Result<Vec<f32>> {
        dev.download(&self.params)
    }

    fn shape(&self, batch: usize, seq: usize) -> AttnShape {
        self.config.attn_shape(batch, seq)
    }

    /// Forward over `batch` sequences of `seq` tokens (`ids`, checked as `Model::forward`
    /// checks them).
    pub fn forward(
        &self,
        dev: &Device,
        ids: &[u32],
        batch: usize,
        seq: usize,
    ) -> Result<GpuForward<A>> {
        let c = &self.config;
        ensure!(batch > 0 && seq > 0, "empty batch");
        ensure!(ids.len() == batch * seq, "batch has {} ids, expected {batch} x {seq}", ids.len());
        ensure!(
            seq <= c.max_position_embeddings,
            "sequence length {seq} exceeds max_position_embeddings = {}",
            c.max_position_embeddings
        );
        let (d, p, w, lay) = (c.hidden_size, &self.params, self.weights(), &self.layout);
        let ids = Ids::upload(dev, ids, c.vocab_size)?;
        let positions: Vec<u32> = (0..(batch * seq) as u32).map(|r| r % seq as u32).collect();
        let positions = self.rope.positions(dev, &positions)?;
        let sh = self.shape(batch, seq);
        let e = embedding_forward(dev, p.slice(lay.embed.clone()), &ids, d)?;
        let gain = |l: usize| p.slice(norm_of(lay, l));
        let pv = self.view();
        let (mut res, mut x) = ResidualForward::new(dev, c, &pv, e, gain(0))?;
        let (mut attn, mut mlp) = (Vec::new(), Vec::new());
        for (i, lp) in lay.layers.iter().enumerate() {
            let l = 2 * i;
            let (saved, out) = self.attn_forward(dev, lp, x, &positions, sh)?;
            x = res.next(dev, l, &saved.x.h, out, gain(l + 1), &pv)?;
            attn.push(saved);
            let (saved, out) = self.mlp_forward(dev, lp, x)?;
            x = res.next(dev, l + 1, &saved.x.h, out, gain(l + 2), &pv)?;
            mlp.push(saved);
        }
        let logits = linear(dev, &x.xn, w.slice(lay.head.clone()), batch * seq, d, c.vocab_size)?;
        Ok(GpuForward { batch, seq, ids, positions, attn, mlp, residual: res, last: x, logits })
    }

    /// The attention sublayer on its normalised input `x`: what it keeps, and its output.
    fn attn_forward(
        &self,
        dev: &Device,
        lp: &LayerParams,
        x: NormedInput<A>,
        positions: &Ids,
        sh: AttnShape,
    ) -> Result<(AttnSaved<A>, Buf<A>)> {
        let (d, w, n) = (self.config.hidden_size, self.weights(), positions.len());
        let work = self.attn_work(dev, lp, &x, positions, sh)?;
        let out = linear(dev, &work.o, w.slice(lp.o_proj.clone()), n, sh.out_width(), d)?;
        Ok((AttnSaved { x, work: (!self.recompute).then_some(work) }, out))
    }

    /// The attention's work on its normalised input `x`, up to its output projection.
    fn attn_work(
        &self,
        dev: &Device,
        lp: &LayerParams,
        x: &NormedInput<A>,
        positions: &Ids,
        sh: AttnShape,
    ) -> Result<AttnWork<A>> {
        let (d, w, n) = (self.config.hidden_size, self.weights(), positions.len());
        let qw = sh.qkv_width();
        let mut qkv = linear(dev, &x.xn, w.slice(lp.qkv.clone()), n, d, qw)?;
        let heads = sh.heads + sh.kv_heads;
        rope::apply(dev, &mut qkv, qw, 0, heads, positions, &self.rope, false)?;
        let (o, stats) = attention::forward(dev, &qkv, sh)?;
        Ok(AttnWork { qkv, o, stats })
    }

    /// The MLP sublayer on its normalised input `x`: what it keeps, and its output.
    fn mlp_forward(
        &self,
        dev: &Device,
        lp: &LayerParams,
        x: NormedInput<A>,
    ) -> Result<(MlpSaved<A>, Buf<A>)> {
        let c = &self.config;
        let (d, f, w) = (c.hidden_size, c.intermediate_size, self.weights());
        let n = x.h.len() / d;
        let work = self.mlp_work(dev, lp, &x)?;
        let out = linear(dev, &work.act, w.slice(lp.down.clone()), n, f, d)?;
        Ok((MlpSaved { x, work: (!self.recompute).then_some(work) }, out))
    }

    /// The MLP's work on its normalised input `x`, up to its down projection.
    fn mlp_work(&self, dev: &Device, lp: &LayerParams, x: &NormedInput<A>) -> Result<MlpWork<A>> {
        let c = &self.config;
        let (d, f, w) = (c.hidden_size, c.intermediate_size, self.weights());
        let n = x.h.len() / d;
        let gu = linear(dev, &x.xn, w.slice(lp.gate_up.clone()), n, d, 2 * f)?;
        let act = swiglu_forward(dev, &gu, f)?;
        Ok(MlpWork { gu, act })
    }

    /// The mean loss of `fwd` against `targets`, without gradients.
    pub fn loss(&self, dev: &Device, fwd: &GpuForward<A>, targets: &[u32]) -> Result<f32> {
        let c = &self.config;
        let targets = self.targets(dev, fwd, targets)?;
        cross_entropy::loss(dev, &fwd.logits, &targets, c.vocab_size)
    }

    /// The mean loss of `rows` sequences of `seq` tokens against their targets, without
    /// gradients: validation and evaluation on the device.
    pub fn window_loss(
        &self,
        dev: &Device,
        ids: &[u32],
        targets: &[u32],
        rows: usize,
        seq: usize,
    ) -> Result<f32> {
        let fwd = self.forward(dev, ids, rows, seq)?;
        self.loss(dev, &fwd, targets)
    }

    fn targets(&self, dev: &Device, fwd: &GpuForward<A>, targets: &[u32]) -> Result<Ids> {
        ensure!(
            targets.len() == fwd.ids.len(),
            "targets have {} ids, inputs have {}",
            targets.len(),
            fwd.ids.len()
        );
        Ids::upload(dev, targets, self.config.vocab_size)
    }

    /// The mean loss of `fwd` against `targets`, and every parameter's gradient added into
    /// `grads` (laid out as the parameters). Each layer's saved activations are freed once its
    /// backward has run, so the device holds the most at backward's start.
    pub fn backward(
        &self,
        dev: &Device,
        fwd: GpuForward<A>,
        targets: &[u32],
        grads: &mut Buf<f32>,
    ) -> Result<f32> {
        let c = &self.config;
        let (d, v, p, lay) = (c.hidden_size, c.vocab_size, &self.params, &self.layout);
        let weights = self.weights();
        assert_eq!(grads.len(), p.len());
        let n = fwd.batch * fwd.seq;
        let targets = self.targets(dev, &fwd, targets)?;
        let (loss, dlogits) = cross_entropy::loss_and_grad(dev, fwd.logits, &targets, v)?;
        let mut dxn = dev.output(n * d)?;
        let head = lay.head.clone();
        let (dw, w) = (&mut grads.slice_mut(head.clone()), weights.slice(head));
        linear_backward(dev, &mut dxn, dw, &dlogits, &fwd.last.xn, w, n, d, v, false)?;
        drop(dlogits);
        let res = &fwd.residual;
        let norm = norm_of(lay, lay.layers.len() * 2);
        let (g, dg) = (p.slice(norm.clone()), &mut grads.slice_mut(norm));
        let pv = self.view();
        let mut back = ResidualBackward::new(dev, res, &dxn, &fwd.last, g, dg, &pv)?;
        let sh = self.shape(fwd.batch, fwd.seq);
        let (mut attn, mut mlp) = (fwd.attn, fwd.mlp);
        for (i, lp) in lay.layers.iter().enumerate().rev() {
            let (l, s) = (2 * i + 1, mlp.pop().expect("a layer's MLP"));
            let dout = back.output_grad(dev, l, res)?;
            let dxn = self.mlp_backward(dev, lp, &s, dout, grads)?;
            let (norm, x) = (norm_of(lay, l), &s.x);
            let (g, dg) = (p.slice(norm.clone()), &mut grads.slice_mut(norm));
            back.input_grad(dev, l, &dxn, x, g, dg, res, &pv)?;
            drop(s);
            let (l, s, pos) = (2 * i, attn.pop().expect("a layer's attention"), &fwd.positions);
            let dout = back.output_grad(dev, l, res)?;
            let dxn = self.attn_backward(dev, lp, &s, dout, pos, sh, grads)?;
            let (norm, x) = (norm_of(lay, l), &s.x);
            let (g, dg) = (p.slice(norm.clone()), &mut grads.slice_mut(norm));
            back.input_grad(dev, l, &dxn, x, g, dg, res, &pv)?;
        }
        let de = back.embedding_grad(dev, res, p, grads, lay)?;
        embedding_backward(dev, &mut grads.slice_mut(lay.embed.clone()), &de, &fwd.ids, d)?;
        Ok(loss)
    }

    /// The MLP's backward from its output gradient `dout`: the gradient of its normalised
    /// input.
    fn mlp_backward(
        &self,
        dev: &Device,
        lp: &LayerParams,
        s: &MlpSaved<A>,
        dout: &Buf<A>,
        grads: &mut Buf<f32>,
    ) -> Result<Buf<A>> {
        let c = &self.config;
        let (d, f) = (c.hidden_size, c.intermediate_size);
        let weights = self.weights();
        let n = s.x.h.len() / d;
        let recomputed;
        let work = match &s.work {
            Some(kept) => kept,
            None => {
                recomputed = self.mlp_work(dev, lp, &s.x)?;
                &recomputed
            }
        };
        let mut dact = dev.output(n * f)?;
        let (dw, w) = (&mut grads.slice_mut(lp.down.clone()), weights.slice(lp.down.clone()));
        linear_backward(dev, &mut dact, dw, dout, &work.act, w, n, f, d, false)?;
        let dgu = swiglu_backward(dev, &dact, &work.gu, f)?;
        drop(dact);
        let mut dxn = dev.output(n * d)?;
        let (dw, w) = (&mut grads.slice_mut(lp.gate_up.clone()), weights.slice(lp.gate_up.clone()));
        linear_backward(dev, &mut dxn, dw, &dgu, &s.x.xn, w, n, d, 2 * f, false)?;
        Ok(dxn)
    }

    /// The attention sublayer's backward from its output gradient `dout`, as
    /// [`Self::mlp_backward`].
    #[allow(clippy::too_many_arguments)]
    fn attn_backward(
        &self,
        dev: &Device,
        lp: &LayerParams,
        s: &AttnSaved<A>,
        dout: &Buf<A>,
        positions: &Ids,
        sh: AttnShape,
        grads: &mut Buf<f32>,
    ) -> Result<Buf<A>> {
        let (d, n) = (self.config.hidden_size, positions.len());
        let weights = self.weights();
        let (qw, ow) = (sh.qkv_width(), sh.out_width());
        let recomputed;
        let work = match &s.work {
            Some(kept) => kept,
            None => {
                recomputed = self.attn_work(dev, lp, &s.x, positions, sh)?;
                &recomputed
            }
        };
        let mut do_ = dev.output(n * ow)?;
        let (dw, w) = (&mut grads.slice_mut(lp.o_proj.clone()), weights.slice(lp.o_proj.clone()));
        linear_backward(dev, &mut do_, dw, dout, &work.o, w, n, ow, d, false)?;
        let mut dqkv = attention::backward(dev, &do_, &work.qkv, &work.o, &work.stats, sh)?;
        drop(do_);
        let heads = sh.heads + sh.kv_heads;
        rope::apply(dev, &mut dqkv, qw, 0, heads, positions, &self.rope, true)?;
        let mut dxn = dev.output(n * d)?;
        let (dw, w) = (&mut grads.slice_mut(lp.qkv.clone()), weights.slice(lp.qkv.clone()));
        linear_backward(dev, &mut dxn, dw, &dqkv, &s.x.xn, w, n, d, qw, false)?;
        Ok(dxn)
    }
}

/// Where consumer `l`'s norm gain lies among the parameters: each sublayer's norm (attention,
/// then MLP, layer by layer), then the final norm's at `L`.
fn norm_of(lay: &Layout, l: usize) -> std::ops::Range<usize> {
    match lay.layers.get(l / 2) {
        Some(lp) if l.is_multiple_of(2) => lp.input_norm.clone(),
        Some(lp) => lp.post_norm.clone(),
        None => lay.final_norm.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::buffer::Bf16;
    use crate::model::config::{DepthGate, DepthQuery};
    use crate::model::ResidualKind;
    use crate::testutil::{assert_close_to_largest, rand_vec};

    /// A small model whose shapes cross the kernels' tiles (grouped heads, a sequence longer
    /// than one attention block, untied head), with residual `residual`.
    fn small(tied: bool, residual: ResidualKind, layers: usize, blocks: usize) -> Model {
        let c = Config {
            vocab_size: 97,
            hidden_size: 64,
            intermediate_size: 96,
            num_hidden_layers: layers,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            max_position_embeddings: 128,
            tie_word_embeddings: tied,
            residual,
            num_blocks: blocks,
            ..Config::default()
        };
        Model::init(c, 5).unwrap()
    }

    /// The models the training-pass tests run: the standard residual tied and untied; Block
    /// AttnRes with blocks of 2 sublayers and with blocks of 4 over 6 sublayers (the last one
    /// shorter: `attn_res_block_size`); Full AttnRes; and the ablation options, each of them
    /// in some model: two heads with a sigmoid gate and no key norm, input-dependent queries
    /// over a window of two, scalar logits, and dense mixing over a window of one after a
    /// shorter last block. The depth queries start at zero (dense weights at one), so they
    /// and the key-norm gains are set to random values, as training makes them (queries of
    /// 0.2 per value: logits of order one).
    fn models() -> Vec<(&'static str, Model)> {
        let mut models = vec![
            ("standard, tied", small(true, ResidualKind::Standard, 2, 1)),
            ("standard, untied", small(false, ResidualKind::Standard, 2, 1)),
            ("block of 2", small(false, ResidualKind::Block, 2, 2)),
            ("full", small(true, ResidualKind::Full, 2, 1)),
        ];
        let mut shorter = small(false, ResidualKind::Block, 3, 2);
        shorter.config.attn_res_block_size = Some(2);
        models.push(("blocks of 4 over 6", Model::init(shorter.config.clone(), 5).unwrap()));
        let ablation = |name, mut c: Config, f: &dyn Fn(&mut Config)| {
            f(&mut c);
            (name, Model::init(c, 5).unwrap())
        };
        let block = small(false, ResidualKind::Block, 2, 2).config;
        let full = small(true, ResidualKind::Full, 3, 1).config;
        models.extend([
            ablation("block of 2, two heads, sigmoid, no key norm", block.clone(), &|c| {
                c.attn_res_heads = 2;
                c.attn_res_gate = DepthGate::Sigmoid;
                c.attn_res_key_norm = false;
            }),
            ablation("full, input queries, window of 2", full, &|c| {
                c.attn_res_query = DepthQuery::Input;
                c.attn_res_window = 2;
            }),
            ablation("block of 2, scalar logits", block, &|c| {
                c.attn_res_query = DepthQuery::Scalar
            }),
            ablation("blocks of 4 over 6, dense, window of 1", shorter.config, &|c| {
                c.attn_res_query = DepthQuery::Dense;
                c.attn_res_window = 1;
            }),
        ]);
        for (_, model) in &mut models {
            let (dense, d) =
                (model.config.attn_res_query == DepthQuery::Dense, model.config.hidden_size);
            // An input-dependent query's matrix makes each query value a sum of d products.
            let scale = if model.config.attn_res_query == DepthQuery::Input {
                0.2 / (d as f32).sqrt()
            } else {
                0.2
            };
            let depth = (0..=model.config.sublayers()).filter_map(|l| model.layout.depth_params(l));
            for p in depth.cloned().collect::<Vec<_>>() {
                let q = rand_vec(p.query.len(), p.query.start as u64, scale);
                let q = q.iter().map(|x| if dense { 1.0 + x } else { *x });
                model.params[p.query].iter_mut().zip(q).for_each(|(x, q)| *x = q);
                if let Some(g) = p.gain {
                    let noise = rand_vec(g.len(), g.start as u64, 0.3);
                    model.params[g].iter_mut().zip(noise).for_each(|(x, n)| *x += n);
                }
            }
        }
        models
    }

    /// A batch of `model`: the CPU's logits, loss and gradients, and the GPU's at type `A`.
    struct Pass {
        want_logits: Vec<f32>,
        want_loss: f32,
        want: Vec<f32>,
        logits: Vec<f32>,
        loss: f32,
        grads: Vec<f32>,
    }

    fn pass<A: Act>(dev: &Device, model: &Model) -> Pass {
        let (batch, seq) = (2, 70);
        let ids: Vec<u32> = (0..batch * seq).map(|i| (i * 31 % 97) as u32).collect();
        let targets: Vec<u32> = (0..batch * seq).map(|i| ((i * 17 + 5) % 97) as u32).collect();
        let fwd = model.forward(&ids, batch, seq).unwrap();
        let (want_loss, want) = model.backward(&fwd, &targets).unwrap();
        let gm = GpuModel::<A>::upload(dev, model).unwrap();
        let gf = gm.forward(dev, &ids, batch, seq).unwrap();
        let logits: Vec<f32> =
            dev.download(&gf.logits).unwrap().iter().map(|x| x.to_f32()).collect();
        let mut grads = dev.zeros(model.params.len()).unwrap();
        let without_grads = gm.loss(dev, &gf, &targets).unwrap();
        let loss = gm.backward(dev, gf, &targets, &mut grads).unwrap();
        assert_eq!(without_grads, loss, "the loss without gradients");
        let grads = dev.download(&grads).unwrap();
        Pass { want_logits: fwd.logits, want_loss, want, logits, loss, grads }
    }

    /// The loss and every tensor's gradient of one batch in fp32, against the CPU engine.
    fn a_training_pass_matches_the_cpu_engine(dev: &Device) {
        for (name, model) in models() {
            let p = pass::<f32>(dev, &model);
            assert_close_to_largest(&p.logits, &p.want_logits, 1e-5, &format!("{name}: logits"));
            let (loss, want) = (p.loss, p.want_loss);
            assert!((loss - want).abs() <= 1e-5 * want, "{name}: loss {loss} vs {want}");
            for spec in &model.layout.specs {
                let r = spec.range.clone();
                let what = format!("{name}: {}", spec.name);
                assert_close_to_largest(&p.grads[r.clone()], &p.want[r], 1e-4, &what);
            }
        }
    }
    crate::gpu::on_cpu_and_gpu!(a_training_pass_matches_the_cpu_engine);

    /// The same batch in bf16 against the CPU's f32: the loss within 1e-2 of its value, and
    /// every tensor's gradient at a cosine of at least 0.999 with the CPU's.
    ///
    /// Except one tensor: the first consumer reads the embedding alone, and where its weight
    /// only scales it (one head, a sigmoid gate or dense mixing), the norm that follows undoes
    /// the scale, so its query's gradient is zero but for the norm's eps, and in bf16 noise
    /// around zero: that is held within 1e-3 of the model's largest gradient instead.
    fn a_bf16_training_pass_follows_the_cpu_engine(dev: &Device) {
        for (name, model) in models() {
            let p = pass::<Bf16>(dev, &model);
            let (loss, want) = (p.loss, p.want_loss);
            assert!((loss - want).abs() <= 1e-2 * want, "{name}: loss {loss} vs {want}");
            let c = &model.config;
            let scales =
                c.attn_res_query == DepthQuery::Dense || c.attn_res_gate == DepthGate::Sigmoid;
            let scaled =
                (c.attn_res_heads == 1 && scales).then(|| model.layout.depth_params(0)).flatten();
            let largest = p.want.iter().fold(0f32, |m, x| m.max(x.abs()));
            for spec in &model.layout.specs {
                let r = spec.range.clone();
                if scaled.is_some_and(|q| q.query == r) {
                    let most = p.grads[r].iter().fold(0f32, |m, x| m.max(x.abs()));
                    assert!(most <= 1e-3 * largest, "{name}: {}: {most} vs {largest}", spec.name);
                    continue;
                }
                let cos = cosine(&p.grads[r.clone()], &p.want[r]);
                assert!(cos >= 0.999, "{name}: {}: gradient cosine {cos}", spec.name);
            }
        }
    }
    crate::gpu::on_cpu_and_gpu!(a_bf16_training_pass_follows_the_cpu_engine);

    /// With `recompute`, backward recomputes each sublayer's work from its input: the same
    /// loss and gradients, bit for bit, in both precisions, with a lower peak of memory.
    fn recomputing_gives_the_same_gradients(dev: &Device) {
        fn check<A: Act>(dev: &Device, name: &str, model: &Model) {
            let (batch, seq) = (2, 70);
            let ids: Vec<u32> = (0..batch * seq).map(|i| (i * 31 % 97) as u32).collect();
            let targets: Vec<u32> = ids.iter().map(|t| (t * 17 + 5) % 97).collect();
            let mut gm = GpuModel::<A>::upload(dev, model).unwrap();
            let mut pass = |recompute: bool| {
                gm.recompute = recompute;
                let mut grads = dev.zeros(model.params.len()).unwrap();
                dev.reset_peak();
                let fwd = gm.forward(dev, &ids, batch, seq).unwrap();
                let loss = gm.backward(dev, fwd, &targets, &mut grads).unwrap();
                let peak = dev.memory().1;
                (loss, dev.download(&grads).unwrap(), peak)
            };
            let (kept, recomputed) = (pass(false), pass(true));
            assert_eq!(kept.0.to_bits(), recomputed.0.to_bits(), "{name}: loss");
            let same = kept.1.iter().zip(&recomputed.1).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{name}: gradients");
            assert!(recomputed.2 < kept.2, "{name}: peak {} vs {}", recomputed.2, kept.2);
        }
        for (name, model) in models() {
            check::<f32>(dev, name, &model);
            check::<Bf16>(dev, name, &model);
        }
    }
    crate::gpu::on_cpu_and_gpu!(recomputing_gives_the_same_gradients);

    /// The cosine of two vectors; 1 where both are zero (a consumer that reads one source
    /// has a query gradient of exactly zero on both sides).
    fn cosine(a: &[f32], b: &[f32]) -> f64 {
        let dot =
            |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| *p as f64 * *q as f64).sum::<f64>();
        let (aa, bb) = (dot(a, a), dot(b, b));
        if aa == 0.0 && bb == 0.0 {
            return 1.0;
        }
        dot(a, b) / (aa * bb).sqrt()
    }
}
