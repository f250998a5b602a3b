//! The training-step benchmark: forward + backward time per residual mode, measured
//! interleaved (one step of each mode per round) so that machine noise hits all modes alike.

use crate::kernels::matmul::{matmul, threads};
use crate::model::{Config, Model, ResidualKind};
use anyhow::Result;
use serde::Serialize;
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
    /// Seconds per step spent in each phase, when profiling was on (largest first).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub profile: Vec<(String, f64)>,
}

#[derive(Serialize, Debug)]
pub struct BenchReport {
    pub batch: usize,
    pub seq: usize,
    pub threads: usize,
    pub steps: usize,
    /// Best GFLOP/s of a large square f32 matrix product on this machine.
    pub matmul_peak_gflops: f64,
    pub modes: Vec<ModeResult>,
}

/// Useful floating-point operations of one training step (forward + backward = 3 × forward):
/// every matrix product, and causal attention counted on its lower triangle.
pub fn step_flops(c: &Config, batch: usize, seq: usize) -> f64 {
    let n = (batch * seq) as f64;
    let (d, f, v) = (c.hidden_size as f64, c.intermediate_size as f64, c.vocab_size as f64);
    let per_layer = d * c.qkv_width() as f64 + (c.num_attention_heads * c.head_dim) as f64 * d + 3.0 * d * f;
    let linear = 2.0 * n * (per_layer * c.num_hidden_layers as f64 + d * v);
    let attn = 2.0 * 2.0 * (batch * c.num_attention_heads) as f64 * (seq * seq) as f64 / 2.0 * c.head_dim as f64;
    3.0 * (linear + attn * c.num_hidden_layers as f64)
}

/// Best of a few `size³` products, in GFLOP/s.
pub fn matmul_peak(size: usize) -> f64 {
    let a = vec![0.5f32; size * size];
    let b = vec![0.25f32; size * size];
    let mut c = vec![0.0f32; size * size];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        matmul(&mut c, &a, false, &b, false, size, size, size, false, threads());
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (size as f64).powi(3) / best / 1e9
}

/// Runs `warmup` + `steps` interleaved rounds over the given configs.
pub fn run(configs: &[Config], batch: usize, seq: usize, warmup: usize, steps: usize, mut progress: impl FnMut(&str)) -> Result<BenchReport> {
    let models: Vec<Model> = configs.iter().map(|c| Model::init(c.clone(), 0)).collect::<Result<_>>()?;
    let vocab = configs[0].vocab_size as u64;
    // Deterministic pseudo-random tokens.
    let mut x = 0x2545F4914F6CDD1Du64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % vocab) as u32
    };
    let ids: Vec<u32> = (0..batch * seq).map(|_| next()).collect();
    let targets: Vec<u32> = (0..batch * seq).map(|_| next()).collect();
    let mut times = vec![Vec::new(); models.len()];
    let mut phases: Vec<std::collections::BTreeMap<&str, f64>> = vec![Default::default(); models.len()];
    for round in 0..warmup + steps {
        for (i, m) in models.iter().enumerate() {
            let t = Instant::now();
            let f = m.forward(&ids, batch, seq)?;
            let (loss, grads) = m.backward(&f, &targets)?;
            let dt = t.elapsed().as_secs_f64();
            std::hint::black_box((loss, grads));
            let prof = crate::profile::take();
            if round >= warmup {
                times[i].push(dt);
                for (name, secs, _) in prof {
                    *phases[i].entry(name).or_default() += secs / steps as f64;
                }
            }
            progress(&format!(
                "{} {:>8} step {:>2}/{}: {:.3} s",
                if round < warmup { "warmup" } else { "timed " },
                label(&m.config),
                round + 1,
                warmup + steps,
                dt
            ));
        }
    }
    let peak = matmul_peak(1024);
    let raw = times.clone();
    let mut modes: Vec<ModeResult> = models
        .iter()
        .zip(&mut times)
        .zip(&phases)
        .map(|((m, t), ph)| {
            let mut profile: Vec<(String, f64)> = ph.iter().map(|(k, v)| (k.to_string(), *v)).collect();
            profile.sort_by(|a, b| b.1.total_cmp(&a.1));
            t.sort_by(|a, b| a.total_cmp(b));
            let med = t[t.len() / 2];
            ModeResult {
                residual: format!("{:?}", m.config.residual).to_lowercase(),
                num_blocks: m.config.num_blocks,
                params: m.params.len(),
                step_seconds: med,
                tokens_per_second: (batch * seq) as f64 / med,
                gflops: step_flops(&m.config, batch, seq) / med / 1e9,
                relative_to_standard: None,
                profile,
            }
        })
        .collect();
    // Relative cost: the median over rounds of each round's ratio, since the steps of one round
    // run back to back and share the machine's state of the moment.
    if let Some(base) = models.iter().position(|m| m.config.residual == ResidualKind::Standard) {
        for (i, m) in modes.iter_mut().enumerate() {
            let mut r: Vec<f64> = raw[i].iter().zip(&raw[base]).map(|(a, b)| a / b).collect();
            r.sort_by(|a, b| a.total_cmp(b));
            m.relative_to_standard = Some(r[r.len() / 2]);
        }
    }
    Ok(BenchReport { batch, seq, threads: rayon::current_num_threads(), steps, matmul_peak_gflops: peak, modes })
}

pub fn label(c: &Config) -> String {
    match c.residual {
        ResidualKind::Block => format!("block{}", c.num_blocks),
        r => format!("{r:?}").to_lowercase(),
    }
}
