//! Named presets, embedded from `configs/*.toml` so the binary needs no files at run time.

use crate::model::Config;
use crate::train::config::RunConfig;
use anyhow::{bail, Context, Result};
use serde_json::{Map, Value};

pub const DEFAULT_PRESET: &str = "small";

const PRESETS: &[(&str, &str)] = &[
    ("tiny", include_str!("../../configs/tiny.toml")),
    ("small", include_str!("../../configs/small.toml")),
    ("compare", include_str!("../../configs/compare.toml")),
    ("compare-quick", include_str!("../../configs/compare-quick.toml")),
];

pub fn names() -> Vec<&'static str> {
    PRESETS.iter().map(|(n, _)| *n).collect()
}

/// The raw TOML of a preset.
pub fn text(name: &str) -> Result<&'static str> {
    match PRESETS.iter().find(|(n, _)| *n == name) {
        Some((_, t)) => Ok(t),
        None => bail!("unknown preset {name:?} (available: {})", names().join(", ")),
    }
}

/// Parses a TOML document with a `[model]` table (a preset or a user's config file) into a
/// model config laid over the defaults.
pub fn model_config_from_toml(text: &str, origin: &str) -> Result<Config> {
    let doc = crate::train::config::parse_toml(text, origin)?;
    let values = match doc.get("model") {
        None => Map::new(),
        Some(model) => match serde_json::to_value(model)? {
            Value::Object(m) => m,
            _ => bail!("{origin}: [model] must be a table"),
        },
    };
    Config::default().with_values(values).with_context(|| format!("in {origin}"))
}

/// The model config of a named preset.
pub fn model_config(name: &str) -> Result<Config> {
    model_config_from_toml(text(name)?, &format!("preset {name:?}"))
}

/// The full run settings (model and training) of a named preset.
pub fn run_config(name: &str) -> Result<RunConfig> {
    RunConfig::from_toml(text(name)?, &format!("preset {name:?}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_preset_parses_and_unknown_names_are_listed() {
        for n in super::names() {
            let r = super::run_config(n).unwrap();
            assert_eq!(r.model, super::model_config(n).unwrap());
            r.train.validate(&r.model).unwrap();
        }
        let e = super::model_config("huge").unwrap_err().to_string();
        assert!(e.contains("unknown preset") && e.contains("tiny"), "{e}");
    }
}
