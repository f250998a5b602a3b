//! A sequence in the engine's batch, apart from the scheduling: its sampler and penalties, the
//! text of its tokens as they come (detokenised as `generate` does, held back where it could
//! start a stop string), its log-probability entries and depth maps, and how it ends.

use super::job::{Event, Finish, Job, Usage};
use super::logprobs::{score, Token, TokenLogprob};
use super::metrics::Metrics;
use super::penalties::{History, Penalties};
use crate::infer::generate::{Sampler, TextStream};
use crate::model::residual::DepthMap;
use crate::text::tokenizer::Bpe;
use anyhow::Result;
use std::sync::Arc;
use std::time::Instant;

/// A sequence in the batch.
pub(super) struct Sequence {
    pub(super) job: Job,
    pub(super) slot: usize,
    pub(super) sampler: Sampler,
    /// Tokens generated; the last one is fed in the next step.
    pub(super) generated: Vec<u32>,
    /// Whether the prompt is still to be prefilled.
    pub(super) prefill: bool,
    /// The prompt's first tokens that came from the prefix cache (not prefilled).
    pub(super) cached: usize,
    /// The completion's text so far, and how much of it was sent (text that could be the
    /// start of a stop string is held back).
    pub(super) text: String,
    pub(super) sent: usize,
    /// The text of the tokens as they come (the decoder `generate` streams with).
    pub(super) stream: TextStream<Arc<Bpe>>,
    /// The token before the next (the prompt's last, then the last generated).
    pub(super) last: Option<u32>,
    pub(super) first_token: Option<Instant>,
    /// Where the next token's text starts, in characters of prompt and completion together.
    pub(super) offset: usize,
    /// The request's bias and penalties, with the history they count, when it has any.
    pub(super) penalties: Option<(Arc<Penalties>, History)>,
}

impl Sequence {
    /// A request admitted into cache slot `slot`, whose first `cached` prompt tokens came from
    /// the prefix cache.
    pub(super) fn start(job: Job, slot: usize, cached: usize, bpe: &Arc<Bpe>) -> Result<Sequence> {
        let sampler = Sampler::new(job.sampling, job.seed, job.choice as u64)?;
        let offset = if job.echo { 0 } else { job.prompt_text.chars().count() };
        let penalties = job.penalties.clone().map(|p| (p, History::new(&job.prompt)));
        let last = job.prompt.last().copied();
        let stream = TextStream::new(bpe.clone()).after(last);
        Ok(Sequence {
            job,
            slot,
            sampler,
            generated: Vec::new(),
            prefill: true,
            cached,
            text: String::new(),
            sent: 0,
            stream,
            last,
            first_token: None,
            offset,
            penalties,
        })
    }

    /// Samples the next token from `logits` (the tokenizer's ids of the row) after the
    /// request's bias and penalties, and sends what the request asked to see of it beside its
    /// text (its depth map `map`, its log-probabilities).
    pub(super) fn sample(&mut self, logits: &[f32], map: Option<DepthMap>, bpe: &Bpe) -> u32 {
        let ignore_eos = self.job.ignore_eos && (bpe.eot as usize) < logits.len();
        let tok = if self.penalties.is_some() || ignore_eos {
            let mut adjusted = logits.to_vec();
            if let Some((p, h)) = &self.penalties {
                h.apply(p, &mut adjusted);
            }
            if ignore_eos {
                adjusted[bpe.eot as usize] = f32::NEG_INFINITY;
            }
            self.sampler.sample(&adjusted)
        } else {
            self.sampler.sample(logits)
        };
        if let Some((_, h)) = &mut self.penalties {
            h.push(tok);
        }
        if let (Some(map), true) = (map, tok != bpe.eot) {
            self.job.send(Event::Depth(map));
        }
        if let (Some(k), true) = (self.job.logprobs, tok != bpe.eot) {
            let entry = self.entry(logits, self.last, tok, k, bpe);
            self.job.send(Event::Logprobs(vec![entry]));
        }
        self.last = Some(tok);
        self.generated.push(tok);
        tok
    }

    pub(super) fn scores_prompt(&self) -> bool {
        self.prefill && self.job.scores_prompt()
    }

    /// The entry of token `tok` drawn from `logits` after token `after`, advancing the offset.
    fn entry(
        &mut self,
        logits: &[f32],
        after: Option<u32>,
        tok: u32,
        k: usize,
        bpe: &Bpe,
    ) -> TokenLogprob {
        let (lp, top) = score(logits, tok, k);
        let token = Token::new(bpe, after, tok);
        let offset = self.offset;
        self.offset += token.text.chars().count();
        let top = top.into_iter().map(|(t, lp)| (Token::new(bpe, after, t), lp)).collect();
        TokenLogprob { token, logprob: Some(lp), top, offset }
    }

    /// Sends the prompt's tokens with their log-probabilities: `logits` holds a row per prompt
    /// token, row `t` the distribution of token `t + 1`; nothing predicts the first token.
    /// Only the first `sampled` ids of each row are scored (the tokenizer's).
    pub(super) fn prompt_logprobs(
        &mut self,
        logits: &[f32],
        vocab: usize,
        sampled: usize,
        bpe: &Bpe,
    ) {
        let (prompt, k) = (self.job.prompt.clone(), self.job.logprobs.unwrap_or(0));
        let token = Token::new(bpe, None, prompt[0]);
        self.offset = token.text.chars().count();
        let mut entries = vec![TokenLogprob { token, logprob: None, top: Vec::new(), offset: 0 }];
        for (t, &tok) in prompt.iter().enumerate().skip(1) {
            let row = &logits[(t - 1) * vocab..(t - 1) * vocab + sampled];
            entries.push(self.entry(row, Some(prompt[t - 1]), tok, k, bpe));
        }
        // The completion's tokens follow the prompt's text as the client sees it.
        self.offset = self.job.prompt_text.chars().count();
        self.job.send(Event::Logprobs(entries));
    }

    /// Takes the sampled token: its text, stop strings, the token limit. Returns how the
    /// sequence ends, if it does.
    pub(super) fn advance(&mut self, tok: u32, bpe: &Bpe) -> Option<Finish> {
        if tok == bpe.eot {
            return Some(Finish::Stop);
        }
        // A token can end inside a UTF-8 character: the stream waits until it is whole.
        if let Some(piece) = self.stream.push(tok) {
            self.text.push_str(&piece);
        }
        if let Some(at) = self.job.stop.iter().filter_map(|s| self.text.find(s.as_str())).min() {
            self.text.truncate(at);
            self.flush(self.text.len());
            return Some(Finish::Stop);
        }
        if self.generated.len() >= self.job.max_tokens {
            return Some(Finish::Length);
        }
        // Hold back what could be the start of a stop string.
        let held =
            self.job.stop.iter().map(|s| longest_prefix_suffix(&self.text, s)).max().unwrap_or(0);
        self.flush(self.text.len() - held);
        None
    }

    /// Sends the text up to byte `to` not sent yet.
    fn flush(&mut self, to: usize) {
        if to > self.sent {
            self.job.send(Event::Text(self.text[self.sent..to].to_string()));
            self.sent = to;
        }
    }

    pub(super) fn finish(mut self, finish: Finish, eot: u32, metrics: &Metrics) {
        if finish == Finish::Length {
            // A character cut by the token limit: its bytes as far as they go.
            let rest = self.stream.rest().unwrap_or_default();
            self.text.push_str(&rest);
        }
        self.flush(self.text.len());
        // Counted before the answer goes out, so that a client that reads the metrics after
        // its answer finds it counted.
        if let (Some(first), true) = (self.first_token, self.generated.len() > 1) {
            let per = first.elapsed() / (self.generated.len() - 1) as u32;
            metrics.time_per_output_token(per);
        }
        metrics.request_duration(self.job.received.elapsed());
        metrics.finished("completed");
        // The end-of-text token is not part of the completion.
        let ended_by_eot = self.generated.last() == Some(&eot);
        let usage = Usage {
            prompt_tokens: self.job.prompt.len(),
            cached_tokens: self.cached,
            completion_tokens: self.generated.len() - ended_by_eot as usize,
        };
        self.job.send(Event::Done { finish, usage });
    }
}

/// The length in bytes of the longest proper prefix of `stop` that `text` ends with (on a
/// character boundary of `text`).
fn longest_prefix_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .find(|&n| stop.is_char_boundary(n) && text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_back_text_is_the_longest_start_of_a_stop_string() {
        assert_eq!(longest_prefix_suffix("hello wor", "world"), 3);
        assert_eq!(longest_prefix_suffix("hello", "world"), 0);
        assert_eq!(longest_prefix_suffix("ab\nUs", "\nUser:"), 3);
        assert_eq!(longest_prefix_suffix("x", ""), 0);
    }
}
