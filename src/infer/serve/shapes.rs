//! The response objects of the API: a whole completion or chat completion, the chunks of a
//! streamed one, and the usage that closes it, with the log-probabilities and depth maps a
//! request asked for beside its text.

use super::api::DepthLabels;
use super::job::Finish;
use super::logprobs::{self, TokenLogprob};
use crate::model::residual::DepthMap;
use serde_json::{json, Value};
use std::sync::Arc;

/// Which endpoint a request came to.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Kind {
    Completion,
    Chat,
}

/// The response objects of one request.
pub(super) struct Shape {
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) kind: Kind,
    /// Whether the request asked for log-probabilities.
    pub(super) logprobs: bool,
    /// The depth map's labels, when the request asked for depth maps.
    pub(super) depth: Option<Arc<DepthLabels>>,
}

/// What goes beside the text of a choice's tokens, when asked for.
#[derive(Clone, Default)]
pub(super) struct PerToken {
    pub(super) logprobs: Vec<TokenLogprob>,
    pub(super) depth: Vec<DepthMap>,
}

impl Shape {
    /// A choice's `logprobs` field: null unless asked for.
    fn logprobs(&self, entries: &[TokenLogprob]) -> Value {
        match (self.logprobs, self.kind) {
            (false, _) => Value::Null,
            (true, Kind::Completion) => logprobs::completion_object(entries),
            (true, Kind::Chat) => logprobs::chat_object(entries),
        }
    }

    /// A choice's `attnres_depth` field, when asked for: the labels, and the depth map of each
    /// token (weights to 4 decimals, null for a source a consumer does not read).
    fn add_depth(&self, choice: &mut Value, maps: &[DepthMap]) {
        let Some(labels) = &self.depth else { return };
        let round = |w: &Option<f32>| w.map(|w| (w as f64 * 1e4).round() / 1e4);
        let maps: Vec<Vec<Vec<Option<f64>>>> = maps
            .iter()
            .map(|m| m.iter().map(|row| row.iter().map(round).collect()).collect())
            .collect();
        choice["attnres_depth"] =
            json!({"sources": labels.sources, "consumers": labels.consumers, "tokens": maps});
    }

    pub(super) fn whole(
        &self,
        texts: &[String],
        tokens: &[PerToken],
        finish: &[Option<Finish>],
        usage: Value,
    ) -> Value {
        let choices = texts
            .iter()
            .zip(finish)
            .zip(tokens)
            .enumerate()
            .map(|(index, ((text, finish), t))| {
                let (finish, lp) = (finish.map(Finish::as_str), self.logprobs(&t.logprobs));
                let mut choice = match self.kind {
                    Kind::Completion => {
                        json!({"index": index, "text": text, "logprobs": lp, "finish_reason": finish})
                    }
                    Kind::Chat => {
                        json!({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": finish})
                    }
                };
                self.add_depth(&mut choice, &t.depth);
                choice
            })
            .collect::<Vec<_>>();
        let object = if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices, "usage": usage})
    }

    pub(super) fn chunk(
        &self,
        index: usize,
        text: Option<&str>,
        tokens: &PerToken,
        finish: Option<Finish>,
        first: &mut bool,
    ) -> Value {
        let finish = finish.map(Finish::as_str);
        let lp = self.logprobs(&tokens.logprobs);
        let mut choice = match self.kind {
            Kind::Completion => {
                json!({"index": index, "text": text.unwrap_or(""), "logprobs": lp, "finish_reason": finish})
            }
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if std::mem::take(first) {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish})
            }
        };
        self.add_depth(&mut choice, &tokens.depth);
        self.envelope(vec![choice], None)
    }

    pub(super) fn usage_chunk(&self, usage: Value) -> Value {
        self.envelope(Vec::new(), Some(usage))
    }

    fn envelope(&self, choices: Vec<Value>, usage: Option<Value>) -> Value {
        let object =
            if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        let mut v = json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }
}
