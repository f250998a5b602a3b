//! `config.json` read and written: the keys Hugging Face writes that are accepted (checked, then
//! dropped), `attn_res_block_size` as Kimi's and Megatron's configs count blocks, missing keys
//! filled from the defaults, `--set key=value` overrides, and the text an AttnRes checkpoint
//! writes for `transformers`.

use super::{
    Config, DepthGate, DepthQuery, ResidualKind, RopeParameters, ATTNRES_ARCHITECTURE,
    ATTNRES_MODEL_TYPE, AUTO_MAP, BLOCK_SIZE_IN_LAYERS,
};
use anyhow::{bail, ensure, Context, Result};
use serde_json::{Map, Value};

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
