//! The engine: one thread owns the model and a key/value cache of `max_batch` slots and runs
//! continuous batching. Each step it admits waiting requests (their prompts are prefilled in the
//! same pass that decodes one token for every running sequence, under a budget of prompt
//! tokens), samples each sequence's next token, streams its text to the request, and retires the
//! sequences that finished or whose client has gone, freeing their slots for the next step.
//! A prompt whose start was prefilled before is copied from the prefix cache ([`super::prefix`])
//! and only its rest is prefilled.
//!
//! A sequence's tokens depend only on its own prompt, settings and seed: each has its own cache
//! slot and sampler, and every row of a decoding pass is computed on its own, so the text of a
//! request does not depend on what else is in the batch.

use super::logprobs::{score, token_text, TokenLogprob};
use super::metrics::Metrics;
use super::penalties::{History, Penalties};
use super::prefix::PrefixCache;
use crate::base::memory::format_bytes;
use crate::infer::generate::{Sampler, Sampling, TextStream};
use crate::model::decode::{check_cache_size, KvCache};
use crate::model::residual::DepthMap;
use crate::model::Model;
use crate::text::tokenizer::Bpe;
use anyhow::{Context, Result};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
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
    /// Which of the request's `n` choices this is: its sampler's random stream, and the tag
    /// of its events (the choices of one request share one channel).
    pub choice: usize,
    pub events: UnboundedSender<(usize, Event)>,
    pub received: Instant,
}

impl Job {
    /// Whether the prompt's every token is scored (`echo` with `logprobs`): it needs their
    /// logits, so it is computed whole, neither using nor filling the prefix cache.
    fn scores_prompt(&self) -> bool {
        self.echo && self.logprobs.is_some()
    }

    fn send(&self, event: Event) {
        // A closed channel is a client that left; the engine notices at its next step.
        let _ = self.events.send((self.choice, event));
    }
}

/// Where requests enter the engine: a queue of bounded length.
#[derive(Clone)]
pub struct EngineHandle {
    queue: SyncSender<Job>,
}

/// Why a request was not queued.
pub enum Refused {
    /// The queue is full (the server answers 429).
    Busy,
    /// The engine has stopped.
    Stopped,
}

impl EngineHandle {
    pub fn submit(&self, job: Job, metrics: &Metrics) -> Result<(), Refused> {
        // Counted before it is sent, so the engine never takes it out of the count first.
        metrics.queued();
        let sent = self.queue.try_send(job);
        if sent.is_err() {
            metrics.dequeued();
        }
        match sent {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => Err(Refused::Busy),
            Err(TrySendError::Disconnected(_)) => Err(Refused::Stopped),
        }
    }
}

/// Settings of the engine.
#[derive(Clone, Copy, Debug)]
pub struct EngineOptions {
    /// Sequences decoded together (cache slots).
    pub max_batch: usize,
    /// Requests waiting beyond the running ones; more are refused.
    pub max_queue: usize,
    /// Prompt tokens prefilled per step (a longer prompt is admitted alone).
    pub prefill_tokens: usize,
    /// Bytes the prefix cache may hold (0: off).
    pub prefix_cache_bytes: usize,
}

/// The most requests that may wait for a slot (`--max-queue`): their channel is allocated
/// whole, and a request behind more than this many would wait for minutes anyway.
pub const MAX_QUEUE: usize = 65_536;

/// Checks the engine's settings against the model and the machine, allocating nothing.
pub fn check_options(config: &crate::model::Config, opts: &EngineOptions) -> Result<()> {
    anyhow::ensure!(opts.max_batch >= 1, "--max-batch must be at least 1");
    anyhow::ensure!(opts.max_queue >= 1, "--max-queue must be at least 1");
    anyhow::ensure!(
        opts.max_queue <= MAX_QUEUE,
        "--max-queue must be at most {MAX_QUEUE}, got {}",
        opts.max_queue
    );
    anyhow::ensure!(opts.prefill_tokens >= 1, "--prefill-tokens must be at least 1");
    let limit = crate::base::memory::memory_limit();
    anyhow::ensure!(
        opts.prefix_cache_bytes as u64 <= limit,
        "--prefix-cache of {} is more than the machine's memory ({})",
        format_bytes(opts.prefix_cache_bytes as u128),
        format_bytes(limit as u128)
    );
    // The pool grows as sequences do; refusing now a pool that could not be full later keeps a
    // busy server from failing requests when its slots fill up.
    let ctx = config.max_position_embeddings;
    let width = config.num_key_value_heads * config.head_dim;
    check_cache_size(opts.max_batch, ctx, width, config.num_hidden_layers).with_context(|| {
        format!("--max-batch {} is too many sequences for this model's context", opts.max_batch)
    })
}

/// Starts the engine thread; it ends when every handle is dropped and its work is done.
pub fn start(
    model: Arc<Model>,
    bpe: Arc<Bpe>,
    opts: EngineOptions,
    metrics: Arc<Metrics>,
) -> Result<(EngineHandle, std::thread::JoinHandle<()>)> {
    let ctx = model.config.max_position_embeddings;
    check_options(&model.config, &opts)?;
    let cache = KvCache::new(&model.config, opts.max_batch, ctx)?;
    let (queue, waiting) = std::sync::mpsc::sync_channel(opts.max_queue);
    let thread = std::thread::Builder::new().name("engine".into()).spawn(move || {
        let mut engine = Engine {
            model,
            bpe,
            cache,
            opts,
            waiting,
            running: Vec::new(),
            free: (0..opts.max_batch).rev().collect(),
            prefix: PrefixCache::new(opts.prefix_cache_bytes),
            metrics,
        };
        engine.run()
    })?;
    Ok((EngineHandle { queue }, thread))
}

/// A sequence in the batch.
struct Sequence {
    job: Job,
    slot: usize,
    sampler: Sampler,
    /// Tokens generated; the last one is fed in the next step.
    generated: Vec<u32>,
    /// Whether the prompt is still to be prefilled.
    prefill: bool,
    /// The prompt's first tokens that came from the prefix cache (not prefilled).
    cached: usize,
    /// The completion's text so far, and how much of it was sent (text that could be the
    /// start of a stop string is held back).
    text: String,
    sent: usize,
    /// The text of the tokens as they come (the decoder `generate` streams with).
    stream: TextStream<Arc<Bpe>>,
    /// The token before the next (the prompt's last, then the last generated).
    last: Option<u32>,
    first_token: Option<Instant>,
    /// Where the next token's text starts, in characters of prompt and completion together.
    offset: usize,
    /// The request's bias and penalties, with the history they count, when it has any.
    penalties: Option<(Arc<Penalties>, History)>,
}

struct Engine {
    model: Arc<Model>,
    bpe: Arc<Bpe>,
    cache: KvCache,
    opts: EngineOptions,
    waiting: Receiver<Job>,
    running: Vec<Sequence>,
    /// Free cache slots.
    free: Vec<usize>,
    prefix: PrefixCache,
    metrics: Arc<Metrics>,
}

impl Engine {
    fn run(&mut self) {
        let mut held: Option<Job> = None;
        loop {
            if self.running.is_empty() && held.is_none() {
                // Idle: wait for work; every handle gone means the server has shut down.
                match self.waiting.recv() {
                    Ok(job) => {
                        self.metrics.dequeued();
                        held = Some(job);
                    }
                    Err(_) => return,
                }
            }
            self.admit(&mut held);
            self.metrics.set_running(self.running.len());
            let stepped = self.step();
            self.metrics.set_running(self.running.len());
            if let Err(e) = stepped {
                // A failed pass fails the sequences in it, never the engine.
                let msg = format!("{e:#}");
                for seq in std::mem::take(&mut self.running) {
                    seq.job.send(Event::Failed(msg.clone()));
                    self.metrics.finished("error");
                    self.free.push(seq.slot);
                }
            }
        }
    }

    /// Moves waiting requests into free slots, within the step's budget of prompt tokens (a
    /// prompt beyond the budget goes in alone). `held`: a request taken from the queue that did
    /// not fit in the last step.
    fn admit(&mut self, held: &mut Option<Job>) {
        let mut budget = self.opts.prefill_tokens;
        let mut admitted = 0;
        while let Some(&slot) = self.free.last() {
            let job = match held.take() {
                Some(j) => j,
                None => match self.waiting.try_recv() {
                    Ok(j) => {
                        self.metrics.dequeued();
                        j
                    }
                    Err(_) => break,
                },
            };
            if job.events.is_closed() {
                self.metrics.finished("cancelled");
                continue;
            }
            let reuse = if job.scores_prompt() { 0 } else { self.prefix.reusable(&job.prompt) };
            let prefill = job.prompt.len() - reuse;
            if admitted > 0 && prefill > budget {
                *held = Some(job);
                break;
            }
            budget = budget.saturating_sub(prefill);
            admitted += 1;
            self.free.pop();
            self.cache.clear(slot);
            let cached = match reuse {
                0 => Ok(0),
                _ => self.prefix.load(&job.prompt, &mut self.cache, slot),
            };
            let started = cached.and_then(|cached| {
                Ok((cached, Sampler::new(job.sampling, job.seed, job.choice as u64)?))
            });
            let (cached, sampler) = match started {
                Ok(started) => started,
                Err(e) => {
                    job.send(Event::Failed(format!("{e:#}")));
                    self.metrics.finished("error");
                    self.free.push(slot);
                    continue;
                }
            };
            let offset = if job.echo { 0 } else { job.prompt_text.chars().count() };
            let penalties = job.penalties.clone().map(|p| (p, History::new(&job.prompt)));
            let last = job.prompt.last().copied();
            let stream = TextStream::new(self.bpe.clone()).after(last);
            self.running.push(Sequence {
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
            });
        }
    }

    /// One pass: prefill the new sequences and feed every running one its last token, sample,
    /// stream, retire.
    fn step(&mut self) -> Result<()> {
        // Clients that have gone free their slots before the pass.
        let (gone, keep): (Vec<Sequence>, Vec<Sequence>) =
            std::mem::take(&mut self.running).into_iter().partition(|s| s.job.events.is_closed());
        self.running = keep;
        for s in gone {
            self.free.push(s.slot);
            self.metrics.finished("cancelled");
        }
        if self.running.is_empty() {
            return Ok(());
        }
        let longest = self
            .running
            .iter()
            .map(|s| {
                self.cache.len(s.slot) + if s.prefill { s.job.prompt.len() - s.cached } else { 1 }
            })
            .max()
            .unwrap_or(0);
        self.cache.reserve(longest)?;
        let chunks: Vec<(usize, &[u32])> = self
            .running
            .iter()
            .map(|s| {
                let ids = if s.prefill {
                    &s.job.prompt[s.cached..]
                } else {
                    &s.generated[s.generated.len() - 1..]
                };
                (s.slot, ids)
            })
            .collect();
        // A prompt whose tokens are scored gets logits for each of them.
        let scored: Vec<bool> = self.running.iter().map(Sequence::scores_prompt).collect();
        let depth: Vec<bool> = self.running.iter().map(|s| s.job.depth).collect();
        let (logits, mut maps) =
            self.model.decode_traced(&mut self.cache, &chunks, &scored, &depth)?;
        drop(chunks);
        let vocab = self.model.config.vocab_size;
        // Ids beyond the tokenizer (a padded embedding) have no text: never sampled.
        let sampled = self.bpe.vocab_size().min(vocab);
        let now = Instant::now();
        let mut done = Vec::new();
        let mut row = 0;
        for (seq, map) in self.running.iter_mut().zip(&mut maps) {
            if seq.prefill {
                if seq.scores_prompt() {
                    let rows = seq.job.prompt.len();
                    let scored = &logits[row * vocab..(row + rows) * vocab];
                    seq.prompt_logprobs(scored, vocab, sampled, &self.bpe);
                    row += rows - 1;
                }
                if seq.job.echo {
                    seq.job.send(Event::Text(seq.job.prompt_text.clone()));
                }
                seq.prefill = false;
                if !seq.job.scores_prompt() {
                    self.prefix.insert(&seq.job.prompt, &self.cache, seq.slot);
                    self.metrics.set_prefix_cache_bytes(self.prefix.bytes());
                }
                self.metrics.add_prompt_tokens(seq.job.prompt.len(), seq.cached);
                if seq.job.max_tokens == 0 {
                    // Only the prompt was asked for (`echo` with `max_tokens: 0`).
                    done.push((seq.slot, Finish::Length));
                    row += 1;
                    continue;
                }
            }
            let logits = &logits[row * vocab..row * vocab + sampled];
            row += 1;
            let tok = match &mut seq.penalties {
                Some((p, h)) => {
                    let mut adjusted = logits.to_vec();
                    h.apply(p, &mut adjusted);
                    let tok = seq.sampler.sample(&adjusted);
                    h.push(tok);
                    tok
                }
                None => seq.sampler.sample(logits),
            };
            if let (Some(map), true) = (map.take(), tok != self.bpe.eot) {
                seq.job.send(Event::Depth(map));
            }
            if let Some(k) = seq.job.logprobs {
                if tok != self.bpe.eot {
                    let entry = seq.entry(logits, seq.last, tok, k, &self.bpe);
                    seq.job.send(Event::Logprobs(vec![entry]));
                }
            }
            seq.last = Some(tok);
            seq.generated.push(tok);
            self.metrics.add_generated_tokens(1);
            if seq.first_token.is_none() {
                seq.first_token = Some(now);
                self.metrics.time_to_first_token(now - seq.job.received);
            }
            let finish = seq.advance(tok, &self.bpe);
            if let Some(finish) = finish {
                done.push((seq.slot, finish));
            }
        }
        for (slot, finish) in done {
            let i = self.running.iter().position(|s| s.slot == slot).unwrap();
            let seq = self.running.swap_remove(i);
            if !seq.job.scores_prompt() {
                // The whole conversation so far, for its next turn.
                let held = self.cache.len(slot);
                let tokens: Vec<u32> =
                    seq.job.prompt.iter().chain(&seq.generated).take(held).copied().collect();
                self.prefix.insert(&tokens, &self.cache, slot);
                self.metrics.set_prefix_cache_bytes(self.prefix.bytes());
            }
            seq.finish(finish, self.bpe.eot, &self.metrics);
            self.free.push(slot);
        }
        Ok(())
    }
}

impl Sequence {
    fn scores_prompt(&self) -> bool {
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
        let text = token_text(bpe, after, tok);
        let offset = self.offset;
        self.offset += text.chars().count();
        let top = top.into_iter().map(|(t, lp)| (token_text(bpe, after, t), lp)).collect();
        TokenLogprob { text, logprob: Some(lp), top, offset }
    }

    /// Sends the prompt's tokens with their log-probabilities: `logits` holds a row per prompt
    /// token, row `t` the distribution of token `t + 1`; nothing predicts the first token.
    /// Only the first `sampled` ids of each row are scored (the tokenizer's).
    fn prompt_logprobs(&mut self, logits: &[f32], vocab: usize, sampled: usize, bpe: &Bpe) {
        let (prompt, k) = (self.job.prompt.clone(), self.job.logprobs.unwrap_or(0));
        let text = token_text(bpe, None, prompt[0]);
        self.offset = text.chars().count();
        let mut entries = vec![TokenLogprob { text, logprob: None, top: Vec::new(), offset: 0 }];
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
    fn advance(&mut self, tok: u32, bpe: &Bpe) -> Option<Finish> {
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

    fn finish(mut self, finish: Finish, eot: u32, metrics: &Metrics) {
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
