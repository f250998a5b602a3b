//! The comparison report: `index.html` with SVG figures (drawn with `plotters`) and a
//! machine-readable `summary.json`, built from the runs of a report directory
//! (the [`crate::experiments::suite::Plan`] that `compare` trained).
//!
//! Figures: validation loss over training for every variant; the RMS of every sublayer's output
//! and of the input it reads (docs/method.md §6: growth with depth for the baseline, bounded for
//! AttnRes); the gradient norm of every sublayer's weights, averaged over training; the
//! depth-attention weights α of every AttnRes variant as heatmaps. Numbers are means over seeds;
//! the spread is the sample standard deviation.
//!
//! This file writes the directory; `runs` reads the runs and holds a variant's row, `stat`
//! the statistics, `figures` the SVGs and `html` the page.

mod figures;
mod html;
mod runs;
mod stat;

use runs::{read_run, Row, Run};
pub use stat::{paired_differences, stat, PowerLaw, ScalePoint, Scaling, Stat};

use crate::base::fs::write_atomic;
use crate::base::version::CodeVersion;
use crate::experiments::suite::{non_embedding_parameters, Plan, Variant};
use anyhow::Result;
use std::path::{Path, PathBuf};

/// Writes `index.html`, `summary.json` and the figures into the report directory; returns the
/// page's path.
pub fn write(out: &Path) -> Result<PathBuf> {
    let plan = Plan::load(out)?;
    let runs: Vec<Vec<Option<Run>>> = plan
        .variants
        .iter()
        .map(|v| {
            (0..plan.seeds)
                .map(|s| read_run(&Plan::run_dir(out, &v.name, s)))
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<_>>()?;
    let rows = summarize(&plan.variants, &runs);
    let scaling = if plan.suite == "scaling" { Some(scaling_fit(&plan, &rows)?) } else { None };
    let versions = code_versions(&runs);
    let summary = serde_json::json!({
        "suite": plan.suite, "seeds": plan.seeds, "baseline": plan.variants[0].name,
        "model": plan.base.model, "train": plan.base.train, "variants": rows, "scaling": scaling,
        "code_versions": versions, "report_code_version": CodeVersion::current(),
    });
    write_atomic(&out.join("summary.json"), serde_json::to_string_pretty(&summary)?.as_bytes())?;

    let finished: Vec<(usize, &Variant, Vec<&Run>)> = plan
        .variants
        .iter()
        .zip(&runs)
        .enumerate()
        .map(|(i, (v, rs))| (i, v, rs.iter().flatten().collect::<Vec<_>>()))
        .filter(|(_, _, rs)| !rs.is_empty())
        .collect();
    let figures = figures::figures(&finished, scaling.as_ref())?;
    let heatmaps = figures::heatmaps(&finished)?;
    for f in figures.iter().chain(&heatmaps) {
        write_atomic(&out.join(&f.file), f.svg.as_bytes())?;
    }
    let page = out.join("index.html");
    let body = html::page(&plan, &rows, scaling.as_ref(), &figures, &heatmaps, &versions);
    write_atomic(&page, body.as_bytes())?;
    Ok(page)
}

/// The versions of the code that finished the runs, each once, in order of first appearance
/// ("unrecorded" for runs made before versions were recorded).
fn code_versions(runs: &[Vec<Option<Run>>]) -> Vec<String> {
    let mut versions: Vec<String> = Vec::new();
    for r in runs.iter().flatten().flatten() {
        let v = r.code_version.as_ref().map_or("unrecorded".to_string(), |v| v.to_string());
        if !versions.contains(&v) {
            versions.push(v);
        }
    }
    versions
}

fn summarize(variants: &[Variant], runs: &[Vec<Option<Run>>]) -> Vec<Row> {
    variants
        .iter()
        .zip(runs)
        .enumerate()
        .filter(|(_, (_, rs))| rs.iter().any(|r| r.is_some()))
        .map(|(i, (v, rs))| {
            let b = v
                .baseline
                .as_ref()
                .and_then(|n| variants.iter().position(|x| &x.name == n))
                .unwrap_or(0);
            let base = &runs[b];
            let base_tps: Vec<f64> = base.iter().flatten().map(|r| r.tokens_per_second).collect();
            let done: Vec<&Run> = rs.iter().flatten().collect();
            let pick = |f: fn(&Run) -> f64| stat(&done.iter().map(|r| f(r)).collect::<Vec<_>>());
            let losses = |rs: &[Option<Run>]| -> Vec<Option<f64>> {
                rs.iter().map(|r| r.as_ref().map(|r| r.val_loss)).collect()
            };
            let diffs = paired_differences(&losses(rs), &losses(base));
            let tps = pick(|r| r.tokens_per_second);
            Row {
                name: v.name.clone(),
                settings: v.sets.clone(),
                seeds_finished: done.len(),
                parameters: done[0].parameters,
                val_loss: pick(|r| r.val_loss),
                val_bits_per_byte: pick(|r| r.bpb),
                val_loss_minus_baseline: (i != b && !diffs.is_empty()).then(|| stat(&diffs)),
                train_tokens_per_second: tps,
                training_overhead: (i != b && !base_tps.is_empty())
                    .then(|| stat(&base_tps).mean / tps.mean - 1.0),
                val_losses: done.iter().map(|r| r.val_loss).collect(),
            }
        })
        .collect()
}

/// The scaling suite's points (one per variant with finished runs) and their fits.
fn scaling_fit(plan: &Plan, rows: &[Row]) -> Result<Scaling> {
    let mut points = Vec::new();
    for r in rows {
        let v = plan.variants.iter().find(|v| v.name == r.name).expect("rows come from variants");
        let cfg = plan.run_config(v, 0)?;
        let n = non_embedding_parameters(&cfg.model);
        let tokens = cfg.train.steps() * cfg.train.batch_tokens;
        let mode = cfg.model.residual_label().trim_end_matches(char::is_numeric).to_string();
        points.push(ScalePoint {
            variant: r.name.clone(),
            mode,
            non_embedding_parameters: n,
            tokens,
            flops: 6.0 * n as f64 * tokens as f64,
            val_loss: r.val_loss.mean,
        });
    }
    Ok(Scaling::fit(points))
}
