//! The report's page, `index.html`: the settings, one table row per variant, the scaling fit
//! and the figures.

use super::figures::Figure;
use super::runs::Row;
use super::stat::{Scaling, Stat};
use crate::experiments::suite::Plan;
use std::fmt::Write as _;

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

/// The whole page; `heatmaps` carry the variant's name as their caption.
pub(super) fn page(
    plan: &Plan,
    rows: &[Row],
    scaling: Option<&Scaling>,
    figures: &[Figure],
    heatmaps: &[Figure],
    code_versions: &[String],
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
    let _ = writeln!(
        h,
        "<p>Runs made by attnres {}; this page by attnres {}.</p>",
        esc(&code_versions.join(", ")),
        esc(&crate::base::version::CodeVersion::current().to_string())
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
    for f in figures {
        let _ = writeln!(
            h,
            "<figure><img src=\"{}\" alt=\"{}\"><figcaption>{}</figcaption></figure>",
            f.file,
            esc(&f.caption),
            esc(&f.caption)
        );
    }
    if !heatmaps.is_empty() {
        h.push_str("<h2>Learned depth-attention weights</h2>\n<p>Mean α over validation tokens (and seeds) for every consumer and source. \
                    <code>emb</code> is the token embedding, <code>bN</code> the N-th completed block (for <code>full</code>: the N-th sublayer output), \
                    <code>partial</code> the consumer's own block so far. docs/method.md §6: mostly diagonal, with the embedding keeping weight throughout.</p>\n");
        for f in heatmaps {
            let _ = writeln!(h, "<figure><img src=\"{name}\" alt=\"α of {v}\"><figcaption>{v}</figcaption></figure>", name = f.file, v = esc(&f.caption));
        }
    }
    h.push_str("<p>Numbers: <a href=\"summary.json\">summary.json</a>; each run's metrics, diagnostics and checkpoint are under <code>runs/</code>.</p>\n</body></html>\n");
    h
}
