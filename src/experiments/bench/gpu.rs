//! Training steps on an NVIDIA GPU timed (`bench --device cuda`): each residual mode's whole
//! step (forward, backward, clipping, AdamW) on the same batch, its tokens per second, model
//! TFLOP/s against cuBLASLt's measured rate on this GPU, and the peak of the device memory the
//! step's buffers hold.

use super::{pseudo_tokens, step_flops};
use crate::gpu::act::Act;
use crate::gpu::blas::Gemm;
use crate::gpu::buffer::Bf16;
use crate::gpu::device::Device;
use crate::gpu::gemm::gemm;
use crate::gpu::profile::Op;
use crate::gpu::Precision;
use crate::model::{Config, Model};
use crate::train::gpu::trainer;
use crate::train::optim::{OptimConfig, Optimizer};
use anyhow::Result;
use serde::Serialize;
use std::fmt::Write as _;
use std::time::Instant;

#[derive(Serialize)]
pub struct GpuModeResult {
    pub residual: String,
    /// Median over the timed steps.
    pub step_seconds: f64,
    pub tokens_per_second: f64,
    pub model_tflops: f64,
    /// The most bytes the device's buffers held during the mode's steps.
    pub peak_bytes: usize,
    /// Step time over the first mode's.
    pub vs_first: f64,
    /// With `Plan::profile`, the operations of one more step, the costliest first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub profile: Vec<Op>,
}

#[derive(Serialize)]
pub struct GpuBenchReport {
    pub device: String,
    pub precision: String,
    pub batch: usize,
    pub seq: usize,
    /// Backward recomputed each sublayer's work.
    pub recompute: bool,
    /// cuBLASLt's rate on this GPU at the activations' precision (products of `peak_size`³,
    /// [`blas_peak`]), in TFLOP/s.
    pub blas_tflops: f64,
    pub peak_size: usize,
    pub modes: Vec<GpuModeResult>,
}

/// cuBLASLt's rate on `size³` products of `A` values, in TFLOP/s: the best of six rounds of
/// 20 products queued back to back (one product alone would also time its launch and the
/// wait), on values in [-0.5, 0.5) that vary as real data does (a GPU multiplies constant
/// operands faster: fewer bits toggle).
pub fn blas_peak<A: Act>(dev: &Device, size: usize) -> Result<f64> {
    const PRODUCTS: usize = 20;
    // xorshift64: varied bits, the same every run.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        A::from_f32((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
    };
    let values: Vec<A> = (0..size * size).map(|_| next()).collect();
    let a = dev.upload(&values)?;
    let mut c = dev.zeros::<A>(size * size)?;
    let g = Gemm::packed(size, size, size, false, false).typed(A::TYPE, A::TYPE);
    let mut best = f64::MAX;
    for _ in 0..6 {
        dev.synchronize()?;
        let t = Instant::now();
        for _ in 0..PRODUCTS {
            // SAFETY: `a` and `c` hold size² values, which the product spans; `c` is its own.
            unsafe { gemm(dev, &g, a.arg(), a.arg(), c.arg_mut()) }?;
        }
        dev.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64() / PRODUCTS as f64);
    }
    Ok(2.0 * (size as f64).powi(3) / best / 1e12)
}

/// What [`run`] times: `steps` training steps (after `warmup` untimed ones) on `batch`
/// sequences of `seq` tokens, and cuBLASLt's rate at `peak_size`³.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub batch: usize,
    pub seq: usize,
    pub warmup: usize,
    pub steps: usize,
    pub peak_size: usize,
    pub precision: Precision,
    /// Backward recomputes each sublayer's work (the training setting `recompute`).
    pub recompute: bool,
    /// Times each operation of one more step ([`Device::profile_open`]).
    pub profile: bool,
}

/// Times the steps of `plan` of a fresh model of each config on `dev` (named `name`), one mode
/// after another.
pub fn run(
    dev: &Device,
    name: &str,
    configs: &[Config],
    plan: Plan,
    mut progress: impl FnMut(&str),
) -> Result<GpuBenchReport> {
    let Plan { batch, seq, warmup, steps, peak_size, precision, recompute, profile } = plan;
    let blas_tflops = match precision {
        Precision::Fp32 => blas_peak::<f32>(dev, peak_size)?,
        Precision::Bf16 => blas_peak::<Bf16>(dev, peak_size)?,
    };
    let mut modes: Vec<GpuModeResult> = Vec::new();
    for c in configs {
        let vocab = c.vocab_size;
        let batches =
            [(pseudo_tokens(batch * seq, vocab, 1), pseudo_tokens(batch * seq, vocab, 2))];
        let model = Model::init(c.clone(), 0)?;
        let opt = Optimizer::new(OptimConfig::default(), &model.layout);
        let mut trainer = trainer::start(dev.clone(), &model, &opt, precision, recompute)?;
        drop((model, opt));
        dev.reset_peak();
        let mut times = Vec::new();
        for step in 0..warmup + steps {
            dev.synchronize()?;
            let t = Instant::now();
            trainer.step(&batches, batch, 1e-4, step)?;
            dev.synchronize()?;
            let dt = t.elapsed().as_secs_f64();
            if step >= warmup {
                times.push(dt);
            }
            let label = c.residual_label();
            let kind = if step < warmup { "warmup" } else { "timed " };
            progress(&format!(
                "{kind} {label:>8} step {:>2}/{}: {dt:.3} s",
                step + 1,
                warmup + steps
            ));
        }
        let peak_bytes = dev.memory().1;
        let profile = if profile {
            dev.synchronize()?;
            dev.profile_open();
            trainer.step(&batches, batch, 1e-4, warmup + steps)?;
            dev.profile_close()?
        } else {
            Vec::new()
        };
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let first = modes.first().map_or(median, |m| m.step_seconds);
        modes.push(GpuModeResult {
            residual: c.residual_label(),
            step_seconds: median,
            tokens_per_second: (batch * seq) as f64 / median,
            model_tflops: step_flops(c, batch, seq) / median / 1e12,
            peak_bytes,
            vs_first: median / first,
            profile,
        });
    }
    let (device, precision) = (name.to_string(), precision.to_string());
    Ok(GpuBenchReport { device, precision, batch, seq, recompute, blas_tflops, peak_size, modes })
}

impl GpuBenchReport {
    /// A Markdown table, one row per mode.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{}, batch {} x {} tokens, {}{}; cuBLASLt {} at {}^3: {:.1} TFLOP/s\n\n",
            self.device,
            self.batch,
            self.seq,
            self.precision,
            if self.recompute { ", recomputing activations" } else { "" },
            self.precision,
            self.peak_size,
            self.blas_tflops
        );
        out.push_str(
            "| mode | step ms | tokens/s | model TFLOP/s | of cuBLASLt | peak GB | / first |\n",
        );
        out.push_str("|---|---:|---:|---:|---:|---:|---:|\n");
        for m in &self.modes {
            let _ = writeln!(
                out,
                "| {} | {:.1} | {:.0} | {:.1} | {:.0}% | {:.2} | {:.2}x |",
                m.residual,
                m.step_seconds * 1e3,
                m.tokens_per_second,
                m.model_tflops,
                100.0 * m.model_tflops / self.blas_tflops,
                m.peak_bytes as f64 / 1e9,
                m.vs_first
            );
        }
        for m in self.modes.iter().filter(|m| !m.profile.is_empty()) {
            out.push_str(&profile_table(m));
        }
        out
    }
}

/// The operations of one profiled step of mode `m`: the costliest each on a line (cuBLASLt's
/// products together), the rest together; then the products by shape, with their rate.
fn profile_table(m: &GpuModeResult) -> String {
    const SHOWN: usize = 16;
    let total: f64 = m.profile.iter().map(|op| op.seconds).sum();
    let (products, others): (Vec<&Op>, Vec<&Op>) = m.profile.iter().partition(|op| op.is_product());
    let together = |what: String, ops: &[&Op]| Op {
        what,
        seconds: ops.iter().map(|op| op.seconds).sum(),
        calls: ops.iter().map(|op| op.calls).sum(),
        flops: ops.iter().map(|op| op.flops).sum(),
    };
    // The costliest SHOWN of `ops` (sorted), then the rest on one line.
    let shown = |mut ops: Vec<Op>| {
        if ops.len() > SHOWN {
            let rest: Vec<&Op> = ops[SHOWN..].iter().collect();
            let rest = together(format!("{} others", rest.len()), &rest);
            ops.truncate(SHOWN);
            ops.push(rest);
        }
        ops
    };
    let mut main: Vec<Op> = others.into_iter().cloned().collect();
    if !products.is_empty() {
        main.push(together("matrix products (cuBLASLt)".into(), &products));
    }
    main.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    let line = |out: &mut String, op: &Op, width: usize| {
        let share = 100.0 * op.seconds / total;
        let rate = if op.flops > 0.0 {
            format!(" {:>6.1} TFLOP/s", op.flops / op.seconds / 1e12)
        } else {
            String::new()
        };
        let (what, ms, calls) = (&op.what, op.seconds * 1e3, op.calls);
        let _ = writeln!(out, "  {what:<width$} {ms:>8.2} ms {share:>5.1}% {calls:>5} calls{rate}");
    };
    let mut out = format!("\none {} step by operation ({:.1} ms):\n", m.residual, total * 1e3);
    for op in &shown(main) {
        line(&mut out, op, 34);
    }
    if !products.is_empty() {
        out.push_str("\nits matrix products by shape:\n");
        for op in &shown(products.into_iter().cloned().collect()) {
            line(&mut out, op, 60);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::params::Layout;
    use crate::model::ResidualKind;

    /// The table's figures come from the steps it timed.
    #[test]
    fn a_benchmark_on_the_emulated_gpu_reports_each_mode() {
        let Some(dev) = Device::emulated("a_benchmark_on_the_emulated_gpu_reports_each_mode")
        else {
            return;
        };
        let c = report_config();
        let block = Config { residual: ResidualKind::Block, num_blocks: 1, ..c.clone() };
        let plan = Plan {
            batch: 2,
            seq: 16,
            warmup: 1,
            steps: 2,
            peak_size: 64,
            precision: Precision::Bf16,
            recompute: false,
            profile: true,
        };
        let report = run(&dev, "emulated", &[c, block], plan, |_| {}).unwrap();
        assert_eq!(report.modes.len(), 2);
        let m = &report.modes[0];
        assert!(m.step_seconds > 0.0 && m.tokens_per_second == 32.0 / m.step_seconds);
        // Parameters, gradients and two moments at the least.
        assert!(m.peak_bytes >= 4 * 4 * Layout::new(&report_config()).total);
        let table = report.table();
        assert!(table.contains("| standard |") && table.contains("| block"), "{table}");
        // The profiled step's operations: the depth attention's kernels in Block's alone.
        let ops = |m: &GpuModeResult| -> Vec<String> {
            assert!(m.profile.iter().all(|op| op.seconds >= 0.0 && op.calls > 0));
            assert!(m.profile[0].seconds > 0.0);
            m.profile.iter().map(|op| op.what.clone()).collect()
        };
        let (standard, block) = (ops(&report.modes[0]), ops(&report.modes[1]));
        for op in ["adamw", "flash_forward_bf16_hd16"] {
            assert!(standard.iter().any(|o| o == op) && block.iter().any(|o| o == op), "{op}");
        }
        // The products by shape, with their operations: the language-model head's forward
        // product, once a step.
        let c = report_config();
        let (tokens, d, v) = (2 * 16, c.hidden_size, c.vocab_size);
        let head = format!("C[{tokens}, {v}] = A[{tokens}, {d}]·B[{v}, {d}]ᵀ bf16→bf16");
        let found = report.modes[0].profile.iter().find(|op| op.what == head);
        let found = found.unwrap_or_else(|| panic!("no {head} in {standard:?}"));
        assert_eq!((found.calls, found.flops), (1, 2.0 * (tokens * d * v) as f64));
        // (Whether the products together make one of the costliest lines depends on timings.)
        assert!(table.contains("its matrix products by shape") && table.contains(&head), "{table}");
        let depth = |ops: &[String]| ops.iter().any(|o| o.starts_with("depth_phase1"));
        assert!(depth(&block) && !depth(&standard), "{block:?}");
        assert!(table.contains("one block1 step by operation"), "{table}");
    }

    /// Block AttnRes's peak memory against the standard residual's at the PyTorch anchor's
    /// shape (hidden 1024, 24 layers, 16 heads, FFN 2816, vocabulary 49152, Block with 8
    /// blocks, 16 x 2048 tokens): the device's meter counts the same buffers on the emulator
    /// as on a GPU, so it is measured here at 16 and 48 tokens and projected along the line
    /// through them to 32768. The target is at most 1.1x. cuBLASLt's workspace, the same in
    /// both, is left out.
    #[test]
    #[ignore = "a measurement: about 13 minutes on two cores"]
    fn peak_memory_at_the_anchor_shape_projected_on_the_emulator() {
        let Some(dev) = Device::emulated("peak_memory_at_the_anchor_shape") else { return };
        let anchor = Config {
            hidden_size: 1024,
            num_hidden_layers: 24,
            num_attention_heads: 16,
            num_key_value_heads: 16,
            head_dim: 64,
            intermediate_size: 2816,
            vocab_size: 49152,
            max_position_embeddings: 2048,
            num_blocks: 8,
            ..crate::train::presets::model_config("small").unwrap()
        };
        let modes = [ResidualKind::Standard, ResidualKind::Block]
            .map(|residual| Config { residual, ..anchor.clone() });
        let peaks = |seq: usize| -> Vec<f64> {
            let plan = Plan {
                batch: 1,
                seq,
                warmup: 0,
                steps: 1,
                peak_size: 64,
                precision: Precision::Bf16,
                recompute: false,
                profile: false,
            };
            let report = run(&dev, "emulated", &modes, plan, |_| {}).unwrap();
            report.modes.iter().map(|m| m.peak_bytes as f64).collect()
        };
        let (few, more, anchor_tokens) = (16, 48, 16 * 2048);
        let (small, large) = (peaks(few), peaks(more));
        let per_token = |s: f64, l: f64| (l - s) / (more - few) as f64;
        let projected: Vec<f64> = small
            .iter()
            .zip(&large)
            .map(|(&s, &l)| s + per_token(s, l) * (anchor_tokens - few) as f64)
            .collect();
        let ratio = projected[1] / projected[0];
        eprintln!(
            "peak bytes at {few} tokens {small:?}, at {more} {large:?}; projected to \
             {anchor_tokens}: standard {:.2} GB, block {:.2} GB, {ratio:.3}x",
            projected[0] / 1e9,
            projected[1] / 1e9
        );
        assert!(ratio <= 1.1, "Block's peak memory {ratio:.3}x the standard residual's");
    }

    fn report_config() -> Config {
        Config {
            vocab_size: 64,
            hidden_size: 32,
            intermediate_size: 48,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            num_key_value_heads: 2,
            head_dim: 16,
            residual: ResidualKind::Standard,
            ..Config::default()
        }
    }
}
