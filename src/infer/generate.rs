//! Text generation: prefill every prompt in one pass, then decode one token per sequence per
//! step with the key/value cache ([`crate::model::decode`]), sampling each token by
//! temperature, top-k and top-p.
//!
//! Decisions:
//! - Each prompt samples from its own random stream (ChaCha8 seeded by `seed`, stream = the
//!   prompt's index), so a given seed and prompt list always give the same text.
//! - Temperature 0 is greedy decoding (the most likely token; ties go to the lowest id).
//! - A sequence ends at `max_tokens` new tokens or when it produces the end-of-text token.
//! - Context overflow (prompt plus new tokens beyond `max_position_embeddings`) is an error
//!   before anything runs, unless [`Overflow::Slide`] is chosen: then, whenever a sequence fills
//!   the context, its cache is rebuilt from the most recent half of the context (one prefill
//!   pass) and generation continues; prompts longer than the context keep their last tokens.
//!
//! Also here: reading a file of prompts, and turning tokens into text as they arrive.

use crate::model::decode::KvCache;
use crate::model::Model;
use crate::text::tokenizer::Bpe;
use anyhow::{bail, ensure, Result};
use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use std::path::Path;

/// How the next token is drawn from the logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0 = greedy.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `p` (nucleus).
    pub top_p: Option<f32>,
}

impl Sampling {
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.temperature.is_finite() && self.temperature >= 0.0,
            "temperature must be a finite number >= 0 (0 = greedy), got {}",
            self.temperature
        );
        if let Some(k) = self.top_k {
            ensure!(k > 0, "top-k must be at least 1, got 0");
        }
        if let Some(p) = self.top_p {
            ensure!(p > 0.0 && p <= 1.0, "top-p must lie in (0, 1], got {p}");
        }
        Ok(())
    }
}

/// Draws tokens from logits with one random stream.
pub struct Sampler {
    cfg: Sampling,
    rng: ChaCha8Rng,
    /// Scratch: candidate ids and their probabilities.
    order: Vec<u32>,
    probs: Vec<f64>,
}

impl Sampler {
    pub fn new(cfg: Sampling, seed: u64, stream: u64) -> Result<Sampler> {
        cfg.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(stream);
        Ok(Sampler { cfg, rng, order: Vec::new(), probs: Vec::new() })
    }

    /// The next token given one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature == 0.0 {
            return argmax(logits);
        }
        // Candidates from most to least likely (ties by id, so the order is deterministic).
        self.order.clear();
        self.order.extend(0..logits.len() as u32);
        let by_logit =
            |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
        let k = self.cfg.top_k.unwrap_or(logits.len()).min(logits.len());
        if k < logits.len() {
            self.order.select_nth_unstable_by(k - 1, by_logit);
            self.order.truncate(k);
        }
        self.order.sort_unstable_by(by_logit);
        let t = self.cfg.temperature as f64;
        let top = logits[self.order[0] as usize] as f64;
        self.probs.clear();
        self.probs
            .extend(self.order.iter().map(|&i| ((logits[i as usize] as f64 - top) / t).exp()));
        let z: f64 = self.probs.iter().sum();
        let mut keep = self.probs.len();
        if let Some(p) = self.cfg.top_p {
            let mut cum = 0.0;
            for (i, q) in self.probs.iter().enumerate() {
                cum += q / z;
                if cum >= p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        let total: f64 = self.probs[..keep].iter().sum();
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
        let mut cum = 0.0;
        for (i, q) in self.probs[..keep].iter().enumerate() {
            cum += q;
            if u < cum {
                return self.order[i];
            }
        }
        self.order[keep - 1]
    }
}

/// The id of the largest logit (the lowest such id on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// What happens when a sequence would outgrow the model's context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overflow {
    /// Refuse before generating (the default).
    Error,
    /// Keep generating over a sliding window of the most recent tokens.
    Slide,
}

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub seed: u64,
    pub overflow: Overflow,
    /// Stop a sequence when it produces this token (the end-of-text token).
    pub stop: Option<u32>,
    /// Sample only ids below this: the tokenizer's size, for a model whose embedding is padded
    /// beyond it (ids without text). `None`: the whole vocabulary.
    pub sample_below: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    MaxTokens,
    EndOfText,
}

/// One prompt's continuation.
#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    /// The model's vocabulary size, which the tokens were sampled from.
    pub vocab_size: usize,
}

/// Time spent, for throughput figures.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timing {
    pub prefill_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_tokens: usize,
    pub decode_seconds: f64,
}

/// Generates a continuation of every prompt, all prompts as one batch (numbered from 1 in
/// errors). `on_token(i, id)` is called as soon as prompt `i` gets its next token; an error it
/// returns (the reader of the stream has gone) ends generation with that error.
pub fn generate(
    model: &Model,
    prompts: &[Vec<u32>],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(usize, u32) -> Result<()>,
) -> Result<(Vec<Generation>, Timing)> {
    ensure!(!prompts.is_empty(), "no prompts");
    ensure!(opts.max_tokens > 0, "max-tokens must be at least 1");
    let ctx = model.config.max_position_embeddings;
    let vocab = model.config.vocab_size;
    let mut history: Vec<Vec<u32>> = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let n = i + 1;
        ensure!(!p.is_empty(), "prompt {n} is empty");
        if let Some(&t) = p.iter().find(|&&t| t as usize >= vocab) {
            bail!("prompt {n} holds token id {t}, out of range for vocab_size = {vocab}");
        }
        // The last new token is sampled, never fed back, so it needs no position.
        let needed = p.len() + opts.max_tokens - 1;
        match opts.overflow {
            Overflow::Error => ensure!(
                needed <= ctx,
                "prompt {n} has {} tokens; {} new tokens need {needed} positions, beyond the model's context of {ctx} \
                 (max_position_embeddings): shorten the prompt, generate fewer tokens, or let the context window slide",
                p.len(),
                opts.max_tokens,
            ),
            Overflow::Slide => {}
        }
        history.push(p[p.len().saturating_sub(ctx)..].to_vec());
    }
    let sampled = opts.sample_below.unwrap_or(vocab).min(vocab);
    let mut samplers = (0..prompts.len())
        .map(|i| Sampler::new(opts.sampling, opts.seed, i as u64))
        .collect::<Result<Vec<_>>>()?;
    let mut cache = KvCache::new(&model.config, prompts.len(), ctx)?;
    // Room for what the longest sequence will hold (at most the context), not for the context.
    let longest = history.iter().map(Vec::len).max().unwrap_or(0);
    cache.reserve(longest.saturating_add(opts.max_tokens - 1))?;
    let mut timing = Timing::default();

    let t0 = std::time::Instant::now();
    let chunks: Vec<(usize, &[u32])> =
        history.iter().enumerate().map(|(i, h)| (i, h.as_slice())).collect();
    let mut logits = model.decode(&mut cache, &chunks, false)?;
    timing.prefill_tokens = history.iter().map(|h| h.len()).sum();
    timing.prefill_seconds = t0.elapsed().as_secs_f64();

    let mut out: Vec<Generation> = prompts
        .iter()
        .map(|_| Generation { tokens: Vec::new(), stop: StopReason::MaxTokens, vocab_size: vocab })
        .collect();
    // Slots still generating, in the order of the rows of `logits`.
    let mut active: Vec<usize> = (0..prompts.len()).collect();
    let t0 = std::time::Instant::now();
    while !active.is_empty() {
        let mut next = Vec::with_capacity(active.len());
        for (row, &i) in active.iter().enumerate() {
            let tok = samplers[i].sample(&logits[row * vocab..row * vocab + sampled]);
            on_token(i, tok)?;
            out[i].tokens.push(tok);
            if Some(tok) == opts.stop {
                out[i].stop = StopReason::EndOfText;
            } else if out[i].tokens.len() < opts.max_tokens {
                history[i].push(tok);
                next.push(i);
            }
        }
        active = next;
        if active.is_empty() {
            break;
        }
        // Feed each sequence its new token; a full context is rebuilt from its recent half.
        let mut chunks: Vec<(usize, &[u32])> = Vec::with_capacity(active.len());
        for &i in &active {
            let h = &history[i];
            if cache.len(i) == ctx {
                cache.clear(i);
                chunks.push((i, &h[h.len() - (ctx / 2).max(1)..]));
            } else {
                chunks.push((i, &h[h.len() - 1..]));
            }
        }
        timing.decode_tokens += chunks.len();
        logits = model.decode(&mut cache, &chunks, false)?;
    }
    timing.decode_seconds = t0.elapsed().as_secs_f64();
    Ok((out, timing))
}

/// The prompt of a chat turn: `message` from the user (after a `system` message, if any) put
/// into the chat template of the model in `dir`.
pub fn chat_prompt(dir: &Path, system: Option<&str>, message: &str) -> Result<String> {
    let template = crate::text::chat::ChatTemplate::load(dir)?;
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(("system", s));
    }
    messages.push(("user", message));
    template.render(&messages)
}

/// The prompts of a UTF-8 file, one per line; an empty file or an empty line is an error.
pub fn read_prompts(path: &Path) -> Result<Vec<String>> {
    let text = crate::base::fs::read_utf8(path)?;
    let lines: Vec<String> = text.lines().map(str::to_string).collect();
    ensure!(!lines.is_empty(), "{} holds no prompts", path.display());
    if let Some(i) = lines.iter().position(|l| l.is_empty()) {
        bail!("{} line {} is empty: every line must be a prompt", path.display(), i + 1);
    }
    Ok(lines)
}

/// Text of generated tokens as they arrive. A token can end inside a UTF-8 character, so text
/// that decodes to a trailing replacement character is held back until the character is whole.
pub struct TextStream<B: std::ops::Deref<Target = Bpe>> {
    /// The tokenizer: borrowed, or shared (`Arc<Bpe>`) by a stream that outlives a borrow.
    bpe: B,
    /// Tokens not handed out yet: those since the last complete character. Only these are
    /// decoded for each new token, so streaming costs the same per token however long the text.
    pending: Vec<u32>,
    /// The first token the tokenizer has no text for: nothing after it is handed out, and
    /// [`TextStream::finish`] is an error naming it.
    unknown: Option<u32>,
    /// The token before `pending` (the last one handed out, or the prompt's last), decoded with
    /// it so that a decoder that strips the text's leading space (SentencePiece's) strips it
    /// from that token and not from each new piece.
    context: Option<u32>,
}

/// Refuses a tokenizer with more tokens than the model's vocabulary (its ids beyond it would
/// index no embedding), as import does. A model's vocabulary may be larger (an embedding padded
/// to a round size): generation samples only the tokenizer's ids (`sample_below`).
pub fn check_tokenizer(model_vocab_size: usize, bpe: &Bpe) -> Result<()> {
    ensure!(
        bpe.vocab_size() <= model_vocab_size,
        "the tokenizer has {} tokens, the model's vocabulary only {model_vocab_size}",
        bpe.vocab_size()
    );
    Ok(())
}

/// An error naming both sizes when the tokenizer lacks one of the sampled `ids`.
fn check_sampled(bpe: &Bpe, ids: &[u32], model_vocab_size: Option<usize>) -> Result<()> {
    if let Some(&t) = ids.iter().find(|&&t| t as usize >= bpe.vocab_size()) {
        let model = model_vocab_size.map_or(String::new(), |m| format!(" of {m}"));
        bail!(
            "the model sampled token id {t}{model}, but its tokenizer has only {} tokens: model and tokenizer do not belong together",
            bpe.vocab_size()
        );
    }
    Ok(())
}

/// The text of `ids` where they follow token `context`: decoded with it and without its text,
/// so that a decoder that strips the text's leading space (SentencePiece's) strips it from the
/// context and not from `ids`.
pub fn decode_after(bpe: &Bpe, context: Option<u32>, ids: &[u32]) -> Result<String> {
    let Some(c) = context else { return bpe.decode(ids) };
    let head = bpe.decode(&[c])?;
    let both: Vec<u32> = std::iter::once(c).chain(ids.iter().copied()).collect();
    match bpe.decode(&both)?.strip_prefix(&head) {
        Some(rest) => Ok(rest.to_string()),
        None => bpe.decode(ids),
    }
}

impl<B: std::ops::Deref<Target = Bpe>> TextStream<B> {
    pub fn new(bpe: B) -> TextStream<B> {
        TextStream { bpe, pending: Vec::new(), unknown: None, context: None }
    }

    /// A stream continuing text whose last token is `token` (the prompt's).
    pub fn after(mut self, token: Option<u32>) -> TextStream<B> {
        self.context = token.filter(|&t| (t as usize) < self.bpe.vocab_size());
        self
    }

    /// The text of `pending`, decoded after the context token.
    fn decode_pending(&self) -> Result<String> {
        decode_after(&self.bpe, self.context, &self.pending)
    }

    /// Adds a token (the end-of-text token is skipped); returns the new text it completes.
    /// After a token the tokenizer does not have, nothing more is returned (see `finish`).
    /// Byte-level tokens decode to their bytes, so the text of a run of tokens that ends on a
    /// character boundary is final: what follows never changes it.
    pub fn push(&mut self, token: u32) -> Option<String> {
        if token == self.bpe.eot || self.unknown.is_some() {
            return None;
        }
        if token as usize >= self.bpe.vocab_size() {
            self.unknown = Some(token);
            return None;
        }
        self.pending.push(token);
        let text = self.decode_pending().ok()?;
        if text.ends_with('\u{FFFD}') {
            return None; // a character still incomplete
        }
        self.context = Some(token);
        self.pending.clear();
        (!text.is_empty()).then_some(text)
    }

    /// The text not handed out yet, partial characters included.
    /// An error if a token had no text.
    pub fn finish(mut self) -> Result<String> {
        self.rest()
    }

    /// [`Self::finish`] for a stream kept in place: the text not handed out yet, after which
    /// the stream holds nothing.
    pub fn rest(&mut self) -> Result<String> {
        if let Some(t) = self.unknown {
            check_sampled(&self.bpe, &[t], None)?;
        }
        let text = self.decode_pending()?;
        self.pending.clear();
        Ok(text)
    }
}

impl Generation {
    /// The continuation as text, without the end-of-text token, decoded after the prompt's last
    /// token `after` (so that a SentencePiece tokenizer keeps the space of the first word).
    pub fn text(&self, bpe: &Bpe, after: Option<u32>) -> Result<String> {
        let body: Vec<u32> = self.tokens.iter().copied().filter(|&x| x != bpe.eot).collect();
        check_sampled(bpe, &body, Some(self.vocab_size))?;
        let mut stream = TextStream::new(bpe).after(after);
        let mut text: String = body.iter().filter_map(|&t| stream.push(t)).collect();
        text.push_str(&stream.finish()?);
        Ok(text)
    }
}

impl Timing {
    /// One line: tokens, time and throughput of prefill and of decoding.
    pub fn summary(&self) -> String {
        format!(
            "prefill {} tokens in {:.1} ms ({:.0} tokens/s); decode {} tokens in {:.3} s ({:.1} tokens/s)",
            self.prefill_tokens,
            self.prefill_seconds * 1e3,
            self.prefill_tokens as f64 / self.prefill_seconds,
            self.decode_tokens,
            self.decode_seconds,
            self.decode_tokens as f64 / self.decode_seconds.max(1e-9)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(temperature: f32, top_k: Option<usize>, top_p: Option<f32>) -> Sampler {
        Sampler::new(Sampling { temperature, top_k, top_p }, 7, 0).unwrap()
    }

    /// A model's vocabulary may be padded beyond its tokenizer's (generation samples only the
    /// tokenizer's ids), never the other way round; ids beyond the tokenizer that reach the text
    /// are errors naming both sizes, never text that silently lacks them.
    #[test]
    fn ids_beyond_the_tokenizer_are_refused() {
        let docs: Vec<String> = (0..20).map(|i| format!("a small text {i}\n")).collect();
        let bpe = Bpe::train(&docs, 270).unwrap();
        let n = bpe.vocab_size();
        let ok = bpe.encode("a small").unwrap();
        check_tokenizer(n, &bpe).unwrap();
        check_tokenizer(n + 5, &bpe).unwrap();
        let e = check_tokenizer(n - 5, &bpe).unwrap_err().to_string();
        assert!(
            e.contains(&format!("{n} tokens")) && e.contains(&format!("only {}", n - 5)),
            "{e}"
        );

        let mut tokens = ok.clone();
        tokens.push(n as u32 + 2);
        let g =
            Generation { tokens: tokens.clone(), stop: StopReason::MaxTokens, vocab_size: n + 5 };
        let e = g.text(&bpe, None).unwrap_err().to_string();
        assert!(
            e.contains(&format!("id {} of {}", n + 2, n + 5))
                && e.contains(&format!("only {n} tokens")),
            "{e}"
        );
        let g = Generation { tokens: ok.clone(), stop: StopReason::MaxTokens, vocab_size: n + 5 };
        assert_eq!(g.text(&bpe, None).unwrap(), "a small");

        let mut stream = TextStream::new(&bpe);
        let shown: String = tokens.iter().chain(&ok).filter_map(|&t| stream.push(t)).collect();
        assert_eq!(shown, "a small", "nothing after the unknown id");
        let e = stream.finish().unwrap_err().to_string();
        assert!(
            e.contains(&format!("id {}", n + 2)) && e.contains(&format!("only {n} tokens")),
            "{e}"
        );
    }

    /// Streamed pieces add up to the decoded whole, multi-byte characters split across tokens
    /// included, and each push decodes only the tokens since the last complete character.
    #[test]
    fn streamed_text_equals_the_decoded_whole() {
        let text = "héllo wörld, 日本語 😀 naïve café — ünïcödé again and again ";
        let bpe = Bpe::train(&[text.repeat(20)], 300).unwrap();
        let long = text.repeat(40);
        let ids = bpe.encode(&long).unwrap();
        let mut stream = TextStream::new(&bpe);
        let mut shown = String::new();
        let mut longest_pending = 0;
        for &t in &ids {
            shown.extend(stream.push(t));
            longest_pending = longest_pending.max(stream.pending.len());
        }
        shown.push_str(&stream.finish().unwrap());
        assert_eq!(shown, bpe.decode(&ids).unwrap());
        assert_eq!(shown, long);
        assert!(longest_pending <= 4, "pending grew to {longest_pending} tokens");
    }

    #[test]
    fn greedy_takes_the_largest_logit() {
        let mut s = sampler(0.0, None, None);
        assert_eq!(s.sample(&[0.1, 2.0, -1.0, 2.0]), 1);
    }

    /// Empirical frequencies follow softmax(logits / T) restricted to the allowed set.
    #[test]
    fn frequencies_follow_the_truncated_softmax() {
        let logits = [1.0f32, 0.5, 0.0, -0.5, -3.0];
        let softmax = |t: f64, keep: &[usize]| -> Vec<f64> {
            let e: Vec<f64> = (0..logits.len())
                .map(|i| if keep.contains(&i) { (logits[i] as f64 / t).exp() } else { 0.0 })
                .collect();
            let z: f64 = e.iter().sum();
            e.iter().map(|x| x / z).collect()
        };
        // Full softmax at T = 0.7; top-k 2; top-p 0.6 at T = 1 (p0 = 0.40, p0+p1 = 0.65 → 2 kept).
        let cases = [
            (sampler(0.7, None, None), softmax(0.7, &[0, 1, 2, 3, 4])),
            (sampler(1.0, Some(2), None), softmax(1.0, &[0, 1])),
            (sampler(1.0, None, Some(0.6)), softmax(1.0, &[0, 1])),
        ];
        for (mut s, want) in cases {
            let n = 40_000;
            let mut count = [0usize; 5];
            for _ in 0..n {
                count[s.sample(&logits) as usize] += 1;
            }
            for (c, w) in count.iter().zip(&want) {
                let f = *c as f64 / n as f64;
                assert!((f - w).abs() < 0.01, "frequencies {count:?} vs {want:?}");
            }
        }
    }

    #[test]
    fn same_seed_same_draws() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |stream| {
            let mut s = Sampler::new(
                Sampling { temperature: 1.0, top_k: Some(20), top_p: Some(0.9) },
                3,
                stream,
            )
            .unwrap();
            (0..100).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(0), draw(0));
        assert_ne!(draw(0), draw(1));
    }

    #[test]
    fn bad_settings_are_refused() {
        for (t, k, p, msg) in [
            (-0.5, None, None, "temperature"),
            (f32::NAN, None, None, "temperature"),
            (1.0, Some(0), None, "top-k"),
            (1.0, None, Some(0.0), "top-p"),
            (1.0, None, Some(1.5), "top-p"),
        ] {
            let e =
                Sampling { temperature: t, top_k: k, top_p: p }.validate().unwrap_err().to_string();
            assert!(e.contains(msg), "{e}");
        }
    }
}
