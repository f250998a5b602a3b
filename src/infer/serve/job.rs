//! A request as the engine takes it, and what the engine tells the request back.

use super::logprobs::TokenLogprob;
use super::penalties::Penalties;
use crate::infer::generate::Sampling;
use crate::model::residual::DepthMap;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// Why a sequence stopped, in the API's words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The model ended the text, or a stop string appeared.
    Stop,
    /// `max_tokens` were generated.
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What the engine tells a request, in order: pieces of text, each token's log-probabilities
/// when asked for (before the text they make), then one `Done` (or `Failed`).
#[derive(Debug)]
pub enum Event {
    Text(String),
    Logprobs(Vec<TokenLogprob>),
    /// The depth-attention weights that made a token (before its text).
    Depth(DepthMap),
    Done {
        finish: Finish,
        usage: Usage,
    },
    Failed(String),
}

/// The tokens a sequence took.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// The prompt's first tokens that came from the prefix cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
}

/// One request as the engine runs it.
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub seed: u64,
    /// Text that ends the completion where it first appears (not included).
    pub stop: Vec<String>,
    /// The prompt's text, sent first when `echo` (its length in characters counts in the
    /// tokens' offsets either way).
    pub prompt_text: String,
    pub echo: bool,
    /// Report log-probabilities with this many alternatives per token; with `echo`, of the
    /// prompt's tokens too.
    pub logprobs: Option<usize>,
    /// Bias and penalties on the logits before sampling, when the request sets any.
    pub penalties: Option<Arc<Penalties>>,
    /// Report each token's depth-attention weights.
    pub depth: bool,
    /// Never end on the end-of-text token (`ignore_eos`): it is not sampled.
    pub ignore_eos: bool,
    /// Which of the request's `n` choices this is: its sampler's random stream, and the tag
    /// of its events (the choices of one request share one channel).
    pub choice: usize,
    pub events: UnboundedSender<(usize, Event)>,
    pub received: Instant,
}

impl Job {
    /// Whether the prompt's every token is scored (`echo` with `logprobs`): it needs their
    /// logits, so it is computed whole, neither using nor filling the prefix cache.
    pub(super) fn scores_prompt(&self) -> bool {
        self.echo && self.logprobs.is_some()
    }

    pub(super) fn send(&self, event: Event) {
        // A closed channel is a client that left; the engine notices at its next step.
        let _ = self.events.send((self.choice, event));
    }
}
