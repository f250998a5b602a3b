//! The report's figures, drawn with `plotters` into SVG strings: validation loss over training,
//! RMS and gradient norm per sublayer, the scaling fit, and the depth-attention heatmaps.

use super::runs::{Finished, Run};
use super::stat::Scaling;
use anyhow::Result;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// One SVG file of the report and what the page says under it.
pub(super) struct Figure {
    pub file: String,
    pub caption: String,
    pub svg: String,
}

/// The report's charts: the scaling fit (scaling suite only), loss, RMS and gradient norms.
pub(super) fn figures(finished: &Finished, scaling: Option<&Scaling>) -> Result<Vec<Figure>> {
    let figure = |file: &str, caption: &str, svg: String| Figure {
        file: file.into(),
        caption: caption.into(),
        svg,
    };
    let mut figures = Vec::new();
    if let Some(sc) = scaling {
        figures.push(figure(
            "scaling.svg",
            "Final validation loss against training compute C = 6·N·D (N: non-embedding parameters, D: tokens), with the power-law fit loss = A·C^-α of each mode.",
            svg(860, 480, |a| scaling_figure(a, sc))?,
        ));
    }
    figures.push(figure(
        "loss.svg",
        "Validation loss during training (mean over seeds).",
        svg(860, 460, |a| loss_figure(a, finished))?,
    ));
    figures.push(figure(
        "rms.svg",
        "RMS of each sublayer's output (left) and of the input it reads (right), on validation tokens at the end of training. \
         docs/method.md §6: the baseline grows with depth; Block AttnRes stays bounded, resetting at block boundaries.",
        svg(1100, 440, |a| rms_figure(a, finished))?,
    ));
    figures.push(figure(
        "grads.svg",
        "Gradient norm of each sublayer's weights, averaged over all training steps (log scale). \
         docs/method.md §6: front-loaded for the baseline, more even for AttnRes.",
        svg(860, 440, |a| grad_figure(a, finished))?,
    ));
    Ok(figures)
}

/// One depth-attention heatmap per variant that has depth attention; the caption is the
/// variant's name.
pub(super) fn heatmaps(finished: &Finished) -> Result<Vec<Figure>> {
    let mut heatmaps = Vec::new();
    for (_, v, rs) in finished {
        if let Some(alpha) = mean_alpha(rs) {
            let layers = (alpha.len() - 1) / 2;
            let (w, h) = heatmap_size(rs[0].diag.sources.len(), layers + 1);
            heatmaps.push(Figure {
                file: format!("alpha-{}.svg", v.name),
                caption: v.name.clone(),
                svg: svg(2 * w + 40, h + 30, |a| {
                    alpha_figure(a, &v.name, &alpha, &rs[0].diag.sources)
                })?,
            });
        }
    }
    Ok(heatmaps)
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

/// A variant's mark in a legend: a short line in its colour.
fn legend_mark(c: RGBColor) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
}

/// The chart's legend at `position`, on a white box.
fn legend<'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
    position: SeriesLabelPosition,
) -> Result<()> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)
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
            .legend(legend_mark(c));
        chart
            .draw_series(pts.iter().filter(|p| p.1 <= y1).map(|p| Circle::new(*p, 3, c.filled())))
            .map_err(plot_err)?;
    }
    legend(&mut chart, SeriesLabelPosition::MiddleRight)
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
                    .legend(legend_mark(c));
                ch.draw_series(pts.iter().map(|p| Circle::new(*p, 3, c.filled())))
                    .map_err(plot_err)?;
            }
            legend(&mut ch, SeriesLabelPosition::UpperLeft)?;
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
                .legend(legend_mark(c));
        }
    }
    legend(&mut chart, SeriesLabelPosition::MiddleRight)
}
