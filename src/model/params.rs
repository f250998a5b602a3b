//! Named parameters in one flat f32 buffer, laid out in Hugging Face order, with the scheme
//! that initialises them.
//!
//! Within a layer, `q_proj`, `k_proj`, `v_proj` are adjacent, so together they form one
//! `[(H + 2KV)·hd, d]` matrix and the three projections run as one product; `gate_proj` and
//! `up_proj` likewise form one `[2F, d]` matrix.

use super::config::{Config, DepthQuery};
use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use std::ops::Range;

/// How a parameter starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Init {
    /// Normal(0, initializer_range): embeddings and every projection matrix.
    Normal,
    /// All ones: RMSNorm gains and depth key-norm gains.
    One,
    /// All zeros: the AttnRes pseudo-queries (docs/method.md §3: mandatory).
    Zero,
}

#[derive(Clone, Debug)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub range: Range<usize>,
    pub init: Init,
}

/// The depth-attention parameters of one consumer: pseudo-query `[1, d]` and key gain `[d]`.
/// Under the ablations of docs/method.md §5 the query is a `[d, d]` matrix (input-dependent
/// query) or one value per source `[1, sources]` (scalar and dense mixing), and there is no
/// gain without key norm.
#[derive(Clone, Debug)]
pub struct DepthParams {
    pub query: Range<usize>,
    pub gain: Option<Range<usize>>,
}

#[derive(Clone, Debug)]
pub struct LayerParams {
    pub input_norm: Range<usize>,
    /// q_proj, k_proj and v_proj, adjacent.
    pub qkv: Range<usize>,
    pub o_proj: Range<usize>,
    pub post_norm: Range<usize>,
    /// gate_proj and up_proj, adjacent.
    pub gate_up: Range<usize>,
    pub down: Range<usize>,
    pub attn_depth: Option<DepthParams>,
    pub mlp_depth: Option<DepthParams>,
}

impl LayerParams {
    /// The tensors of each of the layer's two sublayers, attention then MLP: its norm's gain
    /// and its matrices (the depth attention's parameters left out).
    pub fn sublayers(&self) -> [[&Range<usize>; 3]; 2] {
        [[&self.input_norm, &self.qkv, &self.o_proj], [&self.post_norm, &self.gate_up, &self.down]]
    }
}

#[derive(Clone, Debug)]
pub struct Layout {
    pub specs: Vec<ParamSpec>,
    pub total: usize,
    pub embed: Range<usize>,
    pub layers: Vec<LayerParams>,
    pub final_norm: Range<usize>,
    pub output_depth: Option<DepthParams>,
    /// `lm_head.weight`, or the embedding when tied.
    pub head: Range<usize>,
}

struct Builder {
    specs: Vec<ParamSpec>,
    total: usize,
}

impl Builder {
    fn add(&mut self, name: String, shape: &[usize], init: Init) -> Range<usize> {
        let n: usize = shape.iter().product();
        let range = self.total..self.total + n;
        self.total += n;
        self.specs.push(ParamSpec { name, shape: shape.to_vec(), range: range.clone(), init });
        range
    }

    fn depth(&mut self, prefix: &str, c: &Config) -> DepthParams {
        let d = c.hidden_size;
        let (shape, init) = match c.attn_res_query {
            DepthQuery::Static => ([1, d], Init::Zero),
            DepthQuery::Input => ([d, d], Init::Zero),
            DepthQuery::Scalar => ([1, c.depth_sources()], Init::Zero),
            // All ones: the standard residual's plain sum.
            DepthQuery::Dense => ([1, c.depth_sources()], Init::One),
        };
        let keys_read = !matches!(c.attn_res_query, DepthQuery::Scalar | DepthQuery::Dense);
        DepthParams {
            query: self.add(format!("{prefix}_proj.weight"), &shape, init),
            gain: (c.attn_res_key_norm && keys_read)
                .then(|| self.add(format!("{prefix}_norm.weight"), &[d], Init::One)),
        }
    }
}

impl Layout {
    pub fn new(c: &Config) -> Layout {
        let (d, f, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let (qd, kvd) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let attnres = c.block_size().is_some();
        let mut b = Builder { specs: Vec::new(), total: 0 };
        let embed = b.add("model.embed_tokens.weight".into(), &[c.vocab_size, d], Init::Normal);
        let mut layers = Vec::new();
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let attn_depth = attnres.then(|| b.depth(&format!("{p}.attn_res"), c));
            let input_norm = b.add(format!("{p}.input_layernorm.weight"), &[d], Init::One);
            let q = b.add(format!("{p}.self_attn.q_proj.weight"), &[qd, d], Init::Normal);
            b.add(format!("{p}.self_attn.k_proj.weight"), &[kvd, d], Init::Normal);
            let v = b.add(format!("{p}.self_attn.v_proj.weight"), &[kvd, d], Init::Normal);
            let o_proj = b.add(format!("{p}.self_attn.o_proj.weight"), &[d, qd], Init::Normal);
            let mlp_depth = attnres.then(|| b.depth(&format!("{p}.mlp_res"), c));
            let post_norm = b.add(format!("{p}.post_attention_layernorm.weight"), &[d], Init::One);
            let gate = b.add(format!("{p}.mlp.gate_proj.weight"), &[f, d], Init::Normal);
            let up = b.add(format!("{p}.mlp.up_proj.weight"), &[f, d], Init::Normal);
            let down = b.add(format!("{p}.mlp.down_proj.weight"), &[d, f], Init::Normal);
            layers.push(LayerParams {
                input_norm,
                qkv: q.start..v.end,
                o_proj,
                post_norm,
                gate_up: gate.start..up.end,
                down,
                attn_depth,
                mlp_depth,
            });
        }
        let output_depth = attnres.then(|| b.depth("model.output_attn_res", c));
        let final_norm = b.add("model.norm.weight".into(), &[d], Init::One);
        let head = if c.tie_word_embeddings {
            embed.clone()
        } else {
            b.add("lm_head.weight".into(), &[c.vocab_size, d], Init::Normal)
        };
        Layout { specs: b.specs, total: b.total, embed, layers, final_norm, output_depth, head }
    }

    /// The ranges of the weight matrices that a product reads whole: per layer q/k/v (fused),
    /// o_proj, gate/up (fused) and down_proj, then the embedding and, untied, the LM head.
    /// These are the tensors a quantised model may store in block formats.
    pub fn matrices(&self) -> Vec<Range<usize>> {
        let mut m: Vec<Range<usize>> = self
            .layers
            .iter()
            .flat_map(|l| [l.qkv.clone(), l.o_proj.clone(), l.gate_up.clone(), l.down.clone()])
            .collect();
        m.push(self.embed.clone());
        if self.head != self.embed {
            m.push(self.head.clone());
        }
        m
    }

    /// The tensors (indices into `specs`) that make up `range`, in order.
    pub fn specs_in(&self, range: &Range<usize>) -> Vec<usize> {
        (0..self.specs.len())
            .filter(|&i| {
                let r = &self.specs[i].range;
                r.start >= range.start && r.end <= range.end && !r.is_empty()
            })
            .collect()
    }

    /// Values of the tensors in `specs`, which come first in the buffer: what an optimiser
    /// updates. The whole model's is [`Layout::total`]; a pipeline stage's part ([`Layout::part`])
    /// may hold read-only copies of other tensors after them.
    pub fn updated(&self) -> usize {
        self.specs.last().map_or(0, |s| s.range.end)
    }

    /// The part of this layout that a pipeline stage holds: the tensors `owned[i]` marks (by
    /// index into `specs`), packed in order, then read-only copies of those `copied` marks
    /// (values the stage reads but another stage updates). The part's `specs` are the owned
    /// tensors alone; every range of a tensor not held is empty, so that nothing can read it
    /// by mistake.
    pub fn part(&self, owned: &[bool], copied: &[bool]) -> Layout {
        let mut start: Vec<Option<usize>> = vec![None; self.specs.len()];
        let mut at = 0;
        for pass in [owned, copied] {
            for (i, s) in self.specs.iter().enumerate() {
                if pass[i] && start[i].is_none() {
                    start[i] = Some(at);
                    at += s.range.len();
                }
            }
        }
        // A range starts where a tensor starts (adjacent tensors of one sublayer, as qkv, are
        // held together, so they stay adjacent).
        let map = |r: &Range<usize>| -> Range<usize> {
            let i = self.specs.iter().position(|s| s.range.start == r.start);
            match i.and_then(|i| start[i]) {
                Some(s) => s..s + r.len(),
                None => 0..0,
            }
        };
        let depth = |p: &Option<DepthParams>| {
            p.as_ref().map(|p| DepthParams { query: map(&p.query), gain: p.gain.as_ref().map(map) })
        };
        let specs = self
            .specs
            .iter()
            .enumerate()
            .filter(|(i, _)| owned[*i])
            .map(|(_, s)| ParamSpec { range: map(&s.range), ..s.clone() })
            .collect();
        let layers = self
            .layers
            .iter()
            .map(|lp| LayerParams {
                input_norm: map(&lp.input_norm),
                qkv: map(&lp.qkv),
                o_proj: map(&lp.o_proj),
                post_norm: map(&lp.post_norm),
                gate_up: map(&lp.gate_up),
                down: map(&lp.down),
                attn_depth: depth(&lp.attn_depth),
                mlp_depth: depth(&lp.mlp_depth),
            })
            .collect();
        Layout {
            specs,
            total: at,
            embed: map(&self.embed),
            layers,
            final_norm: map(&self.final_norm),
            output_depth: depth(&self.output_depth),
            head: map(&self.head),
        }
    }

    /// The ranges of sublayer `l`'s own tensors (attention of layer l/2 when l is even, its
    /// MLP when odd): depth parameters, norm and projections.
    pub fn sublayer_ranges(&self, l: usize) -> Vec<Range<usize>> {
        let lp = &self.layers[l / 2];
        let depth =
            self.depth_params(l).into_iter().flat_map(|p| [Some(p.query.clone()), p.gain.clone()]);
        let own = if l.is_multiple_of(2) {
            [lp.input_norm.clone(), lp.qkv.clone(), lp.o_proj.clone()]
        } else {
            [lp.post_norm.clone(), lp.gate_up.clone(), lp.down.clone()]
        };
        depth.flatten().chain(own).collect()
    }

    /// The depth parameters read by sublayer `l` (attention of layer l/2 when l is even, its
    /// MLP when odd), or by the output aggregation when `l == L`.
    pub fn depth_params(&self, l: usize) -> Option<&DepthParams> {
        if l == 2 * self.layers.len() {
            self.output_depth.as_ref()
        } else if l.is_multiple_of(2) {
            self.layers[l / 2].attn_depth.as_ref()
        } else {
            self.layers[l / 2].mlp_depth.as_ref()
        }
    }

    pub fn spec(&self, name: &str) -> Option<&ParamSpec> {
        self.specs.iter().find(|s| s.name == name)
    }

    /// Fresh parameters, deterministic in `seed`: one ChaCha8 stream drawn in layout order,
    /// normals by the Box–Muller transform.
    pub fn init(&self, c: &Config, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut data = vec![0.0f32; self.total];
        let std = c.initializer_range;
        for s in &self.specs {
            let out = &mut data[s.range.clone()];
            match s.init {
                Init::Zero => out.fill(0.0),
                Init::One => out.fill(1.0),
                Init::Normal => out.iter_mut().for_each(|x| *x = (normal(&mut rng) * std) as f32),
            }
        }
        data
    }
}

fn uniform_open(rng: &mut ChaCha8Rng) -> f64 {
    // 53 random bits, shifted away from 0 so the logarithm is finite.
    ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

fn normal(rng: &mut ChaCha8Rng) -> f64 {
    let (u1, u2) = (uniform_open(rng), uniform_open(rng));
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::ResidualKind;

    #[test]
    fn init_is_deterministic_and_zeroes_pseudo_queries() {
        let c = Config {
            residual: ResidualKind::Block,
            num_blocks: 4,
            hidden_size: 32,
            head_dim: 8,
            intermediate_size: 48,
            num_hidden_layers: 2,
            vocab_size: 50,
            ..Config::default()
        };
        let lay = Layout::new(&c);
        let (a, b) = (lay.init(&c, 7), lay.init(&c, 7));
        assert_eq!(a, b);
        assert_ne!(a, lay.init(&c, 8));
        let queries: Vec<_> = lay.specs.iter().filter(|s| s.name.contains("res_proj")).collect();
        assert_eq!(queries.len(), 2 * 2 + 1, "one pseudo-query per sublayer plus the output");
        for s in &queries {
            assert!(a[s.range.clone()].iter().all(|x| *x == 0.0), "{}", s.name);
        }
        for s in lay.specs.iter().filter(|s| s.name.ends_with("norm.weight")) {
            assert!(a[s.range.clone()].iter().all(|x| *x == 1.0), "{}", s.name);
        }
        let e = &a[lay.embed.clone()];
        let var = e.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / e.len() as f64;
        assert!((var.sqrt() - 0.02).abs() < 0.002, "embedding std {}", var.sqrt());
        let std = Config { residual: ResidualKind::Standard, ..c };
        assert!(!Layout::new(&std).specs.iter().any(|s| s.name.contains("res_")));
    }
}
