//! The OpenAI API as this server speaks it: the request bodies, their checks against the
//! served model (unknown fields, ranges, the context's room), the completions endpoint, and the
//! error object every refusal is answered with; the chat endpoint's own parts are in
//! [`super::chat`].

use super::logprobs::MAX_COMPLETION_ALTERNATIVES;
use super::penalties::Penalties;
use crate::infer::generate::Sampling;
use crate::text::chat::ChatTemplate;
use crate::text::tokenizer::Bpe;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// What the checks of a request need to know of the model served.
pub(super) struct Served {
    pub(super) bpe: Arc<Bpe>,
    /// The model's name in the API.
    pub(super) name: String,
    /// The context length: prompt and new tokens together.
    pub(super) context: usize,
    /// The vocabulary size (token ids in a prompt are below it).
    pub(super) vocab: usize,
    /// The most choices (`n`) one request may ask for: all of them must fit in the queue.
    pub(super) max_choices: usize,
    /// The model's own chat template (an imported instruction model), else the plain one.
    pub(super) chat: Option<ChatTemplate>,
    /// The names of the depth attention's sources and consumers (an AttnRes model).
    pub(super) depth: Option<Arc<DepthLabels>>,
}

/// Names for the rows and columns of a token's depth map.
pub(super) struct DepthLabels {
    /// The model's distinct sources: `emb`, the blocks `b1`…, `partial`.
    pub(super) sources: Vec<String>,
    /// The sublayers (`0.attn`, `0.mlp`, …) and then `out`, the output aggregation.
    pub(super) consumers: Vec<String>,
}

/// An error response in the OpenAI shape.
pub(super) fn error(status: StatusCode, message: &str, param: Option<&str>) -> Response {
    let kind = match status {
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::NOT_FOUND => "not_found_error",
        s if s.is_server_error() => "server_error",
        _ => "invalid_request_error",
    };
    let body =
        json!({"error": {"message": message, "type": kind, "param": param, "code": Value::Null}});
    (status, axum::Json(body)).into_response()
}

/// A request that cannot be served as asked, with the field at fault.
pub(super) struct Invalid {
    pub(super) message: String,
    pub(super) param: Option<&'static str>,
    pub(super) status: StatusCode,
}

pub(super) fn invalid(param: &'static str, message: impl Into<String>) -> Invalid {
    Invalid { message: message.into(), param: Some(param), status: StatusCode::BAD_REQUEST }
}

/// `stop`: a string or a list of up to four.
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct StreamOptions {
    pub(super) include_usage: Option<bool>,
}

/// The fields both endpoints take. Fields of the OpenAI API that this server does not implement
/// are accepted only with their neutral values.
#[derive(Deserialize, Default)]
pub(super) struct Common {
    pub(super) model: Option<String>,
    pub(super) max_tokens: Option<i64>,
    pub(super) temperature: Option<f64>,
    pub(super) top_p: Option<f64>,
    pub(super) top_k: Option<i64>,
    pub(super) seed: Option<u64>,
    pub(super) stop: Option<Stop>,
    pub(super) stream: Option<bool>,
    pub(super) stream_options: Option<StreamOptions>,
    pub(super) n: Option<i64>,
    pub(super) frequency_penalty: Option<f64>,
    pub(super) presence_penalty: Option<f64>,
    pub(super) logit_bias: Option<serde_json::Map<String, Value>>,
    /// An extension (vLLM, llama.cpp): divides positive logits of tokens already in the prompt
    /// or the completion by it, multiplies negative ones.
    pub(super) repetition_penalty: Option<f64>,
    pub(super) logprobs: Option<Value>,
    pub(super) user: Option<String>,
    /// An extension: the depth-attention weights of every generated token.
    pub(super) attnres_depth: Option<bool>,
    /// An extension (llama.cpp, vLLM): never end on the end-of-text token; generation runs to
    /// `max_tokens` or a stop string.
    pub(super) ignore_eos: Option<bool>,
}

#[derive(Deserialize)]
pub(super) struct CompletionRequest {
    pub(super) prompt: Value,
    /// The newer name of `max_tokens`, which the API takes on both endpoints.
    pub(super) max_completion_tokens: Option<i64>,
    pub(super) echo: Option<bool>,
    pub(super) best_of: Option<i64>,
    pub(super) suffix: Option<String>,
    #[serde(flatten)]
    pub(super) common: Common,
    /// Every other field: refused by name ([`check_rest`]).
    #[serde(flatten)]
    pub(super) rest: serde_json::Map<String, Value>,
}

/// A field of the API this server does not implement: its name, whether a value is neutral
/// (accepted: it asks for nothing this server would do differently), and what any other value
/// would ask for.
pub(super) type Unimplemented = (&'static str, fn(&Value) -> bool, &'static str);

/// Refuses by name any field in `rest` but those of `known` with a neutral value.
pub(super) fn check_rest(
    rest: &serde_json::Map<String, Value>,
    known: &[Unimplemented],
) -> Result<(), Invalid> {
    for (name, value) in rest {
        let Some(&(param, neutral, what)) = known.iter().find(|k| k.0 == name) else {
            return Err(Invalid {
                message: format!("the request body is not a valid request: unknown field `{name}`"),
                param: None,
                status: StatusCode::BAD_REQUEST,
            });
        };
        if !neutral(value) {
            return Err(invalid(
                param,
                format!("{param} is not supported ({what}): this server only takes its neutral value, got {value}"),
            ));
        }
    }
    Ok(())
}

/// A request, checked and tokenized, ready for the engine.
pub(super) struct Prepared {
    pub(super) prompt: Vec<u32>,
    pub(super) max_tokens: usize,
    pub(super) sampling: Sampling,
    pub(super) seed: u64,
    pub(super) stop: Vec<String>,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    /// Completions to make of the prompt (`n`).
    pub(super) choices: usize,
    /// The prompt as text (sent back first with `echo`).
    pub(super) prompt_text: String,
    pub(super) echo: bool,
    /// Log-probabilities with this many alternatives per token.
    pub(super) logprobs: Option<usize>,
    pub(super) penalties: Option<Penalties>,
    /// The depth-attention weights of each generated token were asked for.
    pub(super) depth: bool,
    pub(super) ignore_eos: bool,
}

/// Parses a JSON body into `T`, naming the field at fault (unknown fields are errors).
pub(super) fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Invalid> {
    serde_json::from_slice(body).map_err(|e| Invalid {
        message: format!("the request body is not a valid request: {e}"),
        param: None,
        status: StatusCode::BAD_REQUEST,
    })
}

impl Common {
    /// Checks the settings and the prompt's room in the context; `default_max`: the
    /// endpoint's default for `max_tokens`.
    pub(super) fn prepare(
        self,
        model: &Served,
        prompt: Vec<u32>,
        default_max: Option<usize>,
        mut stop: Vec<String>,
        report: Report,
    ) -> Result<Prepared, Invalid> {
        if let Some(m) = &self.model {
            if *m != model.name {
                return Err(Invalid {
                    status: StatusCode::NOT_FOUND,
                    ..invalid(
                        "model",
                        format!("the model {m:?} does not exist here (it serves {:?})", model.name),
                    )
                });
            }
        }
        if prompt.is_empty() {
            return Err(invalid("prompt", "the prompt is empty"));
        }
        let choices = match self.n {
            None => 1,
            Some(n) if n >= 1 && n as usize <= model.max_choices => n as usize,
            Some(n) => {
                return Err(invalid(
                    "n",
                    format!("n must be between 1 and {} (--max-queue), got {n}", model.max_choices),
                ))
            }
        };
        let penalties = self.penalties(model.vocab)?;
        let _ = self.user;
        // With `echo`, `max_tokens: 0` asks for the prompt alone (scored, with `logprobs`).
        let prompt_only = report.echo && self.max_tokens == Some(0);
        let room = model.context + 1 - prompt.len().min(model.context + 1);
        if room == 0 {
            return Err(invalid(
                "prompt",
                format!(
                    "the prompt has {} tokens; the model's context is {} tokens",
                    prompt.len(),
                    model.context
                ),
            ));
        }
        let max_tokens = match self.max_tokens {
            Some(0) if prompt_only => 0,
            Some(m) if m < 1 => {
                return Err(invalid(
                    "max_tokens",
                    format!("max_tokens must be at least 1, got {m}"),
                ))
            }
            Some(m) => m as usize,
            None => default_max.unwrap_or(room).min(room),
        };
        if max_tokens > room {
            return Err(invalid(
                "max_tokens",
                format!(
                    "the prompt has {} tokens and max_tokens is {max_tokens}: together they need {} positions, beyond the model's context of {}",
                    prompt.len(),
                    prompt.len() + max_tokens - 1,
                    model.context
                ),
            ));
        }
        let top_k = match self.top_k {
            Some(k) if k < 1 => {
                return Err(invalid("top_k", format!("top_k must be at least 1, got {k}")))
            }
            k => k.map(|k| k as usize),
        };
        let sampling = Sampling {
            temperature: self.temperature.unwrap_or(1.0) as f32,
            top_k,
            top_p: self.top_p.map(|p| p as f32),
        };
        if let Err(e) = sampling.validate() {
            let param =
                if e.to_string().starts_with("temperature") { "temperature" } else { "top_p" };
            return Err(invalid(param, e.to_string()));
        }
        match self.stop {
            Some(Stop::One(s)) => stop.push(s),
            Some(Stop::Many(v)) if v.len() > 4 => {
                return Err(invalid("stop", format!("at most 4 stop strings, got {}", v.len())))
            }
            Some(Stop::Many(v)) => stop.extend(v),
            None => {}
        }
        if stop.iter().any(String::is_empty) {
            return Err(invalid("stop", "a stop string is empty"));
        }
        let depth = self.attnres_depth.unwrap_or(false);
        if depth && model.depth.is_none() {
            return Err(invalid(
                "attnres_depth",
                "attnres_depth needs an AttnRes model (Block or Full): this one has the standard \
                 residual, which has no depth attention",
            ));
        }
        let stream = self.stream.unwrap_or(false);
        let include_usage = self.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
        Ok(Prepared {
            prompt,
            max_tokens,
            sampling,
            seed: self.seed.unwrap_or_else(fresh_seed),
            stop,
            stream,
            include_usage,
            choices,
            prompt_text: report.prompt_text,
            echo: report.echo,
            logprobs: report.logprobs,
            penalties,
            depth,
            ignore_eos: self.ignore_eos.unwrap_or(false),
        })
    }

    /// The logit bias and penalties, checked (the API's ranges); `None` when all are neutral.
    fn penalties(&self, vocab: usize) -> Result<Option<Penalties>, Invalid> {
        let mut p = Penalties { repetition: 1.0, ..Default::default() };
        for (param, v, to) in [
            ("frequency_penalty", self.frequency_penalty, &mut p.frequency),
            ("presence_penalty", self.presence_penalty, &mut p.presence),
        ] {
            match v {
                Some(v) if !(-2.0..=2.0).contains(&v) => {
                    return Err(invalid(param, format!("{param} must be from -2 to 2, got {v}")))
                }
                Some(v) => *to = v as f32,
                None => {}
            }
        }
        match self.repetition_penalty {
            Some(r) if !(r > 0.0 && r <= 10.0) => {
                return Err(invalid(
                    "repetition_penalty",
                    format!("repetition_penalty must be above 0 and at most 10 (1: none), got {r}"),
                ))
            }
            Some(r) => p.repetition = r as f32,
            None => {}
        }
        for (k, v) in self.logit_bias.iter().flatten() {
            let id = k.parse::<u32>().ok().filter(|&t| (t as usize) < vocab);
            let Some(id) = id else {
                return Err(invalid(
                    "logit_bias",
                    format!("logit_bias keys are token ids below the vocabulary size {vocab}, got {k:?}"),
                ));
            };
            match v.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => p.bias.push((id, b as f32)),
                _ => {
                    return Err(invalid(
                        "logit_bias",
                        format!("logit_bias values are numbers from -100 to 100, got {v} for {k}"),
                    ))
                }
            }
        }
        Ok((!p.neutral()).then_some(p))
    }
}

/// A seed for a request that names none: different for every request (a process-wide counter
/// hashed with the process's random keys), so that sampled answers differ as clients expect.
fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static DRAWN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = DRAWN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(n);
    h.finish()
}

/// What a request asks to get back beyond the completion's text.
pub(super) struct Report {
    pub(super) prompt_text: String,
    pub(super) echo: bool,
    pub(super) logprobs: Option<usize>,
}

/// The completions API's `logprobs`: null, or the number of alternatives per token (0 to 5).
fn completion_logprobs(v: &Option<Value>) -> Result<Option<usize>, Invalid> {
    let max = MAX_COMPLETION_ALTERNATIVES;
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(k) if k as usize <= max => Ok(Some(k as usize)),
            _ => Err(invalid(
                "logprobs",
                format!("logprobs must be an integer from 0 to {max}, got {v}"),
            )),
        },
    }
}

pub(super) fn encode(model: &Served, text: &str, param: &'static str) -> Result<Vec<u32>, Invalid> {
    model
        .bpe
        .encode(text)
        .map_err(|e| invalid(param, format!("cannot tokenize the {param}: {e:#}")))
}

/// A `/v1/completions` body, checked and tokenized.
pub(super) fn prepare_completion(model: &Served, body: &[u8]) -> Result<Prepared, Invalid> {
    let mut r: CompletionRequest = parse(body)?;
    check_rest(&r.rest, &[])?;
    if r.common.max_tokens.is_none() {
        r.common.max_tokens = r.max_completion_tokens;
    }
    if r.best_of.is_some_and(|b| b != 1) {
        return Err(invalid("best_of", "best_of must be 1"));
    }
    if r.suffix.is_some() {
        return Err(invalid("suffix", "suffix is not supported"));
    }
    // A string, or token ids; a list of one of those.
    let one = match &r.prompt {
        Value::Array(a) if a.len() == 1 && (a[0].is_string() || a[0].is_array()) => &a[0],
        Value::Array(a) if a.len() > 1 && (a[0].is_string() || a[0].is_array()) => {
            return Err(invalid("prompt", "one prompt per request (send several requests)"))
        }
        p => p,
    };
    let (prompt, text) = match one {
        Value::String(s) => (encode(model, s, "prompt")?, s.clone()),
        Value::Array(ids) => {
            let vocab = model.vocab;
            let ids: Vec<u32> = ids
                .iter()
                .map(|v| v.as_u64().filter(|&t| t < vocab as u64).map(|t| t as u32))
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    invalid(
                        "prompt",
                        format!("token ids must be integers below the vocabulary size {vocab}"),
                    )
                })?;
            let text = model.bpe.decode(&ids).map_err(|e| invalid("prompt", format!("{e:#}")))?;
            (ids, text)
        }
        _ => return Err(invalid("prompt", "prompt must be a string or a list of token ids")),
    };
    let echo = r.echo.unwrap_or(false);
    let report =
        Report { prompt_text: text, echo, logprobs: completion_logprobs(&r.common.logprobs)? };
    r.common.prepare(model, prompt, Some(16), Vec::new(), report)
}
