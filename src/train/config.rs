//! A run's settings: the model ([`Config`]) and the training settings ([`TrainConfig`]), read
//! from TOML (a preset or the user's file) and changed by `key=value` overrides.

use super::optim::OptimConfig;
use crate::base::memory::{format_bytes, memory_limit};
use crate::model::Config;
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Training settings (the `[train]` table of a config file or preset).
// Unknown keys are caught by `overlay_train` (serde cannot deny them next to `flatten`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct TrainConfig {
    /// Tokens per training sequence (at most `max_position_embeddings`).
    pub seq_len: usize,
    /// Sequences per forward/backward pass.
    pub micro_batch: usize,
    /// Tokens per optimiser step; a multiple of `micro_batch · seq_len` (the rest is gradient
    /// accumulation).
    pub batch_tokens: usize,
    /// Training budget in tokens; the run takes `max_tokens / batch_tokens` steps.
    pub max_tokens: u64,
    /// Validate every this many steps (and at the end).
    pub eval_every: usize,
    /// Validation tokens per evaluation (0: the whole validation split).
    pub eval_tokens: usize,
    /// Write a resumable checkpoint every this many steps (and at the end).
    pub checkpoint_every: usize,
    /// Seed of the initialisation and of the data order.
    pub seed: u64,
    /// Activation recomputation: forward keeps only each sublayer's input, and backward
    /// recomputes the sublayer's work from it. The same gradients, bit for bit, for less memory
    /// and more time, since each sublayer runs forward twice (docs/performance.md#memory).
    #[serde(default)]
    pub recompute: bool,
    #[serde(flatten)]
    pub optim: OptimConfig,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            seq_len: 256,
            micro_batch: 8,
            batch_tokens: 16384,
            max_tokens: 1_000_000,
            eval_every: 20,
            eval_tokens: 65536,
            checkpoint_every: 50,
            seed: 0,
            recompute: false,
            optim: OptimConfig::default(),
        }
    }
}

impl TrainConfig {
    pub fn steps(&self) -> usize {
        (self.max_tokens / self.batch_tokens as u64) as usize
    }

    pub fn accumulation(&self) -> usize {
        self.batch_tokens / (self.micro_batch * self.seq_len)
    }

    /// An upper estimate of the memory a training step takes, in bytes, computed with overflow
    /// checks (`None`: beyond 128 bits). Six f32 copies of the parameters (weights, the step's
    /// gradient and a micro-batch's, the Adam moments, Muon's momentum), and per token of a
    /// micro-batch what the forward pass keeps for backward: per layer the inputs, norms and
    /// q/k/v, two softmax statistics per attention head, the MLP's three projections; the
    /// depth sources of every sublayer; the logits and their gradient; backward's buffers —
    /// (with `recompute`, per layer only its two sublayer inputs, and one layer's work) —
    /// times 3/2 for the gradients backward holds beside them. An upper bound: every buffer is
    /// counted at its largest, so runs peak below it (docs/training.md).
    pub fn step_bytes(&self, model: &Config) -> Option<u128> {
        let n = |x: usize| x as u128;
        let (d, f, l) =
            (n(model.hidden_size), n(model.intermediate_size), n(model.num_hidden_layers));
        let qd = n(model.num_attention_heads).checked_mul(n(model.head_dim))?;
        let kvd = n(model.num_key_value_heads).checked_mul(n(model.head_dim))?;
        let softmax_stats = n(model.num_attention_heads).checked_mul(2)?;
        let layer = d
            .checked_mul(4)?
            .checked_add(qd.checked_mul(2)?)?
            .checked_add(kvd.checked_mul(2)?)?
            .checked_add(softmax_stats)?
            .checked_add(f.checked_mul(3)?)?
            .checked_add(2)?;
        let sources = l.checked_mul(2)?.checked_add(2)?.checked_mul(d)?;
        // With recompute, each layer keeps its two sublayer inputs, and one layer at a time
        // its whole work (recomputed in backward).
        let layers = match self.recompute {
            true => l.checked_mul(d)?.checked_mul(2)?.checked_add(layer)?,
            false => l.checked_mul(layer)?,
        };
        let per_token = layers
            .checked_add(sources)?
            .checked_add(n(model.vocab_size).checked_mul(2)?)?
            .checked_add(d.checked_add(f)?.checked_mul(4)?)?;
        let tokens = n(self.micro_batch).checked_mul(n(self.seq_len))?;
        let params = model.param_count()?.checked_mul(6)?;
        let activations = tokens.checked_mul(per_token)?.checked_mul(3)? / 2;
        activations.checked_add(params)?.checked_mul(4)
    }

    /// Refuses settings whose training step would not fit in `limit` bytes, before anything is
    /// allocated.
    pub fn check_memory(&self, model: &Config, limit: u64) -> Result<()> {
        let Some(bytes) = self.step_bytes(model) else {
            bail!(
                "train: the memory of a training step overflows (micro_batch = {}, seq_len = {})",
                self.micro_batch,
                self.seq_len
            )
        };
        ensure!(
            bytes <= limit as u128,
            "train: a training step needs about {} (micro_batch = {} x seq_len = {} tokens at once, \
             and the model's weights, gradients and optimiser state); at most {} (the machine's \
             memory) is allowed: lower micro_batch or seq_len{}",
            format_bytes(bytes),
            self.micro_batch,
            self.seq_len,
            format_bytes(limit as u128),
            if self.recompute { "" } else { ", or set recompute=true" }
        );
        Ok(())
    }

    pub fn validate(&self, model: &Config) -> Result<()> {
        for (k, v) in [
            ("seq_len", self.seq_len),
            ("micro_batch", self.micro_batch),
            ("batch_tokens", self.batch_tokens),
            ("eval_every", self.eval_every),
            ("checkpoint_every", self.checkpoint_every),
        ] {
            ensure!(v > 0, "train: {k} must be positive, got {v}");
        }
        ensure!(
            self.seq_len <= model.max_position_embeddings,
            "train: seq_len = {} exceeds the model's max_position_embeddings = {}",
            self.seq_len,
            model.max_position_embeddings
        );
        let Some(per) = self.micro_batch.checked_mul(self.seq_len) else {
            bail!(
                "train: micro_batch x seq_len overflows ({} x {})",
                self.micro_batch,
                self.seq_len
            )
        };
        ensure!(
            self.batch_tokens.is_multiple_of(per),
            "train: batch_tokens = {} must be a multiple of micro_batch x seq_len = {per}",
            self.batch_tokens
        );
        ensure!(
            self.steps() > 0,
            "train: max_tokens = {} is less than one batch of {} tokens",
            self.max_tokens,
            self.batch_tokens
        );
        self.check_memory(model, memory_limit())?;
        let o = &self.optim;
        for (k, v) in [
            ("lr", o.lr),
            ("weight_decay", o.weight_decay),
            ("grad_clip", o.grad_clip),
            ("adam_eps", o.adam_eps),
        ] {
            ensure!(
                v.is_finite() && v >= 0.0,
                "train: {k} must be a finite non-negative number, got {v}"
            );
        }
        ensure!(o.lr > 0.0, "train: lr must be positive, got {}", o.lr);
        for (k, v) in [
            ("beta1", o.beta1),
            ("beta2", o.beta2),
            ("muon_momentum", o.muon_momentum),
            ("min_lr_ratio", o.min_lr_ratio),
            ("decay_fraction", o.decay_fraction),
        ] {
            ensure!((0.0..=1.0).contains(&v), "train: {k} must lie in [0, 1], got {v}");
        }
        Ok(())
    }
}

/// A full run description: the model and the training settings.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    pub model: Config,
    pub train: TrainConfig,
}

/// A TOML document as a table; an error is one line naming `origin`, the line and column and
/// what is wrong there (the parser's own message spans several lines).
pub fn parse_toml(text: &str, origin: &str) -> Result<toml::Table> {
    toml::from_str(text).map_err(|e| {
        let at = e.span().map_or(String::new(), |span| {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            format!(" at line {line}, column {column}")
        });
        anyhow::anyhow!("{origin}: invalid TOML{at}: {}", e.message().trim().replace('\n', "; "))
    })
}

impl RunConfig {
    /// Parses a TOML document with `[model]` and `[train]` tables laid over the defaults.
    pub fn from_toml(text: &str, origin: &str) -> Result<RunConfig> {
        let doc = parse_toml(text, origin)?;
        for k in doc.keys() {
            ensure!(
                k == "model" || k == "train",
                "{origin}: unknown table [{k}] (expected [model] and [train])"
            );
        }
        let table = |name: &str| -> Result<Map<String, Value>> {
            match doc.get(name).map(serde_json::to_value).transpose()? {
                None => Ok(Map::new()),
                Some(Value::Object(m)) => Ok(m),
                Some(_) => bail!("{origin}: [{name}] must be a table"),
            }
        };
        let model = Config::default()
            .with_values(table("model")?)
            .with_context(|| format!("in {origin}"))?;
        let train = overlay_train(&TrainConfig::default(), table("train")?)
            .with_context(|| format!("in {origin} [train]"))?;
        Ok(RunConfig { model, train })
    }

    /// Reads settings saved by an earlier run (the `run` of a checkpoint's `train_state.json`)
    /// exactly as user input: unknown keys, ill-typed and invalid values are errors naming the
    /// key; keys added since the run was saved take their built-in defaults.
    pub fn from_saved(saved: &Value) -> Result<RunConfig> {
        let Value::Object(doc) = saved else { bail!("run settings must be an object") };
        for k in doc.keys() {
            ensure!(
                k == "model" || k == "train",
                "unknown run key {k:?} (expected model and train)"
            );
        }
        let table = |name: &str| -> Result<Map<String, Value>> {
            match doc.get(name) {
                Some(Value::Object(m)) => Ok(m.clone()),
                Some(_) => bail!("run.{name} must be an object"),
                None => bail!("run.{name} is missing"),
            }
        };
        let model = Config::default().with_values(table("model")?).context("run.model")?;
        let train = overlay_train(&TrainConfig::default(), table("train")?).context("run.train")?;
        train.validate(&model).context("run.train")?;
        Ok(RunConfig { model, train })
    }

    /// The first setting in which `self` and `other` differ, with both values, ignoring
    /// `vocab_size` (which follows the tokenizer, not the request) and `recompute` (which
    /// changes what a step keeps, not what it computes).
    pub fn first_difference(&self, other: &RunConfig) -> Result<Option<(String, Value, Value)>> {
        let (mut a, mut b) = (serde_json::to_value(self)?, serde_json::to_value(other)?);
        for v in [&mut a, &mut b] {
            v["model"]["vocab_size"] = Value::Null;
            v["train"]["recompute"] = Value::Null;
        }
        Ok(first_difference(&a, &b, "").map(|k| {
            let (x, y) = (lookup(&a, &k), lookup(&b, &k));
            (k, x, y)
        }))
    }

    /// Applies `key=value` overrides; each key must name a model or a training setting.
    pub fn with_overrides(&self, sets: &[String]) -> Result<RunConfig> {
        let train_keys = match serde_json::to_value(&self.train)? {
            Value::Object(m) => m,
            _ => unreachable!(),
        };
        let model_keys = self.model.keys();
        let (mut model_sets, mut train_sets) = (Vec::new(), Map::new());
        for s in sets {
            let (k, v) =
                s.split_once('=').with_context(|| format!("--set {s:?}: expected key=value"))?;
            let k = k.trim();
            if model_keys.iter().any(|m| m == k) {
                model_sets.push(s.clone());
            } else if train_keys.contains_key(k) {
                let v = serde_json::from_str(v.trim())
                    .unwrap_or_else(|_| Value::String(v.trim().to_string()));
                train_sets.insert(k.to_string(), v);
            } else {
                bail!(
                    "--set {k}: unknown setting (model keys: {}; training keys: {})",
                    model_keys.join(", "),
                    train_keys.keys().cloned().collect::<Vec<_>>().join(", ")
                );
            }
        }
        let model = self.model.with_overrides(&model_sets)?;
        let train = overlay_train(&self.train, train_sets).context("--set")?;
        // Checked here, before any data is read or tokenizer trained.
        train.validate(&model)?;
        Ok(RunConfig { model, train })
    }
}

fn overlay_train(base: &TrainConfig, values: Map<String, Value>) -> Result<TrainConfig> {
    let Value::Object(mut map) = serde_json::to_value(base)? else { unreachable!() };
    for (k, v) in values {
        let Some(old) = map.get(&k) else { bail!("unknown training key {k:?}") };
        crate::model::config::json::same_kind(old, &v)
            .map_err(|want| anyhow::anyhow!("training key {k} must be {want}, got {v}"))?;
        map.insert(k, v);
    }
    serde_json::from_value(Value::Object(map)).map_err(|e| anyhow::anyhow!("{e}"))
}

/// The dotted path of the first key (in sorted order) at which two JSON values differ.
pub fn first_difference(a: &Value, b: &Value, path: &str) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                first_difference(
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    &p,
                )
            })
        }
        _ if a == b => None,
        _ => Some(path.to_string()),
    }
}

/// The value at a dotted path (null where there is none).
pub fn lookup(v: &Value, path: &str) -> Value {
    path.split('.').fold(v.clone(), |v, k| v.get(k).cloned().unwrap_or(Value::Null))
}
