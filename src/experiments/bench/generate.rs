//! The generation benchmark: prefill and decoding of each residual mode (or of checkpoints, in
//! whatever format they are stored), interleaved round by round, with the decode latency's ratio
//! to the reference model; and the machine's memory bandwidth measured in the same run, with
//! the decoding speed it allows: one decode step reads every weight once.

use super::{median, mode_name, pseudo_tokens, ratio_to, relative};
use crate::model::{Config, Model, ResidualKind};
use anyhow::Result;
use serde::Serialize;
use std::fmt::Write as _;
use std::time::Instant;

#[derive(Serialize, Debug, Clone)]
pub struct DecodeResult {
    pub batch: usize,
    /// Median seconds of one prefill pass over `batch` prompts.
    pub prefill_seconds: f64,
    pub prefill_tokens_per_second: f64,
    /// Median seconds of one decode step (one new token for each of `batch` sequences), over
    /// every step of every round: a step delayed by the machine's other work moves the median
    /// little, where it would move a mean.
    pub step_seconds: f64,
    pub decode_tokens_per_second: f64,
    /// The median over rounds of this mode's median step over `standard`'s in the same round
    /// (within a round the modes run back to back, in an order that rotates from round to
    /// round, so each ratio compares measurements taken moments apart).
    pub latency_relative_to_standard: Option<f64>,
    /// A 95% confidence interval of that median ([`super::median_ci95`]), from 6 rounds on.
    pub latency_relative_to_standard_ci95: Option<(f64, f64)>,
    pub prefill_relative_to_standard: Option<f64>,
    /// Seconds per decode step spent in each phase, when profiling was on (largest first).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub decode_profile: Vec<(String, f64)>,
}

#[derive(Serialize, Debug, Clone)]
pub struct GenerateModeResult {
    /// The mode, or the checkpoint and the format of its matrices.
    pub name: String,
    pub residual: String,
    pub num_blocks: usize,
    /// Bytes of weights one decoding step reads ([`Model::weight_bytes`]).
    pub weight_bytes: usize,
    /// Decoding tokens per second at batch 1 if reading the weights at the measured bandwidth
    /// were all a step did.
    pub bound_tokens_per_second: f64,
    /// Bytes per token: key/value cache (kept for the whole context) and depth cache (kept
    /// while the token passes through the layers).
    pub kv_cache_bytes_per_token: usize,
    pub depth_cache_bytes_per_token: usize,
    pub batches: Vec<DecodeResult>,
}

#[derive(Serialize, Debug)]
pub struct GenerateReport {
    /// The model the ratios compare with.
    pub reference: Option<String>,
    /// Memory read bandwidth, bytes per second ([`crate::kernels::read_bandwidth`]).
    pub read_bandwidth: f64,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub rounds: usize,
    pub threads: usize,
    pub modes: Vec<GenerateModeResult>,
}

/// Decoding steps each mode runs in one turn of the generation benchmark.
const TURN: usize = 8;

/// A model under test and its name in the tables.
pub struct Named {
    pub name: String,
    pub model: Model,
}

impl Named {
    /// A freshly initialised model of each mode's config, named by its mode.
    pub fn modes(configs: &[Config]) -> Result<Vec<Named>> {
        configs
            .iter()
            .map(|c| {
                let name = mode_name(&format!("{:?}", c.residual).to_lowercase(), c.num_blocks);
                Ok(Named { name, model: Model::init(c.clone(), 0)? })
            })
            .collect()
    }
}

/// The generation benchmark: per round and batch size, every model prefills `batch` prompts of
/// `prompt_tokens` tokens in one pass and then decodes `new_tokens` tokens per sequence, one step
/// at a time, the models taking turns of [`TURN`] steps. Tokens fed are fixed pseudo-random ids,
/// so all models do the same work whatever their logits say. Ratios are to the `standard` mode
/// when there is one, else to the first model.
#[allow(clippy::too_many_arguments)]
pub fn run_generate(
    named: Vec<Named>,
    prompt_tokens: usize,
    new_tokens: usize,
    batches: &[usize],
    warmup: usize,
    rounds: usize,
    mut progress: impl FnMut(&str),
) -> Result<GenerateReport> {
    use crate::model::decode::{CacheFootprint, KvCache};
    anyhow::ensure!(
        new_tokens >= 2,
        "--new-tokens must be at least 2 (the first decoding step of each turn is not timed)"
    );
    anyhow::ensure!(!named.is_empty(), "no model to benchmark");
    let vocab = named.iter().map(|n| n.model.config.vocab_size).min().unwrap_or(1);
    let names: Vec<String> = named.iter().map(|n| n.name.clone()).collect();
    let models: Vec<Model> = named.into_iter().map(|n| n.model).collect();
    progress("measuring the memory bandwidth");
    let bandwidth = crate::kernels::read_bandwidth();
    // [mode][batch] -> per-round seconds
    let mut prefill = vec![vec![Vec::new(); batches.len()]; models.len()];
    let mut decode = vec![vec![Vec::new(); batches.len()]; models.len()];
    // [mode][batch] -> per-round median step
    let mut round_steps = vec![vec![Vec::new(); batches.len()]; models.len()];
    let mut phases: Vec<Vec<std::collections::BTreeMap<&str, f64>>> =
        vec![vec![Default::default(); batches.len()]; models.len()];
    for round in 0..warmup + rounds {
        for (bi, &batch) in batches.iter().enumerate() {
            let prompts: Vec<Vec<u32>> =
                (0..batch).map(|b| pseudo_tokens(prompt_tokens, vocab, 10 + b as u64)).collect();
            let fed = pseudo_tokens(batch * new_tokens, vocab, 99);
            let mut caches = models
                .iter()
                .map(|m| KvCache::new(&m.config, batch, prompt_tokens + new_tokens))
                .collect::<Result<Vec<_>>>()?;
            let mut pre = vec![0.0; models.len()];
            let mut dec = vec![Vec::new(); models.len()];
            // The modes take turns: each prefills, then each decodes TURN steps at a time, so
            // that the steps compared run a few milliseconds apart under the same machine load;
            // the order rotates from round to round. The first step of a turn is not timed:
            // it brings the model's weights back into cache after the other modes' turns (in
            // real use one model runs on its own and stays there).
            let order: Vec<usize> = (0..models.len()).map(|k| (k + round) % models.len()).collect();
            let chunks: Vec<(usize, &[u32])> =
                prompts.iter().enumerate().map(|(b, p)| (b, p.as_slice())).collect();
            for &i in &order {
                let t = Instant::now();
                std::hint::black_box(models[i].decode(&mut caches[i], &chunks, false)?);
                pre[i] = t.elapsed().as_secs_f64();
            }
            crate::base::profile::take();
            for turn in (0..new_tokens).step_by(TURN) {
                for &i in &order {
                    for step in turn..(turn + TURN).min(new_tokens) {
                        let toks = &fed[step * batch..(step + 1) * batch];
                        let chunks: Vec<(usize, &[u32])> =
                            (0..batch).map(|b| (b, &toks[b..b + 1])).collect();
                        let t = Instant::now();
                        std::hint::black_box(models[i].decode(&mut caches[i], &chunks, false)?);
                        let secs = t.elapsed().as_secs_f64();
                        let phase_times = crate::base::profile::take();
                        if step == turn {
                            continue;
                        }
                        dec[i].push(secs);
                        if round >= warmup {
                            for (name, secs, _) in phase_times {
                                *phases[i][bi].entry(name).or_default() += secs;
                            }
                        }
                    }
                }
            }
            if round >= warmup {
                for i in 0..models.len() {
                    prefill[i][bi].push(pre[i]);
                    decode[i][bi].extend_from_slice(&dec[i]);
                    round_steps[i][bi].push(median(&dec[i]));
                }
            }
            let per_mode: Vec<String> = names
                .iter()
                .zip(&dec)
                .map(|(m, d)| format!("{} {:.2} ms", m, median(d) * 1e3))
                .collect();
            progress(&format!(
                "{} round {:>2}/{} batch {batch}: decode step {}",
                if round < warmup { "warmup" } else { "timed " },
                round + 1,
                warmup + rounds,
                per_mode.join(", ")
            ));
        }
    }
    let base = models
        .iter()
        .position(|m| m.config.residual == ResidualKind::Standard && !m.is_quantized())
        .or(Some(0));
    let modes = models
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let fp = CacheFootprint::of(&m.config);
            let batches = batches
                .iter()
                .enumerate()
                .map(|(bi, &batch)| {
                    let (pre, step) = (median(&prefill[i][bi]), median(&decode[i][bi]));
                    let latency =
                        base.map(|b| ratio_to(&round_steps[i][bi], &round_steps[b][bi], b == i));
                    DecodeResult {
                        batch,
                        prefill_seconds: pre,
                        prefill_tokens_per_second: (batch * prompt_tokens) as f64 / pre,
                        step_seconds: step,
                        decode_tokens_per_second: batch as f64 / step,
                        latency_relative_to_standard: latency.map(|(r, _)| r),
                        latency_relative_to_standard_ci95: latency.and_then(|(_, ci)| ci),
                        prefill_relative_to_standard: base
                            .map(|b| ratio_to(&prefill[i][bi], &prefill[b][bi], b == i).0),
                        decode_profile: {
                            let steps = decode[i][bi].len() as f64;
                            let mut v: Vec<(String, f64)> = phases[i][bi]
                                .iter()
                                .map(|(k, v)| (k.to_string(), v / steps))
                                .collect();
                            v.sort_by(|a, b| b.1.total_cmp(&a.1));
                            v
                        },
                    }
                })
                .collect();
            GenerateModeResult {
                name: names[i].clone(),
                weight_bytes: m.weight_bytes(),
                bound_tokens_per_second: bandwidth / m.weight_bytes() as f64,
                residual: format!("{:?}", m.config.residual).to_lowercase(),
                num_blocks: m.config.num_blocks,
                kv_cache_bytes_per_token: 4 * fp.kv,
                depth_cache_bytes_per_token: 4 * fp.depth,
                batches,
            }
        })
        .collect();
    Ok(GenerateReport {
        reference: base.map(|b| names[b].clone()),
        read_bandwidth: bandwidth,
        prompt_tokens,
        new_tokens,
        rounds,
        threads: rayon::current_num_threads(),
        modes,
    })
}

impl GenerateReport {
    /// Throughput and latency per mode and batch size, cache sizes per mode and, when profiled,
    /// the phases of a decode step.
    pub fn table(&self) -> String {
        let mut t = String::new();
        let reference = self.reference.as_deref().unwrap_or("-");
        let _ = writeln!(t, "| model | batch | prefill tokens/s | decode ms/step | decode tokens/s | decode latency vs {reference} (95% CI) | prefill time vs {reference} |");
        t.push_str("|---|---:|---:|---:|---:|---:|---:|\n");
        let name = |m: &GenerateModeResult| m.name.clone();
        let batches = self.modes.first().map_or(0, |m| m.batches.len());
        for b in 0..batches {
            for m in &self.modes {
                let r = &m.batches[b];
                let _ = writeln!(
                    t,
                    "| {} | {} | {:.0} | {:.2} | {:.0} | {} | {} |",
                    name(m),
                    r.batch,
                    r.prefill_tokens_per_second,
                    r.step_seconds * 1e3,
                    r.decode_tokens_per_second,
                    relative(r.latency_relative_to_standard, r.latency_relative_to_standard_ci95),
                    relative(r.prefill_relative_to_standard, None)
                );
            }
        }
        t.push_str("\n| model | KV cache bytes/token (whole context) | depth cache bytes/token (while in flight) | weights read per step | decode tokens/s bound by bandwidth | batch-1 decode, share of the bound |\n");
        t.push_str("|---|---:|---:|---:|---:|---:|\n");
        for m in &self.modes {
            let one = m.batches.iter().find(|r| r.batch == 1);
            let _ = writeln!(
                t,
                "| {} | {} | {} | {} | {:.0} | {} |",
                name(m),
                m.kv_cache_bytes_per_token,
                m.depth_cache_bytes_per_token,
                crate::base::memory::format_bytes(m.weight_bytes as u128),
                m.bound_tokens_per_second,
                one.map_or("-".into(), |r| format!(
                    "{:.0}%",
                    100.0 * r.decode_tokens_per_second / m.bound_tokens_per_second
                ))
            );
        }
        let _ = writeln!(
            t,
            "\nmemory read bandwidth: {:.1} GB/s (a read of 256 MiB, all threads, best of 3)",
            self.read_bandwidth / 1e9
        );
        for m in &self.modes {
            for r in m.batches.iter().filter(|r| !r.decode_profile.is_empty()) {
                let _ = writeln!(t, "\nphases of one {} decode step, batch {}:", name(m), r.batch);
                for (phase, secs) in &r.decode_profile {
                    let _ = writeln!(
                        t,
                        "  {phase:<16} {:>8.1} us  {:>5.1}%",
                        secs * 1e6,
                        100.0 * secs / r.step_seconds
                    );
                }
            }
        }
        t
    }
}
