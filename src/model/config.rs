//! Model configuration: the Hugging Face Llama `config.json` plus the keys `residual` and
//! `num_blocks`. Loading is strict: unknown keys and impossible values are errors that name
//! the problem.

use crate::base::memory::{format_bytes, memory_limit};
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

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

/// Keys that Hugging Face writes and that do not change the computation; accepted and dropped.
const IGNORED_HF_KEYS: &[&str] = &[
    "transformers_version",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "dtype",
    "_name_or_path",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "pretraining_tp",
    "rope_scaling",
    "rope_parameters",
    "auto_map",
];

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

/// The block size in transformer layers, a model key that a config holds only when its last
/// block is shorter (otherwise it becomes `num_blocks`).
pub const BLOCK_SIZE_IN_LAYERS: &str = "attn_res_block_size";

impl Config {
    /// The keys `--set` may give: every field, and the block size in layers.
    pub fn keys(&self) -> Vec<String> {
        let Value::Object(map) = serde_json::to_value(self).expect("config serialises") else {
            unreachable!("a config serialises to an object")
        };
        let mut keys: Vec<String> = map.keys().cloned().collect();
        if !map.contains_key(BLOCK_SIZE_IN_LAYERS) {
            keys.push(BLOCK_SIZE_IN_LAYERS.into());
        }
        keys
    }

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

    /// Checks every value; the error names the offending key.
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.model_type == "llama",
            "config: model_type must be \"llama\" or \"{ATTNRES_MODEL_TYPE}\", got {:?}",
            self.model_type
        );
        for (key, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            ensure!(v > 0, "config: {key} must be positive, got {v}");
        }
        ensure!(
            self.vocab_size <= u32::MAX as usize,
            "config: vocab_size {} is too large",
            self.vocab_size
        );
        // Sizes first: everything below (and every buffer the model makes) multiplies them.
        self.check_size(memory_limit())?;
        ensure!(
            self.num_attention_heads.is_multiple_of(self.num_key_value_heads),
            "config: num_key_value_heads ({}) must divide num_attention_heads ({})",
            self.num_key_value_heads,
            self.num_attention_heads
        );
        ensure!(
            self.head_dim.is_multiple_of(2),
            "config: head_dim must be even for rotary embedding, got {}",
            self.head_dim
        );
        // Ranges wide enough for every published model (eps 1e-6..1e-5, theta 1e4..1e7), and
        // narrow enough that a mistyped exponent is refused instead of silently flattening every
        // normalised row (an eps of 1e308) or every rotation (a theta of 1e308).
        ensure!(
            self.rms_norm_eps > 0.0 && self.rms_norm_eps <= MAX_RMS_NORM_EPS,
            "config: rms_norm_eps must be a positive number, at most {MAX_RMS_NORM_EPS}, got {:?}",
            self.rms_norm_eps
        );
        ensure!(
            self.rope_theta > 0.0 && self.rope_theta <= MAX_ROPE_THETA,
            "config: rope_theta must be positive, at most {MAX_ROPE_THETA:e}, got {:?}",
            self.rope_theta
        );
        ensure!(
            self.initializer_range.is_finite() && self.initializer_range >= 0.0,
            "config: initializer_range must be a non-negative number, got {}",
            self.initializer_range
        );
        ensure!(
            self.hidden_act == "silu",
            "config: only hidden_act = \"silu\" is supported, got {:?}",
            self.hidden_act
        );
        ensure!(
            !self.attention_bias,
            "config: attention_bias = true is not supported (Llama has no biases)"
        );
        ensure!(!self.mlp_bias, "config: mlp_bias = true is not supported (Llama has no biases)");
        ensure!(
            self.attention_dropout == 0.0,
            "config: attention_dropout must be 0, got {}",
            self.attention_dropout
        );
        ensure!(
            self.torch_dtype == "float32",
            "config: only torch_dtype = \"float32\" is supported, got {:?}",
            self.torch_dtype
        );
        if let (ResidualKind::Block, Some(layers)) = (self.residual, self.attn_res_block_size) {
            let n = self.num_hidden_layers;
            ensure!(
                layers > 0 && self.num_blocks == n.div_ceil(layers),
                "config: num_blocks = {} disagrees with attn_res_block_size = {layers} layers \
                 ({n} layers make {} blocks)",
                self.num_blocks,
                n.div_ceil(layers.max(1))
            );
        } else if self.residual == ResidualKind::Block {
            let l = self.sublayers();
            ensure!(
                self.num_blocks > 0 && l.is_multiple_of(self.num_blocks),
                "config: num_blocks = {} must be a positive divisor of the sublayer count 2 * num_hidden_layers = {l} \
                 (for example {})",
                self.num_blocks,
                join(&divisors(l))
            );
        }
        if self.residual != ResidualKind::Standard {
            let heads = self.attn_res_heads;
            ensure!(
                heads > 0 && self.hidden_size.is_multiple_of(heads),
                "config: attn_res_heads = {heads} must be a positive divisor of hidden_size = {}",
                self.hidden_size
            );
            let content_free =
                matches!(self.attn_res_query, DepthQuery::Scalar | DepthQuery::Dense);
            ensure!(!content_free || heads == 1, "config: attn_res_heads must be 1 with attn_res_query = scalar or dense (their weights do not look at channels)");
            ensure!(
                self.attn_res_query != DepthQuery::Dense || self.attn_res_gate == DepthGate::Softmax,
                "config: attn_res_gate does not apply to attn_res_query = dense (its weights are used as they are)"
            );
        }
        Ok(())
    }

    /// The number of parameters the config implies (what [`super::params::Layout`] lays out),
    /// computed with overflow checks; `None` when it does not fit in 128 bits.
    pub fn param_count(&self) -> Option<u128> {
        let n = |x: usize| x as u128;
        let (d, f, hd) = (n(self.hidden_size), n(self.intermediate_size), n(self.head_dim));
        let qd = n(self.num_attention_heads).checked_mul(hd)?;
        let kvd = n(self.num_key_value_heads).checked_mul(hd)?;
        let sublayers = n(self.num_hidden_layers).checked_mul(2)?;
        let depth = match self.residual {
            ResidualKind::Standard => 0,
            _ => {
                let sources = match self.residual {
                    ResidualKind::Full => sublayers + 1,
                    _ => {
                        let blocks = n(self.num_blocks.max(1));
                        let size = self.attn_res_block_size.map(|b| 2 * n(b));
                        1 + blocks + (size.unwrap_or(sublayers / blocks) > 1) as u128
                    }
                };
                let query = match self.attn_res_query {
                    DepthQuery::Static => d,
                    DepthQuery::Input => d.checked_mul(d)?,
                    DepthQuery::Scalar | DepthQuery::Dense => sources,
                };
                let keys_read =
                    !matches!(self.attn_res_query, DepthQuery::Scalar | DepthQuery::Dense);
                query + if self.attn_res_key_norm && keys_read { d } else { 0 }
            }
        };
        let embed = n(self.vocab_size).checked_mul(d)?;
        let attn = qd.checked_add(kvd.checked_mul(2)?)?.checked_add(qd)?.checked_mul(d)?;
        let mlp = f.checked_mul(d)?.checked_mul(3)?;
        let layer =
            attn.checked_add(mlp)?.checked_add(2 * d)?.checked_add(depth.checked_mul(2)?)?;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        n(self.num_hidden_layers)
            .checked_mul(layer)?
            .checked_add(embed)?
            .checked_add(head)?
            .checked_add(depth + d)
    }

    /// Bounds the model's size before anything is allocated: the parameters (f32) must fit in
    /// `limit` bytes. Every other size the model multiplies out of the config (the q/k/v width,
    /// a token's depth sources, a layer's matrices) is a factor of this count, so it fits too.
    pub fn check_size(&self, limit: u64) -> Result<()> {
        let Some(params) = self.param_count() else {
            bail!(
                "config: the parameter count overflows (vocab_size = {}, hidden_size = {}, \
                 intermediate_size = {}, num_hidden_layers = {}, heads {} x head_dim {})",
                self.vocab_size,
                self.hidden_size,
                self.intermediate_size,
                self.num_hidden_layers,
                self.num_attention_heads,
                self.head_dim
            )
        };
        let bytes = params.saturating_mul(4);
        ensure!(
            bytes <= limit as u128,
            "config: the model needs {} of parameters ({params} f32 values); at most {} (the \
             machine's memory) is allowed",
            format_bytes(bytes),
            format_bytes(limit as u128)
        );
        Ok(())
    }

    /// Parses and validates `config.json` text.
    pub fn from_json(text: &str) -> Result<Config> {
        let value: Value = serde_json::from_str(text).context("config.json is not valid JSON")?;
        let Value::Object(map) = value else { bail!("config.json must hold a JSON object") };
        Self::from_map(map)
    }

    /// Builds a config from key/value pairs laid over the defaults, then validates it.
    pub fn from_map(mut map: Map<String, Value>) -> Result<Config> {
        check_hf_extras(&mut map)?;
        // Fill keys a third-party config may omit from our defaults, but never the ones that
        // define the shape: those must be given.
        for key in [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ] {
            ensure!(map.contains_key(key), "config: missing key {key:?}");
        }
        if !map.contains_key("num_key_value_heads") {
            map.insert("num_key_value_heads".into(), map["num_attention_heads"].clone());
        }
        if !map.contains_key("head_dim") {
            let (h, n) = (map["hidden_size"].as_u64(), map["num_attention_heads"].as_u64());
            if let (Some(h), Some(n)) = (h, n) {
                ensure!(n > 0 && h % n == 0, "config: num_attention_heads ({n}) must divide hidden_size ({h}) when head_dim is not given");
                map.insert("head_dim".into(), Value::from(h / n));
            }
        }
        let defaults =
            serde_json::to_value(Config { residual: ResidualKind::Standard, ..Config::default() })?;
        let defaults = defaults.as_object().expect("struct serialises to an object");
        for (k, v) in &map {
            if k == BLOCK_SIZE_IN_LAYERS {
                continue; // checked by block_size_in_layers
            }
            let Some(d) = defaults.get(k) else { bail!("config: unknown key {k:?}") };
            same_kind(d, v)
                .map_err(|want| anyhow::anyhow!("config: {k} must be {want}, got {v}"))?;
        }
        if let Some(r) = map.get("residual") {
            ensure!(
                serde_json::from_value::<ResidualKind>(r.clone()).is_ok(),
                "config: residual must be \"standard\", \"full\" or \"block\", got {r}"
            );
        }
        if let Some(r) = map.get("attn_res_query") {
            ensure!(
                serde_json::from_value::<DepthQuery>(r.clone()).is_ok(),
                "config: attn_res_query must be \"static\", \"input\", \"scalar\" or \"dense\", got {r}"
            );
        }
        if let Some(r) = map.get("attn_res_gate") {
            ensure!(
                serde_json::from_value::<DepthGate>(r.clone()).is_ok(),
                "config: attn_res_gate must be \"softmax\" or \"sigmoid\", got {r}"
            );
        }
        for (k, v) in defaults {
            map.entry(k.clone()).or_insert_with(|| v.clone());
        }
        let cfg: Config = serde_json::from_value(Value::Object(map))
            .map_err(|e| anyhow::anyhow!("config: {e}"))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Applies `key=value` overrides (values parsed as JSON, else taken as strings) to this
    /// config. Unknown keys and ill-typed values are errors.
    pub fn with_overrides(&self, sets: &[String]) -> Result<Config> {
        let mut values = Map::new();
        for s in sets {
            let (k, v) =
                s.split_once('=').with_context(|| format!("--set {s:?}: expected key=value"))?;
            let v = serde_json::from_str(v.trim())
                .unwrap_or_else(|_| Value::String(v.trim().to_string()));
            values.insert(k.trim().to_string(), v);
        }
        self.with_values(values).map_err(|e| anyhow::anyhow!("--set: {e}"))
    }

    /// Lays `values` over this config and validates the result. A new `hidden_size` or
    /// `num_attention_heads` implies `head_dim = hidden_size / heads` unless `head_dim` is
    /// given too.
    pub fn with_values(&self, values: Map<String, Value>) -> Result<Config> {
        let Value::Object(mut map) = serde_json::to_value(self)? else { unreachable!() };
        // One of the two block counts given replaces both.
        match (values.contains_key(BLOCK_SIZE_IN_LAYERS), values.contains_key("num_blocks")) {
            (true, false) => drop(map.remove("num_blocks")),
            (false, true) => drop(map.remove(BLOCK_SIZE_IN_LAYERS)),
            _ => {}
        }
        let known = self.keys();
        for k in values.keys() {
            ensure!(known.contains(k), "unknown config key {k:?} (known: {})", known.join(", "));
        }
        let reshaped =
            values.contains_key("hidden_size") || values.contains_key("num_attention_heads");
        if reshaped && !values.contains_key("head_dim") {
            map.remove("head_dim");
        }
        map.extend(values);
        Self::from_map(map)
    }

    /// `config.json` text: our fields plus `rope_parameters`, which newer `transformers` reads;
    /// for AttnRes the model type, architecture and `auto_map` of the module the checkpoint
    /// carries, and for Block `attn_res_block_size` when blocks are whole layers.
    pub fn to_json(&self) -> String {
        self.to_json_with_module(true)
    }

    /// [`Self::to_json`], naming the module in `auto_map` only when the checkpoint carries it
    /// (`module`; a quantised checkpoint does not).
    pub fn to_json_with_module(&self, module: bool) -> String {
        let mut v = serde_json::to_value(self).expect("config serialises");
        v["rope_parameters"] =
            serde_json::json!({"rope_type": "default", "rope_theta": self.rope_theta});
        if let Some(s) = self.block_size() {
            v["model_type"] = ATTNRES_MODEL_TYPE.into();
            v["architectures"] = serde_json::json!([ATTNRES_ARCHITECTURE]);
            if module {
                v["auto_map"] =
                    AUTO_MAP.iter().map(|(k, m)| (k.to_string(), Value::from(*m))).collect();
            }
            if self.residual == ResidualKind::Block && s % 2 == 0 {
                v[BLOCK_SIZE_IN_LAYERS] = Value::from(s / 2);
            }
        }
        serde_json::to_string_pretty(&v).expect("config serialises")
    }
}

/// Validates and removes the Hugging Face keys we accept but do not store; takes the model type
/// an AttnRes checkpoint writes as ours and turns `attn_res_block_size` into `num_blocks`.
fn check_hf_extras(map: &mut Map<String, Value>) -> Result<()> {
    if map.get("model_type").is_some_and(|t| t == ATTNRES_MODEL_TYPE) {
        map.insert("model_type".into(), "llama".into());
        map.remove("architectures");
    }
    if let Some(v) = map.get("auto_map") {
        ensure!(v.is_object(), "config: auto_map must be an object, got {v}");
    }
    match map.get(BLOCK_SIZE_IN_LAYERS).cloned() {
        Some(Value::Null) => drop(map.remove(BLOCK_SIZE_IN_LAYERS)),
        Some(v) => block_size_in_layers(map, &v)?,
        None => {}
    }
    if let Some(v) = map.get("pretraining_tp") {
        ensure!(v.as_u64() == Some(1), "config: pretraining_tp must be 1, got {v}");
    }
    if let Some(v) = map.get("rope_scaling") {
        ensure!(v.is_null(), "config: rope_scaling is not supported, got {v}");
    }
    if let Some(v) = map.get("dtype") {
        ensure!(v.is_null() || v == "float32", "config: only dtype float32 is supported, got {v}");
    }
    if let Some(rp) = map.get("rope_parameters").cloned() {
        let rp: RopeParameters = serde_json::from_value(rp).context("config: rope_parameters")?;
        ensure!(
            rp.rope_type == "default",
            "config: only rope_type \"default\" is supported, got {:?}",
            rp.rope_type
        );
        match map.get("rope_theta").and_then(Value::as_f64) {
            Some(t) => ensure!(
                t == rp.rope_theta,
                "config: rope_theta ({t}) disagrees with rope_parameters.rope_theta ({})",
                rp.rope_theta
            ),
            None => {
                map.insert("rope_theta".into(), Value::from(rp.rope_theta));
            }
        }
    }
    for k in IGNORED_HF_KEYS {
        map.remove(*k);
    }
    Ok(())
}

/// Sets `num_blocks` from `attn_res_block_size`, the block size in transformer layers (two
/// sublayers each) as Kimi's and Megatron's configs count it; given both, they must agree.
/// The key stays only when the size does not divide the layers (a shorter last block), the one
/// case `num_blocks` cannot say.
fn block_size_in_layers(map: &mut Map<String, Value>, v: &Value) -> Result<()> {
    let layers = v.as_u64().filter(|&b| b > 0);
    let layers = layers.with_context(|| {
        format!(
            "config: attn_res_block_size must be a positive integer (layers per block), got {v}"
        )
    })?;
    if map.get("residual").and_then(Value::as_str) != Some("block") {
        map.remove(BLOCK_SIZE_IN_LAYERS);
        return Ok(());
    }
    let n = map.get("num_hidden_layers").and_then(Value::as_u64);
    let n = n.context("config: attn_res_block_size needs num_hidden_layers")?;
    // A block as long as the model or longer is the one block.
    let layers = layers.min(n.max(1));
    if n % layers == 0 {
        map.remove(BLOCK_SIZE_IN_LAYERS);
    }
    let blocks = n.div_ceil(layers);
    if let Some(given) = map.get("num_blocks") {
        ensure!(
            given.as_u64() == Some(blocks),
            "config: num_blocks = {given} disagrees with attn_res_block_size = {layers} layers \
             ({n} layers make {blocks} blocks)"
        );
    }
    map.insert("num_blocks".into(), Value::from(blocks));
    Ok(())
}

fn join(values: &[usize]) -> String {
    values.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")
}

/// Checks that `v` has the JSON kind of the default `d` (integers stay non-negative integers);
/// on a mismatch returns what was expected, for the error message.
pub(crate) fn same_kind(d: &Value, v: &Value) -> std::result::Result<(), &'static str> {
    let (ok, want) = match d {
        Value::Number(n) if n.is_u64() => (v.is_u64(), "a non-negative integer"),
        Value::Number(_) => (v.is_number(), "a number"),
        Value::Bool(_) => (v.is_boolean(), "true or false"),
        Value::String(_) => (v.is_string(), "a string"),
        Value::Array(_) => {
            (v.as_array().is_some_and(|a| a.iter().all(Value::is_string)), "a list of strings")
        }
        _ => (true, ""),
    };
    if ok {
        Ok(())
    } else {
        Err(want)
    }
}

/// The divisors of `n` in increasing order (found up to its square root, so large counts stay
/// quick).
fn divisors(n: usize) -> Vec<usize> {
    let (mut small, mut large) = (Vec::new(), Vec::new());
    let mut d = 1;
    while d <= n / d {
        if n.is_multiple_of(d) {
            small.push(d);
            if d != n / d {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

/// The largest `rms_norm_eps` a config may set.
pub const MAX_RMS_NORM_EPS: f64 = 1.0;
/// The largest `rope_theta` a config may set.
pub const MAX_ROPE_THETA: f64 = 1e12;

impl Config {
    /// The residual connection in one word, as logs and reports show it: `standard`, `full`, or
    /// `block` followed by the number of blocks.
    pub fn residual_label(&self) -> String {
        match self.residual {
            ResidualKind::Block => format!("block{}", self.num_blocks),
            r => format!("{r:?}").to_lowercase(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `config.json` text read back gives the config written, for the default config, Block
    /// AttnRes with another block count, Full AttnRes with every depth-attention ablation off
    /// its default, and a RoPE base scaled up for long contexts (Llama 3's 500000, with
    /// grouped-query attention and untied embeddings); the text holds each of those values
    /// under its key, `rope_parameters` included.
    #[test]
    fn round_trips_through_json() {
        let block = Config { residual: ResidualKind::Block, num_blocks: 4, ..Config::default() };
        let ablation = Config {
            residual: ResidualKind::Full,
            attn_res_key_norm: false,
            attn_res_query: DepthQuery::Input,
            attn_res_gate: DepthGate::Sigmoid,
            attn_res_heads: 4,
            attn_res_window: 2,
            ..Config::default()
        };
        let content_free =
            Config { attn_res_query: DepthQuery::Dense, attn_res_window: 3, ..Config::default() };
        let rope = Config {
            residual: ResidualKind::Standard,
            rope_theta: 500_000.0,
            max_position_embeddings: 8192,
            num_key_value_heads: 2,
            tie_word_embeddings: false,
            ..Config::default()
        };
        let cases = [
            (Config::default(), vec![("residual", json!("block")), ("num_blocks", json!(8))]),
            (block, vec![("residual", json!("block")), ("num_blocks", json!(4))]),
            (
                ablation,
                vec![
                    ("residual", json!("full")),
                    ("attn_res_key_norm", json!(false)),
                    ("attn_res_query", json!("input")),
                    ("attn_res_gate", json!("sigmoid")),
                    ("attn_res_heads", json!(4)),
                    ("attn_res_window", json!(2)),
                ],
            ),
            (content_free, vec![("attn_res_query", json!("dense")), ("attn_res_window", json!(3))]),
            (
                rope,
                vec![
                    ("residual", json!("standard")),
                    ("rope_theta", json!(500_000.0)),
                    ("rope_parameters", json!({"rope_type": "default", "rope_theta": 500_000.0})),
                    ("max_position_embeddings", json!(8192)),
                    ("num_key_value_heads", json!(2)),
                    ("tie_word_embeddings", json!(false)),
                ],
            ),
        ];
        for (c, keys) in cases {
            c.validate().unwrap();
            let text = c.to_json();
            let v: Value = serde_json::from_str(&text).unwrap();
            for (k, want) in keys {
                assert_eq!(v.get(k), Some(&want), "{k} in {text}");
            }
            assert_eq!(Config::from_json(&text).unwrap(), c, "{text}");
        }
    }

    #[test]
    fn rejects_bad_values_by_name() {
        let c = Config::default();
        let err = |sets: &[&str]| {
            c.with_overrides(&sets.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap_err()
                .to_string()
        };
        assert!(err(&["num_blocks=3"]).contains("num_blocks = 3"));
        assert!(err(&["hidden_sizee=3"]).contains("unknown config key"));
        assert!(err(&["hidden_size=-1"]).contains("hidden_size"));
        assert!(err(&["num_key_value_heads=3"]).contains("num_key_value_heads"));
        assert!(err(&["residual=sideways"]).contains("residual must be"));
        assert!(
            err(&["tie_word_embeddings=3"]).contains("tie_word_embeddings must be true or false")
        );
        assert!(err(&["rms_norm_eps=0"]).contains("rms_norm_eps"));
        assert!(err(&["attn_res_query=dynamic"]).contains("attn_res_query must be"));
        assert!(err(&["attn_res_gate=relu"]).contains("attn_res_gate must be"));
        assert!(err(&["attn_res_heads=3"]).contains("attn_res_heads = 3"));
        assert!(err(&["attn_res_query=dense", "attn_res_gate=sigmoid"]).contains("does not apply"));
        assert!(err(&["attn_res_query=scalar", "attn_res_heads=2"]).contains("must be 1"));
        assert!(Config::from_json("{").unwrap_err().to_string().contains("not valid JSON"));
        assert!(Config::from_json("{\"hidden_size\": 4}")
            .unwrap_err()
            .to_string()
            .contains("missing key"));
        let ok = c.with_overrides(&["residual=full".into(), "num_blocks=3".into()]).unwrap();
        assert_eq!(ok.block_size(), Some(1));
    }

    /// `attn_res_block_size` counts transformer layers (two sublayers each): written beside
    /// `num_blocks` when blocks are whole layers, read as `num_blocks = layers / size` (rounded
    /// up: the last block may be shorter, and then the size is kept), refused when it disagrees
    /// with `num_blocks`. AttnRes configs name
    /// their own model type and module; standard ones stay Llama.
    #[test]
    fn block_size_in_layers_reads_and_writes() {
        let written = |num_blocks: usize, residual| {
            let c = Config { num_blocks, residual, ..Config::default() };
            serde_json::from_str::<Value>(&c.to_json()).unwrap()
        };
        // 8 layers = 16 sublayers: 8 blocks of 1 layer, 4 of 2, 2 of 4; 16 blocks of one
        // sublayer are not whole layers.
        for (blocks, layers) in [(8, Some(1)), (4, Some(2)), (2, Some(4)), (16, None)] {
            let v = written(blocks, ResidualKind::Block);
            assert_eq!(v.get("attn_res_block_size").and_then(Value::as_u64), layers, "{blocks}");
            assert_eq!(v["model_type"], ATTNRES_MODEL_TYPE);
            assert_eq!(v["architectures"], json!([ATTNRES_ARCHITECTURE]));
            assert_eq!(v["auto_map"]["AutoModelForCausalLM"], AUTO_MAP[1].1);
        }
        assert!(written(4, ResidualKind::Full).get("attn_res_block_size").is_none());
        let standard = written(4, ResidualKind::Standard);
        assert_eq!(
            (standard["model_type"].clone(), standard.get("auto_map")),
            (json!("llama"), None)
        );

        let read = |extra: Value| {
            let mut v = written(8, ResidualKind::Block);
            let map = v.as_object_mut().unwrap();
            map.remove("num_blocks");
            map.remove("attn_res_block_size");
            map.extend(extra.as_object().unwrap().clone());
            Config::from_json(&v.to_string())
        };
        let c = read(json!({"attn_res_block_size": 2})).unwrap();
        assert_eq!((c.num_blocks, c.block_size()), (4, Some(4)));
        let c = read(json!({"attn_res_block_size": 8, "num_blocks": 1})).unwrap();
        assert_eq!(c.block_size(), Some(16));
        let c = read(json!({"attn_res_block_size": null, "num_blocks": 2})).unwrap();
        assert_eq!(c.num_blocks, 2);
        let c = read(json!({"attn_res_block_size": u64::MAX})).unwrap();
        assert_eq!((c.num_blocks, c.block_size(), c.attn_res_block_size), (1, Some(16), None));
        // 8 layers in blocks of 3: 3 blocks of 6, 6 and 4 sublayers; written back as given.
        let c = read(json!({"attn_res_block_size": 3})).unwrap();
        assert_eq!((c.num_blocks, c.block_size(), c.depth_sources()), (3, Some(6), 5));
        let v: Value = serde_json::from_str(&c.to_json()).unwrap();
        assert_eq!(
            (v["attn_res_block_size"].as_u64(), v["num_blocks"].as_u64()),
            (Some(3), Some(3))
        );
        assert_eq!(Config::from_json(&c.to_json()).unwrap(), c);
        let err = |extra| read(extra).unwrap_err().to_string();
        let e = err(json!({"attn_res_block_size": 3, "num_blocks": 2}));
        assert!(e.contains("disagrees") && e.contains("make 3 blocks"), "{e}");
        assert!(err(json!({"attn_res_block_size": 2, "num_blocks": 8})).contains("disagrees"));
        assert!(err(json!({"attn_res_block_size": 0})).contains("positive integer"));
        assert!(err(json!({"auto_map": 3})).contains("auto_map"));
        assert!(err(json!({"model_type": "mistral"})).contains("model_type"));
        // On the command line too, replacing the preset's block count.
        let c = Config::default().with_overrides(&["attn_res_block_size=4".into()]).unwrap();
        assert_eq!((c.num_blocks, c.block_size()), (2, Some(8)));
        let c = c.with_overrides(&["attn_res_block_size=5".into()]).unwrap();
        assert_eq!((c.num_blocks, c.block_size()), (2, Some(10)));
        let c = c.with_overrides(&["num_blocks=4".into()]).unwrap();
        assert_eq!((c.num_blocks, c.block_size(), c.attn_res_block_size), (4, Some(4), None));
    }

    #[test]
    fn divisors_of_small_and_large_counts() {
        assert_eq!(divisors(12), [1, 2, 3, 4, 6, 12]);
        assert_eq!(divisors(16), [1, 2, 4, 8, 16]);
        assert_eq!(divisors(1), [1]);
        // Large counts are factored by trial division up to the square root only.
        assert_eq!(divisors(2 * 1_000_000_007), [1, 2, 1_000_000_007, 2_000_000_014]);
    }

    #[test]
    fn accepts_a_transformers_written_config() {
        let text = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":100,
            "hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,"num_attention_heads":4,
            "num_key_value_heads":2,"max_position_embeddings":64,"rms_norm_eps":1e-5,
            "rope_parameters":{"rope_type":"default","rope_theta":500.0},"tie_word_embeddings":false,
            "transformers_version":"5.0.0","bos_token_id":1,"eos_token_id":2,"use_cache":true,"dtype":"float32"}"#;
        let c = Config::from_json(text).unwrap();
        assert_eq!((c.head_dim, c.rope_theta, c.residual), (8, 500.0, ResidualKind::Standard));
    }
}
