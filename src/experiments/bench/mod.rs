//! Benchmarks, measured interleaved so that machine noise hits all residual modes alike: the
//! training step (forward + backward, one step of each mode per round) here, and generation
//! (one prefill and one decoding run of each mode per round) in [`generate`]; their results as
//! Markdown tables.

pub mod generate;
pub mod gpu;

use crate::kernels::matmul::{matmul, threads};
use crate::model::{Config, Model, ResidualKind};
use anyhow::{ensure, Result};
use serde::Serialize;
use std::fmt::Write as _;
use std::time::Instant;

#[derive(Serialize, Debug, Clone)]
pub struct ModeResult {
    pub residual: String,
    pub num_blocks: usize,
    pub params: usize,
    /// Median seconds of one forward+backward step.
    pub step_seconds: f64,
    pub tokens_per_second: f64,
    pub gflops: f64,
    /// Median over rounds of (this step / the `standard` step of the same round).
    pub relative_to_standard: Option<f64>,
    /// A 95% confidence interval of that median ([`median_ci95`]), from 6 rounds on: with an
    /// identical model as a control (`--modes standard,standard,block`) it says whether a cost
    /// stands out of the noise.
    pub relative_to_standard_ci95: Option<(f64, f64)>,
    /// Fastest step seconds, and its ratio to `standard`'s fastest: the machine's other work
    /// only ever adds time, so the fastest steps are the least disturbed.
    pub fastest_step_seconds: f64,
    pub fastest_relative_to_standard: Option<f64>,
    /// The 1024³ product's GFLOP/s measured right after each timed step (best of 3).
    pub adjacent_peaks_gflops: Vec<f64>,
    /// Median over timed steps of the step's GFLOP/s over the peak measured right after it.
    /// Shared cores swing the machine's speed by up to 2x from minute to minute; a step and a
    /// product seconds apart see the same machine, so this share moves far less than one taken
    /// against a peak measured once.
    pub share_of_adjacent_peak: f64,
    /// Seconds per step spent in each phase, when profiling was on (largest first).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub profile: Vec<(String, f64)>,
}

#[derive(Serialize, Debug)]
pub struct BenchReport {
    pub batch: usize,
    pub seq: usize,
    /// Activation recomputation on.
    pub recompute: bool,
    pub threads: usize,
    pub steps: usize,
    /// Best GFLOP/s of a large square f32 matrix product on this machine.
    pub matmul_peak_gflops: f64,
    /// The hardware's f32 ceiling on these threads: fused multiply-adds on registers only
    /// ([`fma_ceiling`]); absent where it is not measured (no AVX2+FMA).
    pub fma_ceiling_gflops: Option<f64>,
    pub modes: Vec<ModeResult>,
}

/// Useful floating-point operations of one training step (forward + backward = 3 × forward):
/// every matrix product, and causal attention counted on its lower triangle.
pub fn step_flops(c: &Config, batch: usize, seq: usize) -> f64 {
    let n = (batch * seq) as f64;
    let (d, f, v) = (c.hidden_size as f64, c.intermediate_size as f64, c.vocab_size as f64);
    let per_layer =
        d * c.qkv_width() as f64 + (c.num_attention_heads * c.head_dim) as f64 * d + 3.0 * d * f;
    let linear = 2.0 * n * (per_layer * c.num_hidden_layers as f64 + d * v);
    let attn = 2.0 * 2.0 * (batch * c.num_attention_heads) as f64 * (seq * seq) as f64 / 2.0
        * c.head_dim as f64;
    3.0 * (linear + attn * c.num_hidden_layers as f64)
}

/// Best of `runs` `size³` products, in GFLOP/s.
pub fn matmul_peak(size: usize, runs: usize) -> f64 {
    let a = vec![0.5f32; size * size];
    let b = vec![0.25f32; size * size];
    let mut c = vec![0.0f32; size * size];
    let mut best = f64::MAX;
    for _ in 0..runs {
        let t = Instant::now();
        matmul(&mut c, &a, false, &b, false, size, size, size, false, threads());
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (size as f64).powi(3) / best / 1e9
}

/// The f32 arithmetic ceiling of this machine on all of rayon's threads at once, in GFLOP/s:
/// every thread runs a loop of fused multiply-adds on registers only (16-wide with AVX-512,
/// 8-wide with AVX2), no memory in the loop; the best of three runs. No product can run faster,
/// so it is the yardstick for the matrix kernels and the step (docs/performance.md). `None`
/// without AVX2 and FMA.
pub fn fma_ceiling() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let wide = has!("avx512f");
        if !(has!("avx2") && has!("fma")) {
            return None;
        }
        const ITERS: usize = 2_000_000;
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            // SAFETY: the features each loop needs were detected above.
            rayon::broadcast(|_| unsafe {
                std::hint::black_box(if wide {
                    fma_loop_avx512(ITERS)
                } else {
                    fma_loop_avx2(ITERS)
                })
            });
            best = best.min(t.elapsed().as_secs_f64());
        }
        // Per iteration: 24 registers of 16 lanes, or 12 of 8, two operations per lane.
        let per_iter = if wide { 24 * 16 * 2 } else { 12 * 8 * 2 };
        let threads = rayon::current_num_threads();
        Some((per_iter * ITERS * threads) as f64 / best / 1e9)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// `iters` (even) rounds of 24 independent 16-wide fused multiply-adds (enough chains to keep two
/// FMA units busy through their latency); returns a value that depends on all of them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_loop_avx512(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm512_set1_ps(0.999_9), _mm512_set1_ps(1e-6));
    let mut c = [_mm512_setzero_ps(); 24];
    // Written as in the matrix kernels (a step on the array, called by name), which keeps the
    // array in registers; a plain loop over it left it in memory.
    let step = |c: &mut [__m512; 24]| {
        for i in 0..24 {
            c[i] = _mm512_fmadd_ps(c[i], a, b);
        }
    };
    for _ in 0..iters / 2 {
        step(&mut c);
        step(&mut c);
    }
    let mut out = [[0.0f32; 16]; 24];
    for (o, x) in out.iter_mut().zip(c) {
        _mm512_storeu_ps(o.as_mut_ptr(), x);
    }
    out.as_flattened().iter().sum()
}

/// [`fma_loop_avx512`] with twelve 8-wide chains (AVX2 and FMA).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_loop_avx2(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm256_set1_ps(0.999_9), _mm256_set1_ps(1e-6));
    let mut c = [_mm256_setzero_ps(); 12];
    let step = |c: &mut [__m256; 12]| {
        for i in 0..12 {
            c[i] = _mm256_fmadd_ps(c[i], a, b);
        }
    };
    for _ in 0..iters / 2 {
        step(&mut c);
        step(&mut c);
    }
    let mut out = [[0.0f32; 8]; 12];
    for (o, x) in out.iter_mut().zip(c) {
        _mm256_storeu_ps(o.as_mut_ptr(), x);
    }
    out.as_flattened().iter().sum()
}

/// Runs `warmup` + `steps` interleaved rounds over the given configs (with `recompute`,
/// backward recomputes each sublayer's work: [`Model::forward_with`]).
pub fn run(
    configs: &[Config],
    batch: usize,
    seq: usize,
    recompute: bool,
    warmup: usize,
    steps: usize,
    mut progress: impl FnMut(&str),
) -> Result<BenchReport> {
    let models: Vec<Model> =
        configs.iter().map(|c| Model::init(c.clone(), 0)).collect::<Result<_>>()?;
    let vocab = configs[0].vocab_size;
    let ids = pseudo_tokens(batch * seq, vocab, 1);
    let targets = pseudo_tokens(batch * seq, vocab, 2);
    let mut times = vec![Vec::new(); models.len()];
    let mut adjacent_peaks = vec![Vec::new(); models.len()];
    let mut phases: Vec<std::collections::BTreeMap<&str, f64>> =
        vec![Default::default(); models.len()];
    for round in 0..warmup + steps {
        // The order of the modes rotates from round to round, so none always follows another.
        for k in 0..models.len() {
            let i = (k + round) % models.len();
            let m = &models[i];
            let t = Instant::now();
            let f = m.forward_with(&ids, batch, seq, recompute)?;
            let (loss, grads) = m.backward(&f, &targets)?;
            let dt = t.elapsed().as_secs_f64();
            std::hint::black_box((loss, grads));
            let prof = crate::base::profile::take();
            if round >= warmup {
                times[i].push(dt);
                for (name, secs, _) in prof {
                    *phases[i].entry(name).or_default() += secs / steps as f64;
                }
                adjacent_peaks[i].push(matmul_peak(1024, 3));
            }
            progress(&format!(
                "{} {:>8} step {:>2}/{}: {:.3} s",
                if round < warmup { "warmup" } else { "timed " },
                m.config.residual_label(),
                round + 1,
                warmup + steps,
                dt
            ));
        }
    }
    let peak = matmul_peak(1024, 5);
    let fma_ceiling_gflops = fma_ceiling();
    let raw = times.clone();
    let mut modes: Vec<ModeResult> = models
        .iter()
        .zip(&mut times)
        .zip(&phases)
        .zip(adjacent_peaks)
        .map(|(((m, t), ph), adjacent)| {
            let mut profile: Vec<(String, f64)> =
                ph.iter().map(|(k, v)| (k.to_string(), *v)).collect();
            profile.sort_by(|a, b| b.1.total_cmp(&a.1));
            let flops = step_flops(&m.config, batch, seq);
            let shares: Vec<f64> =
                t.iter().zip(&adjacent).map(|(dt, p)| flops / dt / 1e9 / p).collect();
            t.sort_by(|a, b| a.total_cmp(b));
            let med = t[t.len() / 2];
            ModeResult {
                residual: format!("{:?}", m.config.residual).to_lowercase(),
                num_blocks: m.config.num_blocks,
                params: m.params.len(),
                step_seconds: med,
                tokens_per_second: (batch * seq) as f64 / med,
                gflops: flops / med / 1e9,
                relative_to_standard: None,
                relative_to_standard_ci95: None,
                fastest_step_seconds: t[0],
                fastest_relative_to_standard: None,
                share_of_adjacent_peak: median(&shares),
                adjacent_peaks_gflops: adjacent,
                profile,
            }
        })
        .collect();
    if let Some(base) = models.iter().position(|m| m.config.residual == ResidualKind::Standard) {
        for (i, m) in modes.iter_mut().enumerate() {
            let (ratio, ci) = ratio_to(&raw[i], &raw[base], i == base);
            m.relative_to_standard = Some(ratio);
            m.relative_to_standard_ci95 = ci;
        }
        let base_fastest = modes[base].fastest_step_seconds;
        for m in modes.iter_mut() {
            m.fastest_relative_to_standard = Some(m.fastest_step_seconds / base_fastest);
        }
    }
    Ok(BenchReport {
        batch,
        seq,
        recompute,
        threads: rayon::current_num_threads(),
        steps,
        matmul_peak_gflops: peak,
        fma_ceiling_gflops,
        modes,
    })
}

/// Relative cost: the median over rounds of each round's ratio, since the measurements of one
/// round run back to back and share the machine's state of the moment; with its 95% interval
/// ([`median_ci95`]) unless `base` is the mode itself (`is_base`), whose ratios are all 1.
pub(crate) fn ratio_to(times: &[f64], base: &[f64], is_base: bool) -> (f64, Option<(f64, f64)>) {
    let mut r: Vec<f64> = times.iter().zip(base).map(|(a, b)| a / b).collect();
    r.sort_by(|a, b| a.total_cmp(b));
    (r[r.len() / 2], median_ci95(&r).filter(|_| !is_base))
}

/// A 95% confidence interval of the median of `sorted` (ascending) that assumes nothing about
/// the distribution of the values: the `j`-th smallest and the `j`-th largest, for the largest
/// `j` with P(Binomial(n, 1/2) < j) ≤ 2.5% (each end misses the median at most that often).
/// `None` below 6 values, where even the smallest and largest cover less than 95%.
pub(crate) fn median_ci95(sorted: &[f64]) -> Option<(f64, f64)> {
    let n = sorted.len();
    let ln_2n = n as f64 * std::f64::consts::LN_2;
    // `cdf` = P(X ≤ i), its terms C(n, i) / 2^n through logarithms (2^n overflows from n = 1024).
    let (mut ln_choose, mut cdf, mut j) = (0.0f64, 0.0, 0);
    for i in 0..n {
        cdf += (ln_choose - ln_2n).exp();
        if cdf > 0.025 {
            break;
        }
        j = i + 1;
        ln_choose += ((n - i) as f64).ln() - ((i + 1) as f64).ln();
    }
    (j > 0).then(|| (sorted[j - 1], sorted[n - j]))
}

pub(crate) fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Deterministic pseudo-random token ids (xorshift).
pub(crate) fn pseudo_tokens(n: usize, vocab: usize, salt: u64) -> Vec<u32> {
    let mut x = 0x2545F4914F6CDD1Du64 ^ salt.wrapping_mul(0x9E3779B97F4A7C15);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % vocab as u64) as u32
        })
        .collect()
}

/// One config per residual mode named in `modes` (`standard`, `full`, `block`), each `base`
/// with that residual.
pub fn mode_configs(base: &Config, modes: &[ResidualKind]) -> Result<Vec<Config>> {
    let mut configs = Vec::new();
    for &residual in modes {
        let c = Config { residual, ..base.clone() };
        c.validate()?;
        configs.push(c);
    }
    ensure!(!configs.is_empty(), "--modes is empty");
    Ok(configs)
}

/// A mode's name in a table: `block` shows its number of blocks.
pub(crate) fn mode_name(residual: &str, num_blocks: usize) -> String {
    if residual == "block" {
        format!("block ({num_blocks} blocks)")
    } else {
        residual.to_string()
    }
}

/// A ratio to `standard` (`-` when there is no standard mode), with its confidence interval
/// where there is one.
pub(crate) fn relative(r: Option<f64>, ci: Option<(f64, f64)>) -> String {
    match (r, ci) {
        (None, _) => "-".into(),
        (Some(r), None) => format!("{r:.3}x"),
        (Some(r), Some((lo, hi))) => format!("{r:.3}x ({lo:.3}–{hi:.3})"),
    }
}

impl BenchReport {
    /// The matrix-product peak, a table of modes and, when profiled, each mode's phases.
    pub fn table(&self) -> String {
        let mut t = String::new();
        let mut adjacent: Vec<f64> =
            self.modes.iter().flat_map(|m| m.adjacent_peaks_gflops.iter().copied()).collect();
        adjacent.sort_by(|a, b| a.total_cmp(b));
        let _ = write!(
            t,
            "matrix-product peak (1024^3, f32): {:.1} GFLOP/s at the end",
            self.matmul_peak_gflops
        );
        if let (Some(lo), Some(hi)) = (adjacent.first(), adjacent.last()) {
            let _ = write!(t, ", {lo:.1}-{hi:.1} after each step");
        }
        match self.fma_ceiling_gflops {
            Some(c) => {
                let _ = writeln!(t, "; FMA ceiling of these threads: {c:.1} GFLOP/s");
            }
            None => t.push('\n'),
        }
        // The share of the peak: each step against the peak measured right after it.
        t.push_str("| mode | step (ms) | tokens/s | GFLOP/s | % of peak | vs standard (95% CI) | fastest step (ms) | fastest vs standard |\n");
        t.push_str("|---|---:|---:|---:|---:|---:|---:|---:|\n");
        for m in &self.modes {
            let _ = writeln!(
                t,
                "| {} | {:.1} | {:.0} | {:.1} | {:.0}% | {} | {:.1} | {} |",
                mode_name(&m.residual, m.num_blocks),
                m.step_seconds * 1e3,
                m.tokens_per_second,
                m.gflops,
                100.0 * m.share_of_adjacent_peak,
                relative(m.relative_to_standard, m.relative_to_standard_ci95),
                m.fastest_step_seconds * 1e3,
                relative(m.fastest_relative_to_standard, None)
            );
        }
        for m in self.modes.iter().filter(|m| !m.profile.is_empty()) {
            let _ = writeln!(t, "\nphases of one {} step:", m.residual);
            for (name, secs) in &m.profile {
                let _ = writeln!(
                    t,
                    "  {name:<16} {:>8.1} ms  {:>5.1}%",
                    secs * 1e3,
                    100.0 * secs / m.step_seconds
                );
            }
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::median_ci95;

    /// P(Binomial(n, 1/2) ≤ i) for every i, by Pascal's triangle (halving each row, so no
    /// large numbers): an independent route to what `median_ci95` sums through logarithms.
    fn binomial_cdf(n: usize) -> Vec<f64> {
        let mut row = vec![1.0f64];
        for _ in 0..n {
            let mut next = vec![0.0; row.len() + 1];
            for (i, p) in row.iter().enumerate() {
                next[i] += p / 2.0;
                next[i + 1] += p / 2.0;
            }
            row = next;
        }
        row.iter().scan(0.0, |c, p| Some(*c + p).inspect(|v| *c = *v)).collect()
    }

    #[test]
    fn median_interval_is_the_widest_order_statistics_that_need_to_be() {
        for n in 1..=200 {
            let values: Vec<f64> = (1..=n).map(|i| i as f64).collect();
            let cdf = binomial_cdf(n);
            match median_ci95(&values) {
                None => assert!(cdf[0] > 0.025, "n = {n}: an interval exists"),
                Some((lo, hi)) => {
                    // The j-th smallest and largest: j = lo.
                    let j = lo as usize;
                    assert_eq!(hi as usize, n + 1 - j, "n = {n}: not symmetric");
                    assert!(cdf[j - 1] <= 0.025, "n = {n}: [{lo}, {hi}] covers less than 95%");
                    assert!(cdf[j] > 0.025, "n = {n}: [{lo}, {hi}] is wider than it needs");
                }
            }
        }
        // Published tables of the interval: n = 10: 2nd to 9th; 20: 6th to 15th; 60: 22nd to 39th.
        let ranks = |n: usize| median_ci95(&(1..=n).map(|i| i as f64).collect::<Vec<_>>());
        assert_eq!(ranks(5), None);
        assert_eq!(ranks(10), Some((2.0, 9.0)));
        assert_eq!(ranks(20), Some((6.0, 15.0)));
        assert_eq!(ranks(60), Some((22.0, 39.0)));
    }
}
