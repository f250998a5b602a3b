//! The comparison report: `index.html` with SVG figures (drawn with `plotters`) and a
//! machine-readable `summary.json`, built from the runs of a report directory
//! ([`crate::compare`]).
//!
//! Figures: validation loss over training for every variant; the RMS of every sublayer's output
//! and of the input it reads (SPEC §6: growth with depth for the baseline, bounded for AttnRes);
//! the gradient norm of every sublayer's weights, averaged over training; the depth-attention
//! weights α of every AttnRes variant as heatmaps. Numbers are means over seeds; the spread is
//! the sample standard deviation.

use crate::compare::{Plan, Variant};
use crate::diagnostics::Diagnostics;
use crate::model::checkpoint::write_atomic;
use anyhow::{Context, Result};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Serialize;
use serde_json::Value;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// One finished run, as read back from its directory.
struct Run {
    val_loss: f64,
    bpb: f64,
    tokens_per_second: f64,
    parameters: u64,
    /// Validation loss over training: (tokens, loss).
    curve: Vec<(f64, f64)>,
    /// Mean gradient norm of each sublayer's weights over all steps.
    grad_norms: Vec<f64>,
    diag: Diagnostics,
}

fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is corrupt", path.display()))
}

fn read_run(dir: &Path) -> Result<Option<Run>> {
    if !dir.join("summary.json").exists() || !dir.join("diagnostics.json").exists() {
        return Ok(None);
    }
    let s = read_json(&dir.join("summary.json"))?;
    let num = |k: &str| {
        s[k].as_f64().with_context(|| format!("{}: summary.json has no {k}", dir.display()))
    };
    let diag: Diagnostics = serde_json::from_value(read_json(&dir.join("diagnostics.json"))?)
        .with_context(|| format!("{}: diagnostics.json", dir.display()))?;
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .with_context(|| format!("cannot read {}/metrics.jsonl", dir.display()))?;
    let (mut curve, mut sums, mut steps) =
        (Vec::new(), vec![0.0f64; diag.output_rms.len()], 0usize);
    for line in metrics.lines().filter(|l| !l.trim().is_empty()) {
        let m: Value = serde_json::from_str(line)
            .with_context(|| format!("{}/metrics.jsonl: bad line", dir.display()))?;
        if let (Some(t), Some(v)) = (m["tokens"].as_f64(), m["val_loss"].as_f64()) {
            curve.push((t, v));
        }
        if let Some(g) = m["sublayer_grad_norms"].as_array() {
            for (acc, x) in sums.iter_mut().zip(g) {
                *acc += x.as_f64().unwrap_or(0.0);
            }
            steps += 1;
        }
    }
    let grad_norms = sums.iter().map(|x| x / steps.max(1) as f64).collect();
    Ok(Some(Run {
        val_loss: num("val_loss")?,
        bpb: num("val_bits_per_byte")?,
        tokens_per_second: num("train_tokens_per_second")?,
        parameters: num("parameters")? as u64,
        curve,
        grad_norms,
        diag,
    }))
}

/// Mean and sample standard deviation (0 for a single value).
#[derive(Serialize, Clone, Copy, Debug, PartialEq)]
pub struct Stat {
    pub mean: f64,
    pub std: f64,
}

pub fn stat(v: &[f64]) -> Stat {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let std = if v.len() > 1 {
        (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    Stat { mean, std }
}

/// One variant's line of the summary.
#[derive(Serialize)]
struct Row {
    name: String,
    settings: Vec<String>,
    seeds_finished: usize,
    parameters: u64,
    val_loss: Stat,
    val_bits_per_byte: Stat,
    /// Per-seed difference from the baseline's run with the same seed.
    val_loss_minus_baseline: Option<Stat>,
    train_tokens_per_second: Stat,
    /// Training time per token relative to the baseline, minus one.
    training_overhead: Option<f64>,
    val_losses: Vec<f64>,
}

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
    let summary = serde_json::json!({
        "suite": plan.suite, "seeds": plan.seeds, "baseline": plan.variants[0].name,
        "model": plan.base.model, "train": plan.base.train, "variants": rows, "scaling": scaling,
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
    let mut figures = Vec::new();
    if let Some(sc) = &scaling {
        figures.push((
            "scaling.svg",
            "Final validation loss against training compute C = 6·N·D (N: non-embedding parameters, D: tokens), with the power-law fit loss = A·C^-α of each mode.",
            svg(860, 480, |a| scaling_figure(a, sc))?,
        ));
    }
    figures.push((
        "loss.svg",
        "Validation loss during training (mean over seeds).",
        svg(860, 460, |a| loss_figure(a, &finished))?,
    ));
    figures.push((
        "rms.svg",
        "RMS of each sublayer's output (left) and of the input it reads (right), on validation tokens at the end of training. \
         SPEC §6: the baseline grows with depth; Block AttnRes stays bounded, resetting at block boundaries.",
        svg(1100, 440, |a| rms_figure(a, &finished))?,
    ));
    figures.push((
        "grads.svg",
        "Gradient norm of each sublayer's weights, averaged over all training steps (log scale). \
         SPEC §6: front-loaded for the baseline, more even for AttnRes.",
        svg(860, 440, |a| grad_figure(a, &finished))?,
    ));
    let mut heatmaps = Vec::new();
    for (_, v, rs) in &finished {
        if let Some(alpha) = mean_alpha(rs) {
            let name = format!("alpha-{}.svg", v.name);
            let layers = (alpha.len() - 1) / 2;
            let (w, h) = heatmap_size(rs[0].diag.sources.len(), layers + 1);
            heatmaps.push((
                name,
                v.name.clone(),
                svg(2 * w + 40, h + 30, |a| alpha_figure(a, &v.name, &alpha, &rs[0].diag.sources))?,
            ));
        }
    }
    for (name, body) in figures
        .iter()
        .map(|(n, _, b)| (n.to_string(), b))
        .chain(heatmaps.iter().map(|(n, _, b)| (n.clone(), b)))
    {
        write_atomic(&out.join(&name), body.as_bytes())?;
    }
    let page = out.join("index.html");
    write_atomic(&page, html(&plan, &rows, scaling.as_ref(), &figures, &heatmaps).as_bytes())?;
    Ok(page)
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
            // Paired by seed, over the seeds both have finished.
            let diffs: Vec<f64> = rs
                .iter()
                .zip(base)
                .filter_map(|(a, b)| Some(a.as_ref()?.val_loss - b.as_ref()?.val_loss))
                .collect();
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

/// Renders one figure into an SVG string.
fn svg(
    w: u32,
    h: u32,
    draw: impl FnOnce(&DrawingArea<SVGBackend, plotters::coord::Shift>) -> Result<()>,
) -> Result<String> {
    let mut s = String::new();
    {
        let area = SVGBackend::with_string(&mut s, (w, h)).into_drawing_area();
        area.fill(&WHITE).map_err(plot_err)?;
        draw(&area)?;
        area.present().map_err(plot_err)?;
    }
    Ok(s)
}

fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing a figure failed: {e:?}")
}

/// A distinct colour per variant.
fn color(i: usize) -> RGBColor {
    const C: [(u8, u8, u8); 12] = [
        (90, 90, 90),
        (31, 119, 180),
        (214, 39, 40),
        (44, 160, 44),
        (255, 127, 14),
        (148, 103, 189),
        (140, 86, 75),
        (227, 119, 194),
        (23, 190, 207),
        (188, 189, 34),
        (0, 0, 128),
        (128, 128, 0),
    ];
    let (r, g, b) = C[i % C.len()];
    RGBColor(r, g, b)
}

fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|x| x.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.05).max(1e-9);
    (lo - pad, hi + pad)
}

/// Mean over seeds, pointwise, of curves sampled at the same steps.
fn mean_curve(runs: &[&Run]) -> Vec<(f64, f64)> {
    let n = runs.iter().map(|r| r.curve.len()).min().unwrap_or(0);
    (0..n)
        .map(|i| {
            (runs[0].curve[i].0, runs.iter().map(|r| r.curve[i].1).sum::<f64>() / runs.len() as f64)
        })
        .collect()
}

fn mean_vec(runs: &[&Run], f: impl Fn(&Run) -> &[f64]) -> Vec<f64> {
    let n = f(runs[0]).len();
    (0..n).map(|i| runs.iter().map(|r| f(r)[i]).sum::<f64>() / runs.len() as f64).collect()
}

type Finished<'a> = [(usize, &'a Variant, Vec<&'a Run>)];

/// A variant's colour index, name and mean validation curve.
type Curve<'a> = (usize, &'a str, Vec<(f64, f64)>);

fn loss_figure(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    runs: &Finished,
) -> Result<()> {
    let curves: Vec<Curve> = runs
        .iter()
        .map(|(i, v, rs)| {
            (*i, v.name.as_str(), mean_curve(rs).into_iter().map(|(t, l)| (t / 1e6, l)).collect())
        })
        .collect();
    let (x0, x1) = bounds(curves.iter().flat_map(|c| c.2.iter().map(|p| p.0)));
    // Skip the first, much higher, evaluation when choosing the y range.
    let (y0, y1) = bounds(curves.iter().flat_map(|c| c.2.iter().skip(1).map(|p| p.1)));
    let mut chart = ChartBuilder::on(area)
        .caption("validation loss", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("training tokens (millions)")
        .y_desc("loss (nats/token)")
        .draw()
        .map_err(plot_err)?;
    for (i, name, pts) in curves {
        let c = color(i);
        chart
            .draw_series(LineSeries::new(
                pts.iter().copied().filter(|p| p.1 <= y1),
                c.stroke_width(2),
            ))
            .map_err(plot_err)?
            .label(name.to_string())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.iter().filter(|p| p.1 <= y1).map(|p| Circle::new(*p, 3, c.filled())))
            .map_err(plot_err)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    Ok(())
}

/// One line per variant over the sublayers (x = sublayer index).
fn sublayer_chart(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    title: &str,
    y_desc: &str,
    lines: &[(usize, String, Vec<f64>)],
    log: bool,
) -> Result<()> {
    let n = lines.iter().map(|l| l.2.len()).max().unwrap_or(1);
    let x = -0.5..(n as f64 - 0.5);
    let mut chart = ChartBuilder::on(area);
    chart.caption(title, ("sans-serif", 18)).margin(12).x_label_area_size(40).y_label_area_size(64);
    let draw_lines = |lines: &[(usize, String, Vec<f64>)]| {
        lines
            .iter()
            .map(|(i, name, v)| {
                (
                    *i,
                    name.clone(),
                    v.iter().enumerate().map(|(l, y)| (l as f64, *y)).collect::<Vec<_>>(),
                )
            })
            .collect::<Vec<_>>()
    };
    let series = draw_lines(lines);
    macro_rules! plot {
        ($chart:expr) => {{
            let mut ch = $chart;
            ch.configure_mesh()
                .x_desc("sublayer (even: attention, odd: MLP)")
                .y_desc(y_desc)
                .x_labels(n.min(20))
                .x_label_formatter(&|v| format!("{}", v.round() as i64))
                .y_label_formatter(&|v| short_number(*v))
                .draw()
                .map_err(plot_err)?;
            for (i, name, pts) in &series {
                let c = color(*i);
                ch.draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                    .map_err(plot_err)?
                    .label(name.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                    });
                ch.draw_series(pts.iter().map(|p| Circle::new(*p, 3, c.filled())))
                    .map_err(plot_err)?;
            }
            ch.configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(plot_err)?;
        }};
    }
    if log {
        let (lo, hi) = lines
            .iter()
            .flat_map(|l| l.2.iter().copied())
            .filter(|v| *v > 0.0)
            .fold((f64::INFINITY, 0.0f64), |(a, b), v| (a.min(v), b.max(v)));
        let (lo, hi) = if lo.is_finite() { (lo / 1.3, hi * 1.3) } else { (1e-3, 1.0) };
        plot!(chart.build_cartesian_2d(x, (lo..hi).log_scale()).map_err(plot_err)?);
    } else {
        let (lo, hi) = bounds(lines.iter().flat_map(|l| l.2.iter().copied()));
        plot!(chart.build_cartesian_2d(x, lo.min(0.0)..hi).map_err(plot_err)?);
    }
    Ok(())
}

/// A tick label with three significant digits.
fn short_number(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let digits = (2 - v.abs().log10().floor() as i32).max(0) as usize;
    format!("{v:.digits$}")
}

fn rms_figure(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    runs: &Finished,
) -> Result<()> {
    let (left, right) = area.split_horizontally(550);
    let outs: Vec<_> = runs
        .iter()
        .map(|(i, v, rs)| (*i, v.name.clone(), mean_vec(rs, |r| &r.diag.output_rms)))
        .collect();
    let ins: Vec<_> = runs
        .iter()
        .map(|(i, v, rs)| (*i, v.name.clone(), mean_vec(rs, |r| &r.diag.input_rms)))
        .collect();
    sublayer_chart(&left, "sublayer output RMS", "RMS", &outs, false)?;
    sublayer_chart(&right, "sublayer input RMS (h_l)", "RMS", &ins, false)
}

fn grad_figure(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    runs: &Finished,
) -> Result<()> {
    let lines: Vec<_> = runs
        .iter()
        .map(|(i, v, rs)| (*i, v.name.clone(), mean_vec(rs, |r| &r.grad_norms)))
        .collect();
    sublayer_chart(
        area,
        "gradient norm per sublayer (mean over training)",
        "gradient norm",
        &lines,
        true,
    )
}

fn mean_alpha(runs: &[&Run]) -> Option<Vec<Vec<f64>>> {
    let all: Vec<&Vec<Vec<f64>>> =
        runs.iter().map(|r| r.diag.alpha.as_ref()).collect::<Option<_>>()?;
    let n = all.len() as f64;
    Some(
        (0..all[0].len())
            .map(|c| {
                (0..all[0][c].len()).map(|s| all.iter().map(|a| a[c][s]).sum::<f64>() / n).collect()
            })
            .collect(),
    )
}

const CELL_H: u32 = 26;

/// One heatmap panel's size in pixels for `cols` sources and `rows` consumers.
fn heatmap_size(cols: usize, rows: usize) -> (u32, u32) {
    let cw = cell_width(cols);
    (90 + cw * cols as u32 + 20, 70 + CELL_H * rows as u32 + 50)
}

fn cell_width(cols: usize) -> u32 {
    (560 / cols.max(1) as u32).clamp(22, 52)
}

/// Pre-attention and pre-MLP depth-attention weights side by side: one row per layer (the
/// output aggregation as the last pre-MLP row), one column per source.
fn alpha_figure(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    name: &str,
    alpha: &[Vec<f64>],
    sources: &[String],
) -> Result<()> {
    let layers = (alpha.len() - 1) / 2;
    let (w, _) = heatmap_size(sources.len(), layers + 1);
    let (title, body) = area.split_vertically(30);
    let style = |size: u32| {
        TextStyle::from(("sans-serif", size).into_font()).pos(Pos::new(HPos::Center, VPos::Center))
    };
    title
        .draw(&Text::new(
            format!("{name}: mean depth-attention weight α (rows: consumers, columns: sources)"),
            ((2 * w as i32 + 40) / 2, 16),
            style(17),
        ))
        .map_err(plot_err)?;
    let (left, right) = body.split_horizontally(w + 20);
    let attn: Vec<(String, &Vec<f64>)> =
        (0..layers).map(|i| (format!("layer {i}"), &alpha[2 * i])).collect();
    let mut mlp: Vec<(String, &Vec<f64>)> =
        (0..layers).map(|i| (format!("layer {i}"), &alpha[2 * i + 1])).collect();
    mlp.push(("output".into(), &alpha[2 * layers]));
    heatmap(&left, "pre-attention", &attn, sources)?;
    heatmap(&right, "pre-MLP (and output)", &mlp, sources)
}

fn heatmap(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    title: &str,
    rows: &[(String, &Vec<f64>)],
    sources: &[String],
) -> Result<()> {
    let cw = cell_width(sources.len()) as i32;
    let ch = CELL_H as i32;
    let (x0, y0) = (90, 56);
    let center = |size: u32| {
        TextStyle::from(("sans-serif", size).into_font()).pos(Pos::new(HPos::Center, VPos::Center))
    };
    let right =
        TextStyle::from(("sans-serif", 12).into_font()).pos(Pos::new(HPos::Right, VPos::Center));
    let d = |e: &dyn Fn()
        -> Result<(), plotters::drawing::DrawingAreaErrorKind<std::io::Error>>| {
        e().map_err(plot_err)
    };
    d(&|| {
        area.draw(&Text::new(
            title.to_string(),
            (x0 + cw * sources.len() as i32 / 2, 14),
            center(15),
        ))
    })?;
    for (j, s) in sources.iter().enumerate() {
        d(&|| {
            area.draw(&Text::new(s.clone(), (x0 + cw * j as i32 + cw / 2, y0 - 12), center(11)))
        })?;
    }
    let max = rows.iter().flat_map(|r| r.1.iter().copied()).fold(1e-9f64, f64::max);
    for (i, (label, row)) in rows.iter().enumerate() {
        let y = y0 + ch * i as i32;
        d(&|| area.draw(&Text::new(label.clone(), (x0 - 6, y + ch / 2), right.clone())))?;
        for (j, &a) in row.iter().enumerate() {
            let x = x0 + cw * j as i32;
            // Sources a consumer does not read are grey; the rest shade from white to dark blue.
            let fill = if a == 0.0 {
                RGBColor(225, 225, 225)
            } else {
                let t = (a / max).clamp(0.0, 1.0);
                RGBColor(
                    (255.0 - t * 247.0) as u8,
                    (255.0 - t * 207.0) as u8,
                    (255.0 - t * 148.0) as u8,
                )
            };
            d(&|| area.draw(&Rectangle::new([(x, y), (x + cw, y + ch)], fill.filled())))?;
            d(&|| {
                area.draw(&Rectangle::new(
                    [(x, y), (x + cw, y + ch)],
                    RGBColor(255, 255, 255).stroke_width(1),
                ))
            })?;
            if a > 0.0 && cw >= 34 {
                let ink = if a / max > 0.55 { WHITE } else { BLACK };
                let txt = center(10).color(&ink);
                d(&|| {
                    area.draw(&Text::new(format!("{a:.2}"), (x + cw / 2, y + ch / 2), txt.clone()))
                })?;
            }
        }
    }
    let yb = y0 + ch * rows.len() as i32 + 16;
    d(&|| {
        area.draw(&Text::new(
            format!("darkest = {max:.2}; grey = not a source of that consumer"),
            (x0 + cw * sources.len() as i32 / 2, yb),
            center(11),
        ))
    })?;
    Ok(())
}

/// One point of the scaling suite.
#[derive(Serialize, Clone)]
pub struct ScalePoint {
    pub variant: String,
    pub mode: String,
    pub non_embedding_parameters: usize,
    pub tokens: usize,
    pub flops: f64,
    pub val_loss: f64,
}

/// `loss = a · C^-alpha`, fitted by least squares in log-log space.
#[derive(Serialize, Clone, Copy, Debug)]
pub struct PowerLaw {
    pub a: f64,
    pub alpha: f64,
}

impl PowerLaw {
    pub fn fit(points: &[(f64, f64)]) -> PowerLaw {
        let n = points.len() as f64;
        let (xs, ys): (Vec<f64>, Vec<f64>) = points.iter().map(|(c, l)| (c.ln(), l.ln())).unzip();
        let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
        let sxy: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
        let sxx: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
        let slope = sxy / sxx;
        PowerLaw { a: (my - slope * mx).exp(), alpha: -slope }
    }

    pub fn loss(&self, c: f64) -> f64 {
        self.a * c.powf(-self.alpha)
    }

    /// The compute at which the fit reaches `loss`.
    pub fn compute_for(&self, loss: f64) -> f64 {
        (self.a / loss).powf(1.0 / self.alpha)
    }
}

#[derive(Serialize)]
pub struct Scaling {
    pub points: Vec<ScalePoint>,
    pub standard: Option<PowerLaw>,
    pub block: Option<PowerLaw>,
    /// At the largest size: the compute the baseline's fit needs to reach Block's loss, divided
    /// by Block's compute (SPEC §6: 1.25 in the report).
    pub compute_advantage: Option<f64>,
}

fn scaling_fit(plan: &Plan, rows: &[Row]) -> Result<Scaling> {
    let mut points = Vec::new();
    for r in rows {
        let v = plan.variants.iter().find(|v| v.name == r.name).expect("rows come from variants");
        let cfg = plan.run_config(v, 0)?;
        let n = crate::compare::non_embedding_parameters(&cfg.model);
        let tokens = cfg.train.steps() * cfg.train.batch_tokens;
        let mode = crate::bench::label(&cfg.model).trim_end_matches(char::is_numeric).to_string();
        points.push(ScalePoint {
            variant: r.name.clone(),
            mode,
            non_embedding_parameters: n,
            tokens,
            flops: 6.0 * n as f64 * tokens as f64,
            val_loss: r.val_loss.mean,
        });
    }
    let fit = |mode: &str| {
        let p: Vec<(f64, f64)> =
            points.iter().filter(|p| p.mode == mode).map(|p| (p.flops, p.val_loss)).collect();
        (p.len() >= 2).then(|| PowerLaw::fit(&p))
    };
    let (standard, block) = (fit("standard"), fit("block"));
    let largest =
        points.iter().filter(|p| p.mode == "block").max_by(|a, b| a.flops.total_cmp(&b.flops));
    let compute_advantage = match (standard, largest) {
        (Some(s), Some(b)) => Some(s.compute_for(b.val_loss) / b.flops),
        _ => None,
    };
    Ok(Scaling { points, standard, block, compute_advantage })
}

fn scaling_figure(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    sc: &Scaling,
) -> Result<()> {
    let (c0, c1) = sc
        .points
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(a, b), p| (a.min(p.flops), b.max(p.flops)));
    if !c0.is_finite() {
        return Ok(());
    }
    let (x0, x1) = (c0 / 1.5, c1 * 1.5);
    let (y0, y1) = bounds(sc.points.iter().map(|p| p.val_loss));
    let mut chart = ChartBuilder::on(area)
        .caption("validation loss vs training compute", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d((x0..x1).log_scale(), y0..y1)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("training FLOPs (6·N·D, log scale)")
        .y_desc("validation loss")
        .x_label_formatter(&|v| format!("{v:.1e}"))
        .y_label_formatter(&|v| short_number(*v))
        .draw()
        .map_err(plot_err)?;
    for (i, mode, fit) in [(0, "standard", sc.standard), (1, "block", sc.block)] {
        let c = color(i);
        let pts: Vec<(f64, f64)> =
            sc.points.iter().filter(|p| p.mode == mode).map(|p| (p.flops, p.val_loss)).collect();
        chart.draw_series(pts.iter().map(|p| Circle::new(*p, 4, c.filled()))).map_err(plot_err)?;
        if let Some(f) = fit {
            let line: Vec<(f64, f64)> = (0..=60)
                .map(|k| x0 * (x1 / x0).powf(k as f64 / 60.0))
                .map(|x| (x, f.loss(x)))
                .filter(|p| p.1 >= y0 && p.1 <= y1)
                .collect();
            chart
                .draw_series(LineSeries::new(line, c.stroke_width(2)))
                .map_err(plot_err)?
                .label(format!("{mode}: {:.3}·C^-{:.4}", f.a, f.alpha))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    Ok(())
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn pm(s: &Stat, digits: usize, seeds: usize) -> String {
    if seeds > 1 {
        format!("{:.*} ± {:.*}", digits, s.mean, digits, s.std)
    } else {
        format!("{:.*}", digits, s.mean)
    }
}

fn html(
    plan: &Plan,
    rows: &[Row],
    scaling: Option<&Scaling>,
    figures: &[(&str, &str, String)],
    heatmaps: &[(String, String, String)],
) -> String {
    let m = &plan.base.model;
    let t = &plan.base.train;
    let mut h = String::new();
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>attnres: {suite}</title>\n<style>\n\
         body {{ font-family: sans-serif; max-width: 1180px; margin: 2em auto; color: #222; }}\n\
         table {{ border-collapse: collapse; margin: 1em 0; }} th, td {{ border: 1px solid #ccc; padding: 4px 10px; text-align: right; }}\n\
         th {{ background: #f2f2f2; }} td {{ white-space: nowrap; }} td:first-child, th:first-child {{ text-align: left; }}\n\
         td.settings {{ text-align: left; white-space: normal; font-size: 90%; }}\n\
         figure {{ margin: 1.5em 0; }} figcaption {{ color: #555; max-width: 900px; }} img {{ max-width: 100%; border: 1px solid #eee; }}\n\
         code {{ background: #f5f5f5; padding: 1px 4px; }} .neg {{ color: #1a7f37; }} .pos {{ color: #b42318; }}\n\
         </style></head><body>\n<h1>Attention Residuals: {suite}</h1>\n\
         <p>Model (before each variant's settings): {layers} layers ({sub} sublayers), hidden {d}, {heads} heads, vocabulary {vocab}, context {seq}. \
         Training: {tokens} tokens per run ({steps} steps of {batch} tokens), optimizer {opt}, lr {lr}, identical data order for every variant; \
         seeds: {seeds} (seed changes initialisation and data order). Validation loss on the first {eval} validation tokens. \
         Differences are from the baseline (the first row, or for the scaling suite the standard model of the same size), paired by seed.</p>\n",
        suite = esc(&plan.suite),
        layers = m.num_hidden_layers,
        sub = m.sublayers(),
        d = m.hidden_size,
        heads = m.num_attention_heads,
        vocab = m.vocab_size,
        seq = t.seq_len,
        tokens = t.steps() * t.batch_tokens,
        steps = t.steps(),
        batch = t.batch_tokens,
        opt = esc(&format!("{:?}", t.optim.optimizer).to_lowercase()),
        lr = t.optim.lr,
        seeds = plan.seeds,
        eval = t.eval_tokens,
    );
    h.push_str("<table><tr><th>variant</th><th>settings</th><th>seeds</th><th>parameters</th><th>val loss</th><th>val bits/byte</th><th>Δ loss vs baseline</th><th>train tokens/s</th><th>training overhead</th></tr>\n");
    for r in rows {
        let n = r.seeds_finished;
        let delta = match &r.val_loss_minus_baseline {
            Some(s) => format!(
                "<span class=\"{}\">{:+.4}{}</span>",
                if s.mean < 0.0 { "neg" } else { "pos" },
                s.mean,
                if n > 1 { format!(" ± {:.4}", s.std) } else { String::new() }
            ),
            None => "—".into(),
        };
        let over = r.training_overhead.map_or("—".into(), |o| format!("{:+.1}%", 100.0 * o));
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td class=\"settings\"><code>{}</code></td><td>{n}</td><td>{}</td><td>{}</td><td>{}</td><td>{delta}</td><td>{}</td><td>{over}</td></tr>",
            esc(&r.name),
            esc(&r.settings.join(" ")),
            r.parameters,
            pm(&r.val_loss, 4, n),
            pm(&r.val_bits_per_byte, 4, n),
            pm(&r.train_tokens_per_second, 0, n),
        );
    }
    h.push_str("</table>\n");
    if let Some(sc) = scaling {
        h.push_str("<h2>Scaling</h2>\n<table><tr><th>variant</th><th>non-embedding parameters</th><th>tokens</th><th>FLOPs</th><th>val loss</th></tr>\n");
        for p in &sc.points {
            let _ = writeln!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.3e}</td><td>{:.4}</td></tr>",
                esc(&p.variant),
                p.non_embedding_parameters,
                p.tokens,
                p.flops,
                p.val_loss
            );
        }
        h.push_str("</table>\n<p>");
        for (name, f) in [("standard", sc.standard), ("block", sc.block)] {
            if let Some(f) = f {
                let _ = write!(h, "Fit {name}: loss = {:.4}·C^-{:.4}. ", f.a, f.alpha);
            }
        }
        if let Some(adv) = sc.compute_advantage {
            let _ = write!(h, "At the largest size the baseline's fit needs <b>{adv:.2}×</b> Block's compute to reach Block's loss (the report: 1.25×).");
        }
        h.push_str("</p>\n");
    }
    h.push_str("<p>± is the sample standard deviation over seeds. Training throughput counts training steps only (no validation); it is measured on a shared machine, so small overheads are within noise. The ablation options other than the method itself run a plain one-pass depth attention, so their throughput is not representative.</p>\n");
    for (name, caption, _) in figures {
        let _ = writeln!(
            h,
            "<figure><img src=\"{name}\" alt=\"{}\"><figcaption>{}</figcaption></figure>",
            esc(caption),
            esc(caption)
        );
    }
    if !heatmaps.is_empty() {
        h.push_str("<h2>Learned depth-attention weights</h2>\n<p>Mean α over validation tokens (and seeds) for every consumer and source. \
                    <code>emb</code> is the token embedding, <code>bN</code> the N-th completed block (for <code>full</code>: the N-th sublayer output), \
                    <code>partial</code> the consumer's own block so far. SPEC §6: mostly diagonal, with the embedding keeping weight throughout.</p>\n");
        for (name, variant, _) in heatmaps {
            let _ = writeln!(h, "<figure><img src=\"{name}\" alt=\"α of {v}\"><figcaption>{v}</figcaption></figure>", v = esc(variant));
        }
    }
    h.push_str("<p>Numbers: <a href=\"summary.json\">summary.json</a>; each run's metrics, diagnostics and checkpoint are under <code>runs/</code>.</p>\n</body></html>\n");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_are_mean_and_sample_std() {
        let s = stat(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(s.mean, 2.5);
        assert!((s.std - (5.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert_eq!(stat(&[7.0]).std, 0.0);
    }

    #[test]
    fn power_law_fit_recovers_its_parameters() {
        let truth = PowerLaw { a: 7.5, alpha: 0.07 };
        let pts: Vec<(f64, f64)> =
            [1e12, 3e12, 1e13, 4e13].iter().map(|c| (*c, truth.loss(*c))).collect();
        let f = PowerLaw::fit(&pts);
        assert!((f.a - 7.5).abs() < 1e-6 && (f.alpha - 0.07).abs() < 1e-9, "{f:?}");
        // A baseline 1.25x less compute-efficient needs 1.25x the compute for the same loss.
        let slower = PowerLaw { a: truth.a * 1.25f64.powf(truth.alpha), alpha: truth.alpha };
        assert!((slower.compute_for(truth.loss(1e13)) / 1e13 - 1.25).abs() < 1e-9);
    }
}
