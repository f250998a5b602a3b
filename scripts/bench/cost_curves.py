"""Cost curves: how a training step's time grows with the context, the depth and the threads,
and how a decoding step's latency grows with the context and the batch; each curve with the
exponent k of time ~ x^k fitted by least squares on log-log axes. Every point comes from
`attnres bench` (training: interleaved modes, median of --steps; decoding: `bench --generate`).

    cargo build --release
    python scripts/bench/cost_curves.py --attnres target/release/attnres --out docs/cost-curves [--quick]
    python scripts/bench/cost_curves.py --out docs/cost-curves --replot

Writes OUT/curves.json (every measurement), OUT/*.svg (one log-log plot per curve) and prints
the Markdown tables; --replot redraws them from OUT/curves.json without measuring. Needs only
the Python standard library.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from attnres_run import run_attnres  # noqa: E402


def bench(binary, args, threads=None):
    cmd = [binary] + (["--threads", str(threads)] if threads else []) + ["bench", "--json", *args]
    print("  " + " ".join(cmd[1:]), file=sys.stderr)
    report = json.loads(run_attnres(cmd).stdout)
    if "matmul_peak_gflops" in report:
        PEAKS.append(report["matmul_peak_gflops"])
    return report


# The matrix-product peak (GFLOP/s) each training benchmark measured: how fast the machine was.
PEAKS = []


def fit(xs, ys):
    """Exponent k and factor a of y = a·x^k, least squares on logs."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    k = sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)
    return k, math.exp(my - k * mx)


COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def svg_loglog(path, title, xlabel, ylabel, series):
    """A log-log line plot: `series` is [(name, xs, ys)], each drawn with its points and fit."""
    W, H, L, R, T, B = 700, 400, 70, 250, 40, 50
    xs = [x for _, sx, _ in series for x in sx]
    ys = [y for _, _, sy in series for y in sy]
    x0, x1 = math.log10(min(xs)), math.log10(max(xs))
    y0, y1 = math.log10(min(ys)), math.log10(max(ys))
    x0, x1 = (x0 - 0.05, x1 + 0.05) if x1 > x0 else (x0 - 0.5, x1 + 0.5)
    y0, y1 = (y0 - 0.1, y1 + 0.1) if y1 > y0 else (y0 - 0.5, y1 + 0.5)
    px = lambda x: L + (math.log10(x) - x0) / (x1 - x0) * (W - L - R)
    py = lambda y: H - B - (math.log10(y) - y0) / (y1 - y0) * (H - T - B)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="22" font-size="14" font-weight="bold">{title}</text>',
           f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="#888"/>']
    # The x axis is labelled at the measured sizes only (powers of two, mostly), which keeps
    # round-number labels from colliding with them.
    for v in sorted(set(xs)):
        x = px(v)
        out.append(f'<line x1="{x:.1f}" y1="{T}" x2="{x:.1f}" y2="{H - B}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{H - B + 15}" text-anchor="middle">{v:g}</text>')
    for e in range(math.floor(y0), math.ceil(y1) + 1):
        for m in (1, 2, 5):
            v = m * 10 ** e
            if y0 <= math.log10(v) <= y1:
                y = py(v)
                out.append(f'<line x1="{L}" y1="{y:.1f}" x2="{W - R}" y2="{y:.1f}" stroke="#eee"/>')
                out.append(f'<text x="{L - 5}" y="{y + 4:.1f}" text-anchor="end">{v:g}</text>')
    out.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">{xlabel}</text>')
    out.append(f'<text x="16" y="{(T + H - B) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {(T + H - B) / 2})">{ylabel}</text>')
    for i, (name, sx, sy) in enumerate(series):
        c = COLORS[i % len(COLORS)]
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(sx, sy))
        out.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
        out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"/>' for x, y in zip(sx, sy)]
        k, _ = fit(sx, sy)
        y = T + 16 + 18 * i
        out.append(f'<line x1="{W - R + 12}" y1="{y - 4}" x2="{W - R + 32}" y2="{y - 4}" stroke="{c}" stroke-width="2"/>')
        out.append(f'<text x="{W - R + 38}" y="{y}">{name} (k = {k:.2f})</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def table(title, xname, series, unit, scale):
    """Markdown: one row per x, one column per series, and the fitted exponent."""
    xs = sorted({x for _, sx, _ in series for x in sx})
    lines = [f"**{title}**", "", f"| {xname} | " + " | ".join(f"{n} ({unit})" for n, _, _ in series) + " |",
             "|---:|" + "---:|" * len(series)]
    for x in xs:
        cells = []
        for _, sx, sy in series:
            cells.append(f"{sy[sx.index(x)] * scale:.4g}" if x in sx else "")
        lines.append(f"| {x} | " + " | ".join(cells) + " |")
    lines.append("| k (time ~ x^k) | " + " | ".join(f"{fit(sx, sy)[0]:.2f}" for _, sx, sy in series) + " |")
    if len(xs) > 2:
        # Where a curve mixes terms of different order, its largest sizes show the leading one.
        lines.append("| k over the last two points | "
                     + " | ".join(f"{fit(sx[-2:], sy[-2:])[0]:.2f}" for _, sx, sy in series) + " |")
    return "\n".join(lines) + "\n"


# Per curve: the plot's title and axes (None: a table only) and the table's title and x heading.
CURVES = {
    "context": (("Training step against context (batch 1)", "tokens per sequence T", "seconds per step"),
                "Training step against context, one sequence per step", "T"),
    "depth": (("Training step against depth (batch 8 x 256)", "sublayers L", "seconds per step"),
              "Training step against depth, batch 8 × 256", "sublayers L"),
    "threads": (None, "Training step against threads, batch 8 × 256", "threads"),
    "decode": (("Decoding step latency against context", "tokens in context (prompt)", "seconds per decoding step"),
               "Decoding step latency against context (prompt length)", "context"),
}


def measure(a, want):
    """Runs the benchmarks: {curve: [(series name, xs, seconds)]}."""
    steps = ["--steps", str(a.steps), "--warmup", "1", "--preset", a.preset]
    results = {}

    def modes_of(report):
        return {m["residual"]: m for m in report["modes"]}

    if "context" in want:
        seqs = [64, 128, 256] if a.quick else [128, 256, 512, 1024, 2048, 4096]
        pos = ["--set", f"max_position_embeddings={max(seqs)}"]
        series = {"standard": ([], []), "block": ([], [])}
        for t in seqs:
            r = modes_of(bench(a.attnres, [*steps, *pos, "--modes", "standard,block", "--batch", "1", "--seq", str(t)]))
            for m, (xs, ys) in series.items():
                xs.append(t)
                ys.append(r[m]["step_seconds"])
        results["context"] = [(m, xs, ys) for m, (xs, ys) in series.items()]

    if "depth" in want:
        layers = [2, 4, 8] if a.quick else [4, 8, 16, 32]
        series = {"standard": ([], []), "block": ([], []), "full": ([], [])}
        for n in layers:
            blocks = ["--set", f"num_blocks={min(8, 2 * n)}"]
            r = modes_of(bench(a.attnres, [*steps, "--set", f"num_hidden_layers={n}", *blocks,
                                           "--modes", "standard,block,full"]))
            for m, (xs, ys) in series.items():
                xs.append(2 * n)
                ys.append(r[m]["step_seconds"])
        results["depth"] = [(m if m != "block" else "block (8 blocks)", xs, ys) for m, (xs, ys) in series.items()]

    if "threads" in want:
        series = {"standard": ([], []), "block": ([], [])}
        for th in [1, 2]:
            r = modes_of(bench(a.attnres, [*steps, "--modes", "standard,block"], threads=th))
            for m, (xs, ys) in series.items():
                xs.append(th)
                ys.append(r[m]["step_seconds"])
        results["threads"] = [(m, xs, ys) for m, (xs, ys) in series.items()]

    if "decode" in want:
        prompts = [64, 128, 256] if a.quick else [128, 512, 1024, 2048, 4096]
        batches = [1, 4] if a.quick else [1, 8, 32]
        new = 8 if a.quick else 16
        pos = ["--set", f"max_position_embeddings={max(prompts) + new}"]
        series = {(m, b): ([], []) for m in ["standard", "block"] for b in batches}
        for p in prompts:
            r = modes_of(bench(a.attnres, ["--generate", "--steps", str(a.steps), "--preset", a.preset, *pos,
                                           "--modes", "standard,block", "--prompt-tokens", str(p),
                                           "--new-tokens", str(new), "--batches", ",".join(map(str, batches))]))
            for (m, b), (xs, ys) in series.items():
                row = next(x for x in r[m]["batches"] if x["batch"] == b)
                xs.append(p)
                ys.append(row["step_seconds"])
        results["decode"] = [(f"{m}, batch {b}", xs, ys) for (m, b), (xs, ys) in series.items()]
    return results


def render(results, peaks, out):
    """Writes the plots and returns the Markdown tables."""
    md = []
    for key, (plot, title, xname) in CURVES.items():
        if key not in results:
            continue
        if plot:
            svg_loglog(os.path.join(out, f"{key}.svg"), *plot, results[key])
        md.append(table(title, xname, results[key], "ms", 1e3))
    if peaks:
        md.append(f"Matrix-product peak measured by the training benchmarks: {min(peaks):.0f}–{max(peaks):.0f} GFLOP/s.\n")
    return "\n".join(md)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--attnres", help="the attnres binary (not needed with --replot)")
    ap.add_argument("--out", required=True, help="directory for curves.json and the SVG plots")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small sizes only: checks the script, not the machine")
    ap.add_argument("--curves", default="context,depth,threads,decode")
    ap.add_argument("--replot", action="store_true", help="redraw plots and tables from OUT/curves.json")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "curves.json")
    if a.replot:
        saved = json.load(open(path))
        peaks = saved.pop("matmul_peak_gflops", [])
        results = {k: [(s["series"], s["x"], s["seconds"]) for s in v] for k, v in saved.items()}
    else:
        if not a.attnres:
            sys.exit("--attnres is required to measure")
        results, peaks = measure(a, a.curves.split(",")), PEAKS
        saved = {k: [{"series": n, "x": xs, "seconds": ys, "exponent": fit(xs, ys)[0]} for n, xs, ys in v]
                 for k, v in results.items()}
        if peaks:
            saved["matmul_peak_gflops"] = [min(peaks), max(peaks)]
        with open(path, "w") as f:
            json.dump(saved, f, indent=1)
    print(render(results, peaks, a.out))


if __name__ == "__main__":
    main()
