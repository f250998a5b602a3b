//! The engine: one thread owns the model and a key/value cache of `max_batch` slots and runs
//! continuous batching. Each step it admits waiting requests (their prompts are prefilled in the
//! same pass that decodes one token for every running sequence, under a budget of prompt
//! tokens), samples each sequence's next token, streams its text to the request, and retires the
//! sequences that finished or whose client has gone, freeing their slots for the next step.
//! A prompt whose start was prefilled before reads it from the prefix cache ([`super::prefix`])
//! and only its rest is prefilled.
//!
//! A sequence's tokens depend only on its own prompt, settings and seed: each has its own cache
//! slot and sampler, and every row of a decoding pass is computed on its own, so the text of a
//! request does not depend on what else is in the batch.

use super::job::{Event, Finish, Job};
use super::metrics::Metrics;
use super::prefix::PrefixCache;
use super::sequence::Sequence;
use crate::base::memory::{format_bytes, memory_limit};
use crate::model::decode::{cache_bytes, KvCache};
use crate::model::Model;
use crate::text::tokenizer::Bpe;
use anyhow::Result;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

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
    /// Tokens one sequence may hold, prompt and completion (`None`: the model's context).
    pub context: Option<usize>,
}

impl EngineOptions {
    /// The tokens one sequence may hold with `config`'s model.
    pub fn context(&self, config: &crate::model::Config) -> usize {
        let model = config.max_position_embeddings;
        self.context.map_or(model, |c| c.min(model))
    }
}

/// The most requests that may wait for a slot (`--max-queue`): their channel is allocated
/// whole, and a request behind more than this many would wait for minutes anyway.
pub const MAX_QUEUE: usize = 65_536;

/// Checks the engine's settings against the model and the machine, allocating nothing: the
/// weights, the key/value pool with every slot at the full context, and the prefix cache at its
/// bound must fit in the machine's memory together, so that a busy server never fails requests
/// when its slots fill up.
pub fn check_options(model: &Model, opts: &EngineOptions) -> Result<()> {
    anyhow::ensure!(opts.max_batch >= 1, "--max-batch must be at least 1");
    anyhow::ensure!(opts.max_queue >= 1, "--max-queue must be at least 1");
    anyhow::ensure!(
        opts.max_queue <= MAX_QUEUE,
        "--max-queue must be at most {MAX_QUEUE}, got {}",
        opts.max_queue
    );
    anyhow::ensure!(opts.prefill_tokens >= 1, "--prefill-tokens must be at least 1");
    anyhow::ensure!(opts.context != Some(0), "--context must be at least 1");
    let c = &model.config;
    let (ctx, width) = (opts.context(c), c.num_key_value_heads * c.head_dim);
    let pool = cache_bytes(opts.max_batch, ctx, width, c.num_hidden_layers);
    let (weights, prefix) = (model.resident_bytes() as u128, opts.prefix_cache_bytes as u128);
    let total = pool.and_then(|p| p.checked_add(weights)?.checked_add(prefix));
    let limit = memory_limit() as u128;
    if total.is_some_and(|t| t <= limit) {
        return Ok(());
    }
    let show = |b: Option<u128>| b.map_or("more than 2^128 bytes".into(), format_bytes);
    anyhow::bail!(
        "at full load the server needs {}, more than the machine's memory ({}): the weights \
         {}, the key/value cache {} (--max-batch {} sequences of {ctx} tokens) and the prefix \
         cache {} (--prefix-cache); lower --max-batch, --context or --prefix-cache",
        show(total),
        format_bytes(limit),
        format_bytes(weights),
        show(pool),
        opts.max_batch,
        format_bytes(prefix)
    )
}

/// Starts the engine thread; it ends when every handle is dropped and its work is done.
pub fn start(
    model: Arc<Model>,
    bpe: Arc<Bpe>,
    opts: EngineOptions,
    metrics: Arc<Metrics>,
) -> Result<(EngineHandle, std::thread::JoinHandle<()>)> {
    check_options(&model, &opts)?;
    let ctx = opts.context(&model.config);
    let mut cache = KvCache::new(&model.config, opts.max_batch, ctx)?;
    // Every slot's whole context from the start: the pool is the system's zero pages until a
    // slot writes them (each slot's first pages when a request first reaches them), so it never
    // grows, which would move every slot's keys and values while requests wait.
    cache.reserve(ctx)?;
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
            let (events, choice) = (job.events.clone(), job.choice);
            let started = cached.and_then(|cached| Sequence::start(job, slot, cached, &self.bpe));
            match started {
                Ok(seq) => self.running.push(seq),
                Err(e) => {
                    let _ = events.send((choice, Event::Failed(format!("{e:#}"))));
                    self.metrics.finished("error");
                    self.free.push(slot);
                }
            }
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
            let tok = seq.sample(logits, map.take(), &self.bpe);
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
