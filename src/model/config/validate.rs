//! The checks of every config value, and the bound on the model's size.

use super::{
    Config, DepthGate, DepthQuery, ResidualKind, ATTNRES_MODEL_TYPE, MAX_RMS_NORM_EPS,
    MAX_ROPE_THETA,
};
use crate::base::memory::{format_bytes, memory_limit};
use anyhow::{bail, ensure, Result};

impl Config {
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

    /// The number of parameters the config implies (what [`crate::model::params::Layout`] lays out),
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
}

fn join(values: &[usize]) -> String {
    values.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")
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

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn divisors_of_small_and_large_counts() {
        assert_eq!(divisors(12), [1, 2, 3, 4, 6, 12]);
        assert_eq!(divisors(16), [1, 2, 4, 8, 16]);
        assert_eq!(divisors(1), [1]);
        // Large counts are factored by trial division up to the square root only.
        assert_eq!(divisors(2 * 1_000_000_007), [1, 2, 1_000_000_007, 2_000_000_014]);
    }
}
