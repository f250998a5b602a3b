//! The chat API: its request, the messages and their content parts, the chat template that turns
//! them into a prompt, and the fields of the API this server does not implement.

use super::api::{
    check_rest, encode, invalid, parse, Common, Invalid, Prepared, Report, Served, Unimplemented,
};
use super::logprobs::MAX_CHAT_ALTERNATIVES;
use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize)]
pub(super) struct ChatRequest {
    pub(super) messages: Vec<Message>,
    pub(super) max_completion_tokens: Option<i64>,
    pub(super) top_logprobs: Option<i64>,
    #[serde(flatten)]
    pub(super) common: Common,
    /// The chat API's fields this server does not implement ([`CHAT_UNSUPPORTED`]) and any
    /// unknown one ([`check_rest`]).
    #[serde(flatten)]
    pub(super) rest: serde_json::Map<String, Value>,
}

/// The chat API's fields that this server does not implement, each with whether a value is
/// neutral (accepted: it asks for nothing this server would do differently) and why any other
/// is refused. docs/serving.md lists them.
const CHAT_UNSUPPORTED: &[Unimplemented] = &[
    ("tools", |v| v.is_null() || v.as_array().is_some_and(Vec::is_empty), "tool calling"),
    ("tool_choice", |v| v.is_null() || v == "none", "tool calling"),
    ("parallel_tool_calls", |v| v.is_null() || v.is_boolean(), "tool calling"),
    ("functions", |v| v.is_null() || v.as_array().is_some_and(Vec::is_empty), "function calling"),
    ("function_call", |v| v.is_null() || v == "none", "function calling"),
    ("response_format", |v| v.is_null() || v["type"] == "text", "structured output"),
    ("modalities", |v| v.is_null() || *v == serde_json::json!(["text"]), "output other than text"),
    ("audio", Value::is_null, "audio output"),
    ("prediction", Value::is_null, "predicted outputs"),
    ("web_search_options", Value::is_null, "web search"),
    ("reasoning_effort", Value::is_null, "reasoning settings"),
    ("verbosity", Value::is_null, "verbosity settings"),
    ("moderation", Value::is_null, "moderation"),
    ("store", |v| v.is_null() || *v == false, "storing completions"),
    ("service_tier", |v| v.is_null() || v == "auto" || v == "default", "service tiers"),
    // Hints and labels that change nothing here: accepted and ignored.
    ("metadata", |_| true, ""),
    ("prompt_cache_key", |_| true, ""),
    ("prompt_cache_retention", |_| true, ""),
    ("prompt_cache_options", |_| true, ""),
    ("safety_identifier", |_| true, ""),
];

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Message {
    pub(super) role: String,
    /// A string, or an array of text parts (`{"type": "text", "text": ...}`).
    #[serde(default)]
    pub(super) content: Value,
    pub(super) name: Option<String>,
}

impl Message {
    /// The message's text: its content when a string, its text parts joined by newlines when
    /// an array (as vLLM joins them). Any other part (an image, audio, a file) is refused by
    /// its type; `index` is the message's place, for the error.
    fn text(&self, index: usize) -> Result<String, Invalid> {
        let at = format!("messages[{index}].content");
        match &self.content {
            Value::String(s) => Ok(s.clone()),
            Value::Array(parts) => {
                let mut texts = Vec::with_capacity(parts.len());
                for (j, part) in parts.iter().enumerate() {
                    texts.push(text_part(part, &format!("{at}[{j}]"))?);
                }
                Ok(texts.join("\n"))
            }
            Value::Null => Err(invalid(
                "messages",
                format!("{at} is missing or null (tool calls are not supported)"),
            )),
            v => Err(invalid(
                "messages",
                format!("{at} must be a string or an array of text parts, got {v}"),
            )),
        }
    }
}

/// The text of a content part `{"type": "text", "text": ...}`; an error naming the part (at
/// `at`) for any other.
fn text_part<'a>(part: &'a Value, at: &str) -> Result<&'a str, Invalid> {
    let refuse = |why: String| Err(invalid("messages", format!("{at} {why}")));
    let Some(fields) = part.as_object() else {
        return refuse(format!("must be an object with a type, got {part}"));
    };
    match fields.get("type").and_then(Value::as_str) {
        Some("text") => {}
        Some(kind) => {
            return refuse(format!(
                "is a part of type {kind:?}, which this server does not take: it reads text \
                 parts only (type \"text\")"
            ))
        }
        None => return refuse("has no type (\"text\" for a text part)".into()),
    }
    if let Some(k) = fields.keys().find(|k| !["type", "text"].contains(&k.as_str())) {
        return refuse(format!("has an unknown field {k:?} (a text part has type and text)"));
    }
    match fields.get("text").and_then(Value::as_str) {
        Some(t) => Ok(t),
        None => refuse("is a text part without a string text".into()),
    }
}

/// The chat API's `logprobs` (true or false) and `top_logprobs` (0 to 20, with logprobs).
fn chat_logprobs(v: &Option<Value>, top: Option<i64>) -> Result<Option<usize>, Invalid> {
    let on = match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(v) => {
            return Err(invalid("logprobs", format!("logprobs must be true or false, got {v}")))
        }
    };
    let max = MAX_CHAT_ALTERNATIVES as i64;
    match top {
        Some(k) if !(0..=max).contains(&k) => {
            Err(invalid("top_logprobs", format!("top_logprobs must be from 0 to {max}, got {k}")))
        }
        Some(_) if !on => Err(invalid("top_logprobs", "top_logprobs needs logprobs: true")),
        k => Ok(on.then_some(k.unwrap_or(0) as usize)),
    }
}

/// The prompt of a conversation and the stop strings it needs: the model's own chat template
/// when it has one (its end-of-turn token ends the reply), else the plain template: system
/// messages first as they are, then each turn as `User: …` / `Assistant: …` on its own line,
/// ending with `Assistant:` for the reply, which stops where the model starts the next user
/// turn.
pub(super) fn chat_prompt(
    model: &Served,
    messages: &[Message],
) -> Result<(String, Vec<String>), Invalid> {
    if messages.is_empty() {
        return Err(invalid("messages", "messages is empty"));
    }
    if let Some(r) = messages
        .iter()
        .map(|m| m.role.as_str())
        .find(|r| !["system", "developer", "user", "assistant"].contains(r))
    {
        return Err(invalid("messages", format!("unknown role {r:?} (system, user or assistant)")));
    }
    let texts: Vec<String> =
        messages.iter().enumerate().map(|(i, m)| m.text(i)).collect::<Result<_, _>>()?;
    if let Some(t) = &model.chat {
        let turns: Vec<(&str, &str)> =
            messages.iter().zip(&texts).map(|(m, t)| (m.role.as_str(), t.as_str())).collect();
        let text = t.render(&turns).map_err(|e| invalid("messages", format!("{e:#}")))?;
        return Ok((text, Vec::new()));
    }
    let mut text = String::new();
    for (m, content) in messages.iter().zip(&texts) {
        let _ = &m.name;
        match m.role.as_str() {
            "system" | "developer" => {
                text.push_str(content);
                text.push_str("\n\n");
            }
            "user" => text.push_str(&format!("User: {content}\n")),
            _ => text.push_str(&format!("Assistant: {content}\n")),
        }
    }
    text.push_str("Assistant:");
    Ok((text, vec![CHAT_STOP.to_string()]))
}

/// The stop string of the plain chat template.
pub(super) const CHAT_STOP: &str = "\nUser:";

/// A `/v1/chat/completions` body, checked, put into the chat template and tokenized.
pub(super) fn prepare_chat(model: &Served, body: &[u8]) -> Result<Prepared, Invalid> {
    let mut r: ChatRequest = parse(body)?;
    check_rest(&r.rest, CHAT_UNSUPPORTED)?;
    if r.common.max_tokens.is_none() {
        r.common.max_tokens = r.max_completion_tokens;
    }
    let logprobs = chat_logprobs(&r.common.logprobs, r.top_logprobs)?;
    let (text, stop) = chat_prompt(model, &r.messages)?;
    let prompt = encode(model, &text, "messages")?;
    let report = Report { prompt_text: text, echo: false, logprobs };
    r.common.prepare(model, prompt, None, stop, report)
}
