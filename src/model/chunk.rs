//! One pipeline stage's share of the model (docs/pipeline.md): the forward and backward pass of
//! a chunk of consecutive sublayers on one micro-batch, starting from the residual state that
//! the stage before handed on and ending with what goes to the stage after. The first chunk
//! also embeds the tokens, the last one also runs the output aggregation, final norm, LM head
//! and loss. Every operation is the one [`Model::forward`] and [`Model::backward`] run, in the
//! same order, so a pipeline computes the same bits as one process.

use super::residual::{ResidualBackward, ResidualForward, SourceSums};
use super::transformer::{AttnSaved, HeadSaved, MlpSaved, Scratch};
use super::Model;
use crate::base::profile::phase;
use crate::kernels::{cross_entropy, embedding, zeros};
use anyhow::Result;
use std::ops::Range;

/// What one sublayer of the chunk saved.
enum Saved {
    Attn(AttnSaved),
    Mlp(MlpSaved),
}

/// The last chunk's final norm and head.
struct Head {
    h: Vec<f32>,
    rstd: Vec<f32>,
    xn: Vec<f32>,
    logits: Vec<f32>,
}

/// A chunk's forward pass on one micro-batch, with what its backward needs.
pub struct ChunkForward {
    pub range: Range<usize>,
    batch: usize,
    seq: usize,
    saved: Vec<Saved>,
    /// The residual state after the chunk: what the stage after receives.
    pub residual: ResidualForward,
    head: Option<Head>,
}

/// Where a chunk's backward pass starts.
pub enum ChunkGradIn<'a> {
    /// The last chunk: from the loss against these targets.
    Loss(&'a [u32]),
    /// From what the stage after handed back ([`ResidualBackward::resume`]).
    Sent { acc: Vec<f32>, sums: Vec<Option<SourceSums>> },
}

/// What a chunk's backward pass yields besides the parameter gradients.
pub struct ChunkGradOut {
    /// The last chunk: the micro-batch's loss.
    pub loss: Option<f32>,
    /// Every chunk but the first: what goes back to the stage before
    /// ([`ResidualBackward::hand_back`]).
    pub handed: Option<(Vec<f32>, Vec<SourceSums>)>,
    /// The first chunk: the gradient of the embedding output (the caller adds it into the
    /// embedding table's gradient, see [`Model::embedding_backward`]).
    pub embedding: Option<Vec<f32>>,
}

impl Model {
    /// The residual state before sublayer 0: the embedding of `ids`.
    pub fn embed(&self, ids: &[u32], batch: usize, seq: usize) -> Result<ResidualForward> {
        self.check_batch(ids, batch, seq)?;
        let d = self.config.hidden_size;
        let mut e = zeros(ids.len() * d);
        phase("fwd embed", || self.embed_rows(&mut e, ids));
        Ok(ResidualForward::new(&self.config, e, true))
    }

    /// Forward over sublayers `range` from `res`, the state before `range.start` ([`Self::embed`]
    /// or [`ResidualForward::resume`]); a chunk that ends the model also runs the head. With
    /// `recompute`, backward recomputes each sublayer's work from its input (see
    /// [`Model::forward_with`]).
    pub fn forward_chunk(
        &self,
        range: Range<usize>,
        mut res: ResidualForward,
        batch: usize,
        seq: usize,
        recompute: bool,
    ) -> ChunkForward {
        let sh = self.attn_shape(batch, seq);
        let mut saved = Vec::with_capacity(range.len());
        for l in range.clone() {
            saved.push(if l % 2 == 0 {
                Saved::Attn(self.attn_forward(l, &mut res, sh, recompute, &mut |_| ()))
            } else {
                Saved::Mlp(self.mlp_forward(l, &mut res, recompute, &mut |_| ()))
            });
        }
        let head = (range.end == self.config.sublayers()).then(|| {
            let h = phase("fwd residual", || res.output(&self.params, &self.layout));
            let (xn, rstd, logits) = self.head(&h);
            Head { h, rstd, xn, logits }
        });
        ChunkForward { range, batch, seq, saved, residual: res, head }
    }

    /// The mean cross-entropy of a last chunk's logits against `targets`.
    pub fn chunk_loss(&self, fwd: &ChunkForward, targets: &[u32]) -> Option<f32> {
        let head = fwd.head.as_ref()?;
        let v = self.config.vocab_size;
        Some(cross_entropy::loss(&head.logits, targets, v))
    }

    /// Backward over the chunk of `fwd`, adding its parameters' gradients into `g` (laid out as
    /// the parameters).
    pub fn backward_chunk(
        &self,
        fwd: ChunkForward,
        start: ChunkGradIn,
        g: &mut [f32],
    ) -> Result<ChunkGradOut> {
        let (p, lay) = (&self.params, &self.layout);
        let sh = self.attn_shape(fwd.batch, fwd.seq);
        let r = &fwd.residual;
        let mut loss = None;
        let mut res = match (start, &fwd.head) {
            (ChunkGradIn::Loss(targets), Some(h)) => {
                let head = HeadSaved { h: &h.h, rstd: &h.rstd, xn: &h.xn, logits: &h.logits };
                let (l, dh, dh_dot_h) = self.head_backward(&head, targets, g);
                loss = Some(l);
                phase("bwd residual", || ResidualBackward::new(r, dh, dh_dot_h, p, g, lay))
            }
            (ChunkGradIn::Sent { acc, sums }, None) => ResidualBackward::resume(r, acc, sums),
            _ => anyhow::bail!(
                "a chunk's backward starts from the loss exactly when it ends the model"
            ),
        };
        let mut scratch = Scratch::new(&self.config, sh);
        for (l, s) in fwd.range.clone().zip(&fwd.saved).rev() {
            match s {
                Saved::Attn(s) => self.attn_backward(l, s, &mut res, r, sh, &mut scratch, g),
                Saved::Mlp(s) => self.mlp_backward(l, s, &mut res, r, &mut scratch, g),
            }
        }
        let mut out = ChunkGradOut { loss, handed: None, embedding: None };
        if fwd.range.start == 0 {
            out.embedding = Some(phase("bwd residual", || res.embedding_grad(r, p, g, lay)));
        } else {
            out.handed = Some(phase("bwd residual", || res.hand_back(r, p, g, lay)));
        }
        Ok(out)
    }

    /// Adds the gradient `de` of the embedding output of `ids` into the embedding table's
    /// gradient in `g`.
    pub fn embedding_backward(&self, g: &mut [f32], de: &[f32], ids: &[u32]) {
        let d = self.config.hidden_size;
        phase("bwd embed", || embedding::backward(&mut g[self.layout.embed.clone()], de, ids, d));
    }
}
