//! What a model does with its depth (docs/method.md §6), measured on validation tokens: the RMS
//! of every sublayer's output and of the input it reads (the report's Figure 5b), the gradient
//! norm of every sublayer's weights (Figure 5c, taken during training) and the learned
//! depth-attention weights α of every consumer over every source (Figure 8).

use crate::kernels::rmsnorm::mean_rms;
use crate::model::params::Layout;
use crate::model::Model;
use anyhow::{ensure, Result};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Diagnostics {
    /// Validation tokens the averages are taken over.
    pub tokens: usize,
    /// Per sublayer (attention 0, MLP 0, attention 1, ...): mean per-token RMS of its raw output.
    pub output_rms: Vec<f64>,
    /// Per sublayer: mean per-token RMS of the input `h_l` it reads.
    pub input_rms: Vec<f64>,
    /// Mean per-token RMS of the vector fed to the final norm.
    pub final_input_rms: f64,
    /// AttnRes only: per consumer (the sublayers in order, then the output aggregation), the mean
    /// weight α on each source, in the columns named by `sources`; a source the consumer does not
    /// read has weight 0.
    pub alpha: Option<Vec<Vec<f64>>>,
    /// Column names of `alpha`: `emb` (the embedding `b_0`), then `b1 ..` (completed block sums;
    /// for `full`, each sublayer's output), then `partial` (the consumer's own block so far) for
    /// `block` with more than one sublayer per block.
    pub sources: Vec<String>,
}

/// Measures [`Diagnostics`] over consecutive validation windows of `seq` tokens (up to
/// `max_tokens` tokens; 0 = all full windows).
pub fn diagnose(
    model: &Model,
    val: &[u32],
    seq: usize,
    micro_batch: usize,
    max_tokens: usize,
) -> Result<Diagnostics> {
    let seq = seq.min(val.len());
    ensure!(seq > 0, "no validation tokens to measure diagnostics on");
    let mut windows: Vec<&[u32]> = val.chunks_exact(seq).collect();
    if max_tokens > 0 {
        windows.truncate(max_tokens.div_ceil(seq).max(1));
    }
    let c = &model.config;
    let (d, l) = (c.hidden_size, c.sublayers());
    let block_size = c.block_size();
    let sources = source_labels(l, block_size);
    let consumers = l + 1;
    let (mut out_rms, mut in_rms, mut final_rms) = (vec![0.0f64; l], vec![0.0f64; l], 0.0f64);
    let mut alpha = block_size.map(|_| vec![vec![0.0f64; sources.len()]; consumers]);
    let mut tokens = 0usize;
    for chunk in windows.chunks(micro_batch.max(1)) {
        let ids: Vec<u32> = chunk.concat();
        let fwd = model.forward_probed(&ids, chunk.len(), seq)?;
        let rows = ids.len() as f64;
        // Means of per-chunk means, weighted by tokens.
        let outs = fwd.output_rms().expect("a probed forward records output RMS");
        for (acc, v) in out_rms.iter_mut().zip(outs) {
            *acc += v * rows;
        }
        for (acc, h) in in_rms.iter_mut().zip(fwd.sublayer_inputs()) {
            *acc += mean_rms(h, d) * rows;
        }
        final_rms += mean_rms(fwd.final_input(), d) * rows;
        if let (Some(acc), Some(w)) = (alpha.as_mut(), fwd.residual.depth_weights()) {
            // With several depth heads, their weights are averaged.
            for ((row, a), cols) in acc.iter_mut().zip(&w.alpha).zip(&w.columns) {
                for t in a.chunks(cols.len() * w.heads) {
                    for (i, x) in t.iter().enumerate() {
                        row[cols[i / w.heads]] += *x as f64 / w.heads as f64;
                    }
                }
            }
        }
        tokens += ids.len();
    }
    let n = tokens as f64;
    let scale = |v: &mut Vec<f64>| v.iter_mut().for_each(|x| *x /= n);
    scale(&mut out_rms);
    scale(&mut in_rms);
    if let Some(a) = alpha.as_mut() {
        a.iter_mut().for_each(scale);
    }
    Ok(Diagnostics {
        tokens,
        output_rms: out_rms,
        input_rms: in_rms,
        final_input_rms: final_rms / n,
        alpha,
        sources,
    })
}

/// Names of the depth sources: `emb`, one per completed block, and `partial` when blocks hold
/// several sublayers.
pub fn source_labels(sublayers: usize, block_size: Option<usize>) -> Vec<String> {
    let Some(s) = block_size else { return Vec::new() };
    let mut v = vec!["emb".to_string()];
    v.extend((1..=sublayers.div_ceil(s)).map(|n| format!("b{n}")));
    if s > 1 {
        v.push("partial".into());
    }
    v
}

/// Names of the depth attention's consumers: each sublayer (`0.attn`, `0.mlp`, …), then `out`,
/// the output aggregation.
pub fn consumer_labels(sublayers: usize) -> Vec<String> {
    let sublayer =
        |l: usize| format!("{}.{}", l / 2, if l.is_multiple_of(2) { "attn" } else { "mlp" });
    (0..sublayers).map(sublayer).chain(["out".to_string()]).collect()
}

/// The gradient norm of each sublayer's own weights (attention: input norm, q/k/v, o_proj; MLP:
/// post-attention norm, gate/up, down), from a gradient laid out like the parameters.
pub fn sublayer_grad_norms(layout: &Layout, grads: &[f32]) -> Vec<f64> {
    let norm = |ranges: &[&std::ops::Range<usize>]| -> f64 {
        ranges
            .iter()
            .flat_map(|r| grads[(*r).clone()].iter())
            .map(|g| (*g as f64).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    layout.layers.iter().flat_map(|lp| lp.sublayers().map(|tensors| norm(&tensors))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Config, ResidualKind};

    fn model(residual: ResidualKind, num_blocks: usize) -> Model {
        let c = Config {
            vocab_size: 50,
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            num_key_value_heads: 2,
            head_dim: 8,
            max_position_embeddings: 16,
            residual,
            num_blocks,
            ..Config::default()
        };
        let mut m = Model::init(c, 3).unwrap();
        // Non-zero pseudo-queries so that α is not uniform.
        for (i, p) in m.params.iter_mut().enumerate() {
            if *p == 0.0 {
                *p = ((i * 7919 % 13) as f32 - 6.0) * 0.3;
            }
        }
        m
    }

    /// Output and input RMS, and α, against values recomputed from one plain forward pass.
    #[test]
    fn matches_a_direct_computation() {
        let ids: Vec<u32> = (0..24).map(|i| (i * 17 % 50) as u32).collect();
        for (kind, nb) in
            [(ResidualKind::Standard, 0), (ResidualKind::Block, 2), (ResidualKind::Full, 0)]
        {
            let m = model(kind, nb);
            let dg = diagnose(&m, &ids, 8, 2, 0).unwrap();
            assert_eq!(dg.tokens, 24);
            let f = m.forward(&ids, 3, 8).unwrap();
            let inputs = f.sublayer_inputs();
            // Each sublayer's output is the difference of consecutive standard streams; for
            // AttnRes check the first input (the embedding itself) and the α rows instead.
            assert!((dg.input_rms[0] - mean_rms(inputs[0], 16)).abs() < 1e-9);
            if kind == ResidualKind::Standard {
                for l in 0..3 {
                    let out: Vec<f32> =
                        inputs[l + 1].iter().zip(inputs[l]).map(|(a, b)| a - b).collect();
                    assert!((dg.output_rms[l] - mean_rms(&out, 16)).abs() < 1e-5, "sublayer {l}");
                }
                assert!(dg.alpha.is_none());
                continue;
            }
            let w = f.residual.depth_weights().unwrap();
            let alpha = dg.alpha.as_ref().unwrap();
            for (c, a) in w.alpha.iter().enumerate() {
                let k = a.len() / 24;
                let mean: Vec<f64> =
                    (0..k).map(|i| a.chunks(k).map(|t| t[i] as f64).sum::<f64>() / 24.0).collect();
                let row = &alpha[c];
                assert!(
                    (row.iter().sum::<f64>() - 1.0).abs() < 1e-5,
                    "α of consumer {c} sums to 1"
                );
                let got: Vec<f64> = row.iter().copied().filter(|x| *x != 0.0).collect();
                assert_eq!(got.len(), k, "consumer {c} reads {k} sources: {row:?}");
                for (g, m) in got.iter().zip(&mean) {
                    assert!((g - m).abs() < 1e-6);
                }
            }
            if kind == ResidualKind::Block {
                // 4 sublayers in 2 blocks: consumer 1 reads emb and its partial (last column).
                assert_eq!(dg.sources, ["emb", "b1", "b2", "partial"]);
                assert!(alpha[1][0] > 0.0 && alpha[1][1] == 0.0 && alpha[1][3] > 0.0);
                assert!(alpha[4][3] == 0.0 && alpha[4][2] > 0.0, "the output reads b0..b2");
            }
        }
    }

    #[test]
    fn grad_norms_follow_the_layout() {
        let m = model(ResidualKind::Block, 2);
        let mut g = vec![0.0f32; m.layout.total];
        g[m.layout.layers[1].down.start] = 3.0;
        g[m.layout.layers[1].post_norm.start] = 4.0;
        g[m.layout.layers[0].qkv.start] = 1.0;
        assert_eq!(sublayer_grad_norms(&m.layout, &g), vec![1.0, 0.0, 0.0, 5.0]);
    }
}
