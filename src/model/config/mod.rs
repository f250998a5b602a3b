//! Model configuration: the Hugging Face Llama `config.json` plus the keys `residual` and
//! `num_blocks`. Loading is strict: unknown keys and impossible values are errors that name
//! the problem.
//!
//! Here: the config's types, its defaults, the constants of the file, and what its shape
//! implies (sublayers, blocks, depth sources). The checks of every value and the size bound are
//! in `validate`; reading and writing `config.json` (the Hugging Face keys accepted, the
//! block size in layers, `--set` overrides) in `json`.

pub(crate) mod json;
mod validate;

use serde::{Deserialize, Serialize};

/// Which residual connection the model uses (docs/method.md §2–4).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ResidualKind {
    /// PreNorm residual: `h_{l+1} = h_l + f_l(h_l)`.
    Standard,
    /// Full AttnRes: every sublayer attends over the embedding and all earlier outputs.
    Full,
    /// Block AttnRes with `num_blocks` blocks of consecutive sublayers.
    Block,
}

/// Where the depth attention's logits come from (docs/method.md §5; `static` is the method).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum DepthQuery {
    /// A learned pseudo-query per consumer, independent of the input (docs/method.md §3).
    #[default]
    Static,
    /// `q = W · rmsnorm(x)` with a learned `d × d` matrix `W` per consumer, where `x` is the sum
    /// of the sources the consumer reads (without a window: the standard residual stream).
    Input,
    /// A learned logit per (consumer, source), independent of the content; still gated.
    Scalar,
    /// DenseFormer-style: a learned weight per (consumer, source) used as is (no gate); starts
    /// at 1, which is the standard residual.
    Dense,
}

/// How the depth attention turns logits into weights (docs/method.md §5; `softmax` is the method).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum DepthGate {
    #[default]
    Softmax,
    /// `α = sigmoid(logit)`, no normalisation over sources.
    Sigmoid,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RopeParameters {
    pub rope_type: String,
    pub rope_theta: f64,
}

/// The model's shape and numerics. Field names are those of Hugging Face's `LlamaConfig`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub model_type: String,
    pub architectures: Vec<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    pub initializer_range: f64,
    pub hidden_act: String,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    pub attention_dropout: f64,
    pub torch_dtype: String,
    /// `standard`, `full` or `block`.
    pub residual: ResidualKind,
    /// Number of blocks for `residual = block` (must divide `2 * num_hidden_layers`); ignored
    /// otherwise.
    pub num_blocks: usize,
    /// Ablations of the depth attention (docs/method.md §5), for `full` and `block`; the
    /// defaults are the method. RMS-normalise the keys (with a learned gain).
    #[serde(default = "default_true")]
    pub attn_res_key_norm: bool,
    #[serde(default)]
    pub attn_res_query: DepthQuery,
    #[serde(default)]
    pub attn_res_gate: DepthGate,
    /// Split the channels into this many groups, each with its own softmax over the sources.
    #[serde(default = "default_one")]
    pub attn_res_heads: usize,
    /// Read only the embedding and the latest `attn_res_window` completed sources (0: all).
    #[serde(default)]
    pub attn_res_window: usize,
    /// For `residual = block` whose blocks are counted in transformer layers that do not
    /// divide `num_hidden_layers`: blocks of `2 * attn_res_block_size` sublayers, the last one
    /// shorter, `num_blocks` of them in all. `None`: `num_blocks` equal blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attn_res_block_size: Option<usize>,
}

fn default_true() -> bool {
    true
}

fn default_one() -> usize {
    1
}

/// What `model_type` and `architectures` say in a checkpoint we write: `standard` models are
/// plain Llama models; AttnRes models name the module their checkpoint carries for
/// `transformers` (`trust_remote_code`, docs/interop.md).
pub const ATTNRES_MODEL_TYPE: &str = "attnres";
pub const ATTNRES_ARCHITECTURE: &str = "AttnResForCausalLM";
/// The `auto_map` of an AttnRes checkpoint: the files [`super::checkpoint::save`] writes beside it.
pub const AUTO_MAP: [(&str, &str); 2] = [
    ("AutoConfig", "configuration_attnres.AttnResConfig"),
    ("AutoModelForCausalLM", "modeling_attnres.AttnResForCausalLM"),
];

/// The block size in transformer layers, a model key that a config holds only when its last
/// block is shorter (otherwise it becomes `num_blocks`).
pub const BLOCK_SIZE_IN_LAYERS: &str = "attn_res_block_size";

/// The largest `rms_norm_eps` a config may set.
pub const MAX_RMS_NORM_EPS: f64 = 1.0;
/// The largest `rope_theta` a config may set.
pub const MAX_ROPE_THETA: f64 = 1e12;

impl Default for Config {
    fn default() -> Self {
        Config {
            model_type: "llama".into(),
            architectures: vec!["LlamaForCausalLM".into()],
            vocab_size: 4096,
            hidden_size: 256,
            intermediate_size: 704,
            num_hidden_layers: 8,
            num_attention_heads: 4,
            num_key_value_heads: 4,
            head_dim: 64,
            max_position_embeddings: 256,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            tie_word_embeddings: true,
            initializer_range: 0.02,
            hidden_act: "silu".into(),
            attention_bias: false,
            mlp_bias: false,
            attention_dropout: 0.0,
            torch_dtype: "float32".into(),
            residual: ResidualKind::Block,
            num_blocks: 8,
            attn_res_key_norm: true,
            attn_res_query: DepthQuery::Static,
            attn_res_gate: DepthGate::Softmax,
            attn_res_heads: 1,
            attn_res_window: 0,
            attn_res_block_size: None,
        }
    }
}

impl Config {
    /// Number of sublayers `L = 2 · num_hidden_layers`.
    pub fn sublayers(&self) -> usize {
        2 * self.num_hidden_layers
    }

    /// Sublayers per depth block: 1 for `full`, `L / num_blocks` for `block` (or twice
    /// `attn_res_block_size`, the last block shorter), `None` for `standard`. Blocks close
    /// after sublayers `S - 1, 2S - 1, ...` and after the last one.
    pub fn block_size(&self) -> Option<usize> {
        match self.residual {
            ResidualKind::Standard => None,
            ResidualKind::Full => Some(1),
            ResidualKind::Block => Some(match self.attn_res_block_size {
                Some(layers) => 2 * layers,
                None => self.sublayers() / self.num_blocks,
            }),
        }
    }

    /// Whether the depth attention is the method itself (no ablation option set), which runs in
    /// the two-phase form.
    pub fn depth_is_default(&self) -> bool {
        self.attn_res_key_norm
            && self.attn_res_query == DepthQuery::Static
            && self.attn_res_gate == DepthGate::Softmax
            && self.attn_res_heads == 1
            && self.attn_res_window == 0
    }

    /// The number of distinct depth sources: the embedding, every completed block, and the
    /// partial sum when blocks hold several sublayers (0 for `standard`).
    pub fn depth_sources(&self) -> usize {
        match self.block_size() {
            None => 0,
            Some(s) => 1 + self.sublayers().div_ceil(s) + (s > 1) as usize,
        }
    }

    pub fn qkv_width(&self) -> usize {
        (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
    }

    /// The attention's shape over `batch` sequences of `seq` tokens.
    pub fn attn_shape(&self, batch: usize, seq: usize) -> crate::kernels::attention::AttnShape {
        crate::kernels::attention::AttnShape {
            batch,
            seq,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
        }
    }

    /// The residual connection in one word, as logs and reports show it: `standard`, `full`, or
    /// `block` followed by the number of blocks.
    pub fn residual_label(&self) -> String {
        match self.residual {
            ResidualKind::Block => format!("block{}", self.num_blocks),
            r => format!("{r:?}").to_lowercase(),
        }
    }
}
