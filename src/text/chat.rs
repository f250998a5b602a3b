//! Chat prompts for imported instruction models (`generate --chat`): the model's own chat
//! template (Jinja, from `tokenizer_config.json` or `chat_template.jinja`, as Hugging Face keeps
//! it) rendered with `minijinja` over the conversation.

use anyhow::{anyhow, Context, Result};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::Path;

/// The chat template of a model directory and the special tokens it may refer to.
pub struct ChatTemplate {
    pub source: String,
    pub bos_token: String,
    pub eos_token: String,
}

fn token_name(v: &Json) -> String {
    match v {
        Json::String(s) => s.clone(),
        Json::Object(o) => o.get("content").and_then(Json::as_str).unwrap_or("").to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// Reads the template of `dir`: `chat_template.jinja`, else `chat_template` in
    /// `tokenizer_config.json` (a string, or a list of named templates: the one named
    /// `default`).
    pub fn load(dir: &Path) -> Result<ChatTemplate> {
        Self::find(dir)?.with_context(|| {
            format!(
                "{} has no chat template (chat_template in tokenizer_config.json or chat_template.jinja): --chat needs an instruction model's directory",
                dir.display()
            )
        })
    }

    /// The template of `dir` as [`Self::load`] reads it, or `None` when the directory has none
    /// (a model trained here).
    pub fn find(dir: &Path) -> Result<Option<ChatTemplate>> {
        let cpath = dir.join("tokenizer_config.json");
        let config: Json = if cpath.exists() {
            serde_json::from_str(&crate::base::fs::read_utf8(&cpath)?)
                .with_context(|| format!("{} is not valid JSON", cpath.display()))?
        } else {
            Json::Null
        };
        let jpath = dir.join("chat_template.jinja");
        let source = if jpath.exists() {
            crate::base::fs::read_utf8(&jpath)?
        } else {
            match &config["chat_template"] {
                Json::String(s) => s.clone(),
                Json::Array(list) => list
                    .iter()
                    .find(|t| t["name"] == "default")
                    .and_then(|t| t["template"].as_str())
                    .map(str::to_string)
                    .with_context(|| {
                        format!("{}: no chat template named default", cpath.display())
                    })?,
                _ => return Ok(None),
            }
        };
        Ok(Some(ChatTemplate {
            source,
            bos_token: token_name(&config["bos_token"]),
            eos_token: token_name(&config["eos_token"]),
        }))
    }

    /// The prompt for a conversation of (role, content) messages, ending where the assistant's
    /// answer begins.
    pub fn render(&self, messages: &[(&str, &str)]) -> Result<String> {
        let mut env = Environment::new();
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        let template =
            env.template_from_str(&self.source).map_err(|e| anyhow!("chat template: {e}"))?;
        let messages: Vec<Value> = messages
            .iter()
            .map(|(role, content)| {
                Value::from(BTreeMap::from([
                    ("role".to_string(), Value::from(*role)),
                    ("content".to_string(), Value::from(*content)),
                ]))
            })
            .collect();
        let ctx = BTreeMap::from([
            ("messages".to_string(), Value::from(messages)),
            ("add_generation_prompt".to_string(), Value::from(true)),
            ("bos_token".to_string(), Value::from(self.bos_token.as_str())),
            ("eos_token".to_string(), Value::from(self.eos_token.as_str())),
        ]);
        template.render(Value::from(ctx)).map_err(|e| anyhow!("chat template: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate { source: source.into(), bos_token: "<s>".into(), eos_token: "</s>".into() }
    }

    #[test]
    fn renders_smollm2s_template_as_transformers_does() {
        let t = template(SMOLLM2);
        assert_eq!(
            t.render(&[("user", "Hi?")]).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.render(&[("system", "Be brief."), ("user", "Hi?")]).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn special_tokens_and_exceptions_reach_the_template() {
        let t = template("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}[INST] {{ messages[0]['content'] }} [/INST]");
        assert_eq!(t.render(&[("user", "x")]).unwrap(), "<s>[INST] x [/INST]");
        let e = t.render(&[("system", "x")]).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
        assert!(template("{% if %}")
            .render(&[])
            .unwrap_err()
            .to_string()
            .contains("chat template"));
    }
}
