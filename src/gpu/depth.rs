//! The depth attention of Attention Residuals on the GPU (`kernels/depth.cu`): what
//! `crate::kernels::depth` computes on the CPU, with the same buffers. The two-phase forward
//! ([`phase1`], then phase 2 in [`input`], which also makes the consumer's partial sum and
//! normalises its input), the sums that make its completed sources ([`sum_rstd`]), and the
//! backward: a partial sum's gradient with its consumer's norm ([`partial_backward`]), and
//! the completed sources' from their readers ([`source_grads`], [`query_grads`]).

use super::act::{kernel, Act};
use super::blas::{DType, Gemm};
use super::buffer::{Arg, Buf, Slice, SliceMut};
use super::device::Device;
use super::gemm::gemm;
use super::rmsnorm::add_column_sums;
use super::{per_row, per_value, row_sums_bytes, rows_per_block};
use anyhow::Result;
use cudarc::driver::LaunchConfig;

/// Consumers one launch of phase 1 scores (`PHASE1_CONSUMERS` in the kernel).
const PHASE1_CONSUMERS: usize = 8;

/// `out = a + b` (`b` absent: `a` alone) and the per-row 1/rms of the result into `rstd`: a
/// completed source, the embedding or a block's sum.
pub fn sum_rstd<A: Act>(
    dev: &Device,
    out: &mut SliceMut<A>,
    rstd: &mut SliceMut<f32>,
    a: Slice<A>,
    b: Option<Slice<A>>,
    d: usize,
    eps: f32,
) -> Result<()> {
    let rows = rstd.len();
    assert!(out.len() == rows * d && d <= i32::MAX as usize && a.len() == out.len());
    assert!(b.is_none_or(|b| b.len() == out.len()), "operands of one shape");
    let b = b.map_or(Arg::null(), |b| b.arg());
    let args = [out.arg_mut(), rstd.arg_mut(), a.arg(), b, Arg::i32(d as i32), Arg::f32(eps)];
    // SAFETY: the kernel's arguments in its order; every buffer holds `rows` rows of `d`
    // (checked above), `rstd` one value per row.
    unsafe { dev.launch(&kernel::<A>("depth_sum_rstd"), per_row(rows, d), &args) }
}

/// What phase 1 produced for the consumers of one block, per consumer and token (as the CPU's
/// `depth::Phase1`): the logits over the completed sources, their maximum, the sum of their
/// exponentials, and the normalised mix.
pub struct Phase1<A: Act> {
    pub rows: usize,
    pub completed: usize,
    /// `[S, rows, C]`.
    logits: Buf<f32>,
    /// `[S, rows]`.
    m1: Buf<f32>,
    l1: Buf<f32>,
    /// `[S, rows, d]`.
    o1: Buf<A>,
}

/// Phase 1: the `S` consumers of a block (effective queries `ws = [S, d]`) score the `C`
/// completed sources (`sources = [C, rows, d]`, their 1/rms `rstds = [C, rows]`) in one pass.
pub fn phase1<A: Act>(
    dev: &Device,
    sources: Slice<A>,
    rstds: Slice<f32>,
    ws: Slice<f32>,
    rows: usize,
    d: usize,
) -> Result<Phase1<A>> {
    let (c, s) = (rstds.len() / rows, ws.len() / d);
    assert!(c * rows == rstds.len() && sources.len() == c * rows * d && s * d == ws.len());
    assert!(c > 0 && s > 0 && sources.len() <= i32::MAX as usize * d);
    let mut p = Phase1 {
        rows,
        completed: c,
        logits: dev.output(s * rows * c)?,
        m1: dev.output(s * rows)?,
        l1: dev.output(s * rows)?,
        o1: dev.output(s * rows * d)?,
    };
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, s.div_ceil(PHASE1_CONSUMERS) as u32, 1),
        shared_mem_bytes: (PHASE1_CONSUMERS * c * size_of::<f32>()) as u32,
        ..per_row(rows, d)
    };
    let args = [
        p.logits.arg_mut(),
        p.m1.arg_mut(),
        p.l1.arg_mut(),
        p.o1.arg_mut(),
        sources.arg(),
        rstds.arg(),
        ws.arg(),
        Arg::i32(rows as i32),
        Arg::i32(d as i32),
        Arg::i32(c as i32),
        Arg::i32(s as i32),
    ];
    // SAFETY: the kernel's arguments in its order; the outputs are sized for S consumers of
    // `rows` tokens over C sources, the inputs checked above; shared memory holds the weights
    // of one launch's consumers.
    unsafe { dev.launch(&kernel::<A>("depth_phase1"), cfg, &args) }?;
    Ok(p)
}

/// The partial sum a consumer inside a block reads, which [`input`] makes in place: `sum`
/// holds the previous sublayer's output and becomes that plus `prev`, the sum before it
/// (absent at a block's second sublayer, which reads that output alone); its per-token 1/rms
/// goes to `rstd`.
pub struct PartialSum<'a, A: Act> {
    pub sum: &'a mut Buf<A>,
    pub rstd: &'a mut Buf<f32>,
    pub prev: Option<Slice<'a, A>>,
}

/// A consumer's input, its RMSNorm, and its weights and logits over its sources.
pub struct Input<A: Act> {
    pub h: Buf<A>,
    pub xn: Buf<A>,
    pub rstd: Buf<f32>,
    /// `[rows, K]` each, the completed sources first, the partial sum last.
    pub alpha: Buf<f32>,
    pub logits: Buf<f32>,
}

/// Phase 2 of consumer `j` of the block `p1` scored, in one pass with what comes before and
/// after it: makes its partial sum (if it reads one), merges it by online softmax into the
/// input `h`, and normalises `h` with gain `g` (RMSNorm, `eps`) for the sublayer.
#[allow(clippy::too_many_arguments)]
pub fn input<A: Act>(
    dev: &Device,
    p1: &Phase1<A>,
    j: usize,
    partial: Option<PartialSum<A>>,
    w: Slice<f32>,
    g: Slice<f32>,
    d: usize,
    eps: f32,
) -> Result<Input<A>> {
    let (rows, c) = (p1.rows, p1.completed);
    let k = c + partial.is_some() as usize;
    assert!(p1.m1.len() >= (j + 1) * rows && w.len() == d && g.len() == d);
    assert!(partial.as_ref().is_none_or(|p| p.sum.len() == rows * d && p.rstd.len() == rows));
    assert!(partial.as_ref().and_then(|p| p.prev).is_none_or(|v| v.len() == rows * d));
    let mut out = Input {
        h: dev.output(rows * d)?,
        xn: dev.output(rows * d)?,
        rstd: dev.output(rows)?,
        alpha: dev.output(rows * k)?,
        logits: dev.output(rows * k)?,
    };
    let (p, pr, prev) = match partial {
        Some(p) => (p.sum.arg_mut(), p.rstd.arg_mut(), p.prev.map_or(Arg::null(), |v| v.arg())),
        None => (Arg::null(), Arg::null(), Arg::null()),
    };
    let args = [
        out.h.arg_mut(),
        out.xn.arg_mut(),
        out.rstd.arg_mut(),
        out.alpha.arg_mut(),
        out.logits.arg_mut(),
        p,
        pr,
        prev,
        p1.o1.arg_at(j * rows * d),
        p1.logits.arg_at(j * rows * c),
        p1.m1.arg_at(j * rows),
        p1.l1.arg_at(j * rows),
        w.arg(),
        g.arg(),
        Arg::i32(d as i32),
        Arg::i32(c as i32),
        Arg::f32(eps),
    ];
    // SAFETY: the kernel's arguments in its order; consumer j's rows of phase 1 lie in its
    // buffers, the partial sum and its predecessor hold `rows` rows of `d` (checked above), and
    // the outputs `rows` rows of `d` and of K.
    unsafe { dev.launch(&kernel::<A>("depth_input"), per_row(rows, d), &args) }?;
    Ok(out)
}

/// One consumer's share of the backward pass, as the completed sources' backward reads it (as
/// the CPU's `depth::ConsumerGrad`).
#[derive(Clone, Copy)]
pub struct ConsumerGrad<'a, A: Act> {
    /// Gradient of the consumer's input `h`, `[rows, d]`.
    pub dh: &'a Buf<A>,
    /// Per token `⟨dh, h⟩`.
    pub dh_dot_h: &'a Buf<f32>,
    pub weights: Weights<'a>,
}

/// A source as the backward reads it: values `[rows, d]` and per-token 1/rms (or several
/// consecutive sources, `[n, rows, d]` and `[n, rows]`).
#[derive(Clone, Copy)]
pub struct Source<'a, A: Act> {
    pub v: Slice<'a, A>,
    pub rstd: Slice<'a, f32>,
}

/// The gradients of consecutive completed sources (`srcs`: `[n, rows, d]` values with their
/// 1/rms, from source `first`) from `readers` at once (reader `l` reads source `first + s` at
/// that column of its weights), into `outs` (one `[rows, d]` buffer per source, added to what
/// it holds with `accumulate`). Reader `l`'s coefficients for source `s` go to row `l` of
/// slab `s` of `b` (`[n, consumers, rows]`), which [`query_grads`] then takes.
#[allow(clippy::too_many_arguments)]
pub fn source_grads<A: Act>(
    dev: &Device,
    outs: &mut [Buf<A>],
    accumulate: bool,
    b: &mut Buf<A>,
    consumers: usize,
    readers: &[(usize, ConsumerGrad<A>)],
    first: usize,
    srcs: Source<A>,
    d: usize,
) -> Result<()> {
    let (rows, n) = (srcs.rstd.len() / outs.len().max(1), outs.len());
    assert!(n > 0 && srcs.rstd.len() == n * rows && srcs.v.len() == n * rows * d);
    assert!(outs.iter().all(|o| o.len() == rows * d) && !readers.is_empty());
    assert!(b.len() >= n * consumers * rows, "a slab of b per source");
    // Per reader the addresses of dh, dh_dot_h, alpha, logits and w, each field after the
    // last; then each source's gradient.
    let mut tables = Vec::with_capacity(5 * readers.len() + n);
    for field in 0..5 {
        tables.extend(readers.iter().map(|(_, g)| {
            let x = g.weights;
            let a = [g.dh.arg(), g.dh_dot_h.arg(), x.alpha.arg(), x.logits.arg(), x.w.arg()];
            a[field].bits() as i64
        }));
    }
    tables.extend(outs.iter_mut().map(|o| o.arg_mut().bits() as i64));
    for (l, g) in readers {
        let (x, k) = (g.weights, g.weights.n_sources);
        assert!(first + n <= k && x.alpha.len() == rows * k && x.logits.len() == rows * k);
        assert!(g.dh.len() == rows * d && g.dh_dot_h.len() == rows && x.w.len() == d);
        assert!(*l < consumers, "reader {l}'s row of b");
    }
    let ks: Vec<i32> = readers.iter().map(|(_, g)| g.weights.n_sources as i32).collect();
    let rows_of: Vec<i32> = readers.iter().map(|(l, _)| *l as i32).collect();
    let (tables, ks, rows_of) = (dev.upload(&tables)?, dev.upload(&ks)?, dev.upload(&rows_of)?);
    let args = [
        b.arg_mut(),
        tables.arg(),
        ks.arg(),
        rows_of.arg(),
        Arg::i32(readers.len() as i32),
        Arg::i32(n as i32),
        srcs.v.arg(),
        srcs.rstd.arg(),
        Arg::i32(first as i32),
        Arg::i64(consumers * rows),
        Arg::i32(rows as i32),
        Arg::i32(d as i32),
        Arg::i32(accumulate as i32),
    ];
    let cfg = LaunchConfig { shared_mem_bytes: row_sums_bytes(d), ..per_row(rows, d) };
    // SAFETY: the kernel's arguments in its order; the tables hold the addresses of buffers
    // that `readers` and `outs` borrow (so they outlive the launch, which the stream orders
    // before any later free), each of the size checked above; shared memory holds one row of
    // sums.
    unsafe { dev.launch(&kernel::<A>("depth_source_grads"), cfg, &args) }
}

/// A consumer's input as its norm took it: `h` (`[rows, d]`), its per-token 1/rms and the
/// norm's gain.
#[derive(Clone, Copy)]
pub struct Normed<'a, A: Act> {
    pub h: &'a Buf<A>,
    pub rstd: &'a Buf<f32>,
    pub g: Slice<'a, f32>,
}

/// What a consumer's forward kept for its backward: its weights and logits over the sources
/// it read (`[rows, K]`, completed sources first), and its effective query.
#[derive(Clone, Copy)]
pub struct Weights<'a> {
    pub alpha: &'a Buf<f32>,
    pub logits: &'a Buf<f32>,
    pub n_sources: usize,
    pub w: Slice<'a, f32>,
}

/// The backward of a consumer that reads a partial sum, through its input's norm and into the
/// partial sum in one pass: from `dy`, the gradient of the normalised input `x`, returns the
/// gradient of the input `h` and each token's `⟨dh, h⟩` (which the completed sources'
/// gradients take later); the gain's gradient goes into `dg`, the partial sum's (the last of
/// the consumer's sources) into `acc`, the gradient of its block's earlier outputs, and the
/// effective query's into `dw`, each added to what it holds.
#[allow(clippy::too_many_arguments)]
pub fn partial_backward<A: Act>(
    dev: &Device,
    acc: &mut Buf<A>,
    dg: &mut SliceMut<f32>,
    dw: &mut SliceMut<f32>,
    dy: &Buf<A>,
    x: Normed<A>,
    read: Weights,
    partial: Source<A>,
) -> Result<(Buf<A>, Buf<f32>)> {
    let (rows, d, k) = (x.rstd.len(), x.g.len(), read.n_sources);
    assert!(x.h.len() == rows * d && dy.len() == rows * d && acc.len() == rows * d);
    assert!(partial.v.len() == rows * d && partial.rstd.len() == rows);
    assert!(read.alpha.len() == rows * k && read.logits.len() == rows * k && k >= 2);
    assert!(read.w.len() == d && dg.len() == d && dw.len() == d);
    let (mut dh, mut dhh) = (dev.output(rows * d)?, dev.output(rows)?);
    let name = kernel::<A>("depth_partial_backward");
    let (cfg, blocks, per_block) = rows_per_block(dev, &name, rows, d, 2)?;
    let mut parts = dev.output::<f32>(2 * blocks * d)?;
    let args = [
        dh.arg_mut(),
        dhh.arg_mut(),
        acc.arg_mut(),
        parts.arg_mut(),
        dy.arg(),
        x.h.arg(),
        x.g.arg(),
        x.rstd.arg(),
        partial.v.arg(),
        partial.rstd.arg(),
        read.alpha.arg(),
        read.logits.arg(),
        read.w.arg(),
        Arg::i32(k as i32),
        Arg::i32(rows as i32),
        Arg::i32(d as i32),
        Arg::i32(per_block as i32),
    ];
    // SAFETY: the kernel's arguments in its order; every row buffer holds `rows` rows of `d`,
    // the weights `rows` rows of `k` (checked above), `parts` two rows of `d` per block, and
    // shared memory two rows of sums.
    unsafe { dev.launch(&name, cfg, &args) }?;
    add_column_sums(dev, dg, parts.slice(0..blocks * d), d)?;
    add_column_sums(dev, dw, parts.slice(blocks * d..2 * blocks * d), d)?;
    Ok((dh, dhh))
}

/// The effective-query gradients of consumers that read source `v` (`[rows, d]`), added into
/// `dws` (`[consumers, d]`): `dw_c += Σ_t b[c, t]·v_t` for the coefficients `b`
/// (`[consumers, rows]`) that [`source_grads`] left, one product for all of them.
pub fn query_grads<A: Act>(
    dev: &Device,
    dws: &mut SliceMut<f32>,
    b: Slice<A>,
    v: Slice<A>,
    rows: usize,
    d: usize,
) -> Result<()> {
    let consumers = b.len() / rows;
    assert!(consumers * rows == b.len() && v.len() == rows * d && dws.len() == consumers * d);
    let g = Gemm { beta: 1.0, ..Gemm::packed(consumers, d, rows, false, false) };
    let g = g.typed(A::TYPE, DType::F32);
    // SAFETY: the operands hold the packed matrices `g` spans (checked above); `dws` is a
    // `&mut` of its own, so overlaps neither input.
    unsafe { gemm(dev, &g, b.arg(), v.arg(), dws.arg_mut()) }
}

/// `y = a ⊙ b` (`y += a ⊙ b` with `accumulate`): a consumer's effective query `q ⊙ γ`, or the
/// gradients of `q` and `γ` from the effective query's.
pub fn product(
    dev: &Device,
    y: &mut SliceMut<f32>,
    a: Slice<f32>,
    b: Slice<f32>,
    accumulate: bool,
) -> Result<()> {
    let n = y.len();
    assert!(a.len() == n && b.len() == n && n <= i32::MAX as usize);
    let name = if accumulate { "depth_query_grad" } else { "depth_query" };
    let args = [y.arg_mut(), a.arg(), b.arg(), Arg::i32(n as i32)];
    // SAFETY: the kernel's arguments in its order; three vectors of `n` values.
    unsafe { dev.launch(name, per_value(n), &args) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::depth as cpu;
    use crate::kernels::rmsnorm;
    use crate::testutil::{assert_close_to_largest, assert_row_dots, rand_vec};

    const EPS: f32 = 1e-6;

    /// Rows of 1/rms, as the CPU takes them.
    fn rstd_of(v: &[f32], d: usize) -> Vec<f32> {
        let mut r = vec![0.0f32; v.len() / d];
        rmsnorm::rstd(&mut r, v, d, EPS);
        r
    }

    /// A block's sums and both phases against the CPU's: `s` consumers over `c` completed
    /// sources, consumer j > 0 also reading its partial sum, which phase 2 makes from the
    /// previous output and (j > 1) the sum before, and every consumer's input normalised.
    /// Ten consumers take two launches of phase 1; rows of 203 values end in part of a chunk
    /// and start unaligned.
    fn the_forward_matches_the_cpu(dev: &Device) {
        // Blocks of one warp, and of four (rows of 1000: sums over warps); partial sums of
        // 1e20, whose squares overflow f32 (the 1/rms is taken again in f64).
        let cases = [
            (1, 64, 1, 1, 1.0),
            (37, 203, 4, 3, 1.0),
            (9, 96, 3, 10, 1.0),
            (5, 64, 11, 1, 1.0),
            (6, 1000, 3, 2, 1.0),
            (4, 64, 2, 3, 1e20),
        ];
        for (rows, d, c, s, scale) in cases {
            let at = format!("rows {rows} d {d} C {c} S {s} scale {scale}");
            let srcs = rand_vec(c * rows * d, 1, 2.0);
            let (x, y) = (rand_vec(rows * d, 2, 1.0), rand_vec(rows * d, 3, 1.5));
            let ws = rand_vec(s * d, 4, 1.0);
            let gain: Vec<f32> = rand_vec(d, 5, 0.5).iter().map(|v| 1.0 + v).collect();
            // A completed source: x + y, or x alone.
            for with_y in [true, false] {
                let mut want = x.clone();
                let mut want_r = vec![0.0f32; rows];
                let b = with_y.then_some(y.as_slice());
                rmsnorm::add_assign_rstd(&mut want, b, &mut want_r, d, EPS);
                let (xg, yg) = (dev.upload(&x).unwrap(), dev.upload(&y).unwrap());
                let (mut out, mut r) = (dev.zeros(2 * rows * d).unwrap(), dev.zeros(rows).unwrap());
                let o = &mut out.slice_mut(rows * d..2 * rows * d);
                let b = with_y.then(|| yg.all());
                sum_rstd(dev, o, &mut r.all_mut(), xg.all(), b, d, EPS).unwrap();
                let got = dev.download(&out).unwrap();
                let at = format!("{at}, y {with_y}");
                assert_close_to_largest(&got[rows * d..], &want, 1e-6, &format!("{at}: sum"));
                assert_close_to_largest(&dev.download(&r).unwrap(), &want_r, 1e-6, &at);
            }

            let rs = rstd_of(&srcs, d);
            let mut p1 = cpu::Phase1::default();
            cpu::phase1(&mut p1, &srcs, &rs, &ws, rows, d);
            let (sg, rg, wg) =
                (dev.upload(&srcs).unwrap(), dev.upload(&rs).unwrap(), dev.upload(&ws).unwrap());
            let gg = dev.upload(&gain).unwrap();
            let g1 = phase1(dev, sg.all(), rg.all(), wg.all(), rows, d).unwrap();
            for j in 0..s {
                let at = format!("{at}, consumer {j}");
                let w = &ws[j * d..(j + 1) * d];
                // Consumer j's partial sum: the previous output, plus the sum before it.
                let out = rand_vec(rows * d, 10 + j as u64, 1.5 * scale);
                let prev = (j > 1).then(|| rand_vec(rows * d, 30 + j as u64, scale));
                let mut sum = out.clone();
                let mut pr = vec![0.0f32; rows];
                rmsnorm::add_assign_rstd(&mut sum, prev.as_deref(), &mut pr, d, EPS);
                let partial = (j > 0).then_some((sum.as_slice(), pr.as_slice()));
                let k = c + partial.is_some() as usize;
                let (mut alpha, mut logits) = (vec![0.0; rows * k], vec![0.0; rows * k]);
                let want = cpu::phase2(Some((&mut alpha, &mut logits)), &mut p1, j, partial, w, d);
                let (want_xn, want_rstd) = rmsnorm::forward(&want, &gain, d, EPS);

                let (mut sum_g, mut pr_g) = (dev.upload(&out).unwrap(), dev.zeros(rows).unwrap());
                let prev_g = prev.as_ref().map(|p| dev.upload(p).unwrap());
                let update = (j > 0).then(|| PartialSum {
                    sum: &mut sum_g,
                    rstd: &mut pr_g,
                    prev: prev_g.as_ref().map(|p| p.all()),
                });
                let wj = wg.slice(j * d..(j + 1) * d);
                let got = input(dev, &g1, j, update, wj, gg.all(), d, EPS).unwrap();
                for (name, got, want) in [
                    ("h", dev.download(&got.h).unwrap(), want),
                    ("alpha", dev.download(&got.alpha).unwrap(), alpha),
                    ("logits", dev.download(&got.logits).unwrap(), logits),
                    ("xn", dev.download(&got.xn).unwrap(), want_xn),
                    ("rstd", dev.download(&got.rstd).unwrap(), want_rstd),
                ] {
                    assert_close_to_largest(&got, &want, 1e-5, &format!("{at}: {name}"));
                }
                if j > 0 {
                    assert_close_to_largest(&dev.download(&sum_g).unwrap(), &sum, 1e-6, &at);
                    assert_close_to_largest(&dev.download(&pr_g).unwrap(), &pr, 1e-6, &at);
                } else {
                    assert_eq!(dev.download(&sum_g).unwrap(), out, "{at}: no partial sum");
                }
            }
        }
    }
    crate::gpu::on_cpu_and_gpu!(the_forward_matches_the_cpu);

    /// The backward against the CPU's: each partial sum with its consumer's norm, each
    /// completed source for all of its consumers, and the query gradients.
    fn the_backward_matches_the_cpu(dev: &Device) {
        // Rows of 83 values: some chunks whole, some not, most unaligned, a block of one warp;
        // rows of 1000, blocks of four warps.
        for d in [83, 1000] {
            backward_matches_the_cpu(dev, d);
        }
    }

    fn backward_matches_the_cpu(dev: &Device, d: usize) {
        // 29 tokens: blocks of tokens, the last one short; 10 consumers: readers eight at a
        // time, then two.
        let (rows, c, s) = (29, 3, 10);
        let srcs: Vec<Vec<f32>> = (0..c).map(|i| rand_vec(rows * d, 20 + i as u64, 2.0)).collect();
        let partials: Vec<Vec<f32>> =
            (0..s).map(|j| rand_vec(rows * d, 30 + j as u64, 1.5)).collect();
        let ws = rand_vec(s * d, 4, 1.0);
        let (rs, prs): (Vec<_>, Vec<_>) = (
            srcs.iter().map(|v| rstd_of(v, d)).collect(),
            partials.iter().map(|v| rstd_of(v, d)).collect(),
        );
        // The forward on the CPU gives every consumer's h, weights and logits.
        let mut p1 = cpu::Phase1::default();
        cpu::phase1(&mut p1, &srcs.concat(), &rs.concat(), &ws, rows, d);
        let mut saved = Vec::new();
        for j in 0..s {
            let partial = (j > 0).then(|| (partials[j].as_slice(), prs[j].as_slice()));
            let k = c + partial.is_some() as usize;
            let (mut a, mut l) = (vec![0.0; rows * k], vec![0.0; rows * k]);
            let w = &ws[j * d..(j + 1) * d];
            let h = cpu::phase2(Some((&mut a, &mut l)), &mut p1, j, partial, w, d);
            saved.push((h, a, l, k));
        }
        // Each consumer's input went through a norm; the gradients start at its output.
        let gains: Vec<Vec<f32>> = (0..s)
            .map(|j| rand_vec(d, 50 + j as u64, 0.5).iter().map(|v| 1.0 + v).collect())
            .collect();
        let h_rstd: Vec<Vec<f32>> = (0..s).map(|j| rstd_of(&saved[j].0, d)).collect();
        let dys: Vec<Vec<f32>> = (0..s).map(|j| rand_vec(rows * d, 40 + j as u64, 1.0)).collect();
        let mut want_dg = vec![vec![0.25f32; d]; s];
        let (mut dhs, mut dhh) = (Vec::new(), Vec::new());
        for j in 0..s {
            let mut dot = vec![0.0; rows];
            let (h, g, r) = (&saved[j].0, &gains[j], &h_rstd[j]);
            dhs.push(rmsnorm::backward(&mut want_dg[j], &dys[j], h, g, r, d, Some(&mut dot)));
            dhh.push(dot);
        }
        let grads: Vec<cpu::ConsumerGrad> = (0..s)
            .map(|j| cpu::ConsumerGrad {
                dh: &dhs[j],
                dh_dot_h: &dhh[j],
                alpha: &saved[j].1,
                logits: &saved[j].2,
                n_sources: saved[j].3,
                w: &ws[j * d..(j + 1) * d],
            })
            .collect();
        let mut want_dw = vec![vec![0.0f32; d]; s];
        let mut want_part = vec![vec![0.0f32; rows * d]; s];
        for j in 1..s {
            let (p, r) = (&partials[j], &prs[j]);
            cpu::backward_partial(&mut want_part[j], &mut want_dw[j], &grads[j], c, p, r, d);
        }
        let want_src: Vec<Vec<f32>> = (0..c)
            .map(|i| {
                let mut dw: Vec<&mut [f32]> =
                    want_dw.iter_mut().map(|x| x.as_mut_slice()).collect();
                cpu::backward_source(&mut dw, &grads, i, &srcs[i], &rs[i], d, s, None, true).acc
            })
            .collect();

        let up = |x: &[f32]| dev.upload(x).unwrap();
        let wg = up(&ws);
        let gdev: Vec<_> =
            (0..s).map(|j| (up(&dhs[j]), up(&dhh[j]), up(&saved[j].1), up(&saved[j].2))).collect();
        let grads: Vec<ConsumerGrad<f32>> = gdev
            .iter()
            .enumerate()
            .map(|(j, (dh, dhh, a, l))| {
                let w = wg.slice(j * d..(j + 1) * d);
                let weights = Weights { alpha: a, logits: l, n_sources: saved[j].3, w };
                ConsumerGrad { dh, dh_dot_h: dhh, weights }
            })
            .collect();
        let mut dws = dev.zeros(s * d).unwrap();
        let mut b = dev.zeros(s * rows).unwrap();
        for j in 1..s {
            let (pv, pr) = (up(&partials[j]), up(&prs[j]));
            let partial = Source { v: pv.all(), rstd: pr.all() };
            let (h, r, g, dy) = (up(&saved[j].0), up(&h_rstd[j]), up(&gains[j]), up(&dys[j]));
            let normed = Normed { h: &h, rstd: &r, g: g.all() };
            // Added to what is there, as the sublayer output's gradient is.
            let (mut acc, mut dg) = (up(&vec![0.5f32; rows * d]), up(&vec![0.25f32; d]));
            let dw = &mut dws.slice_mut(j * d..(j + 1) * d);
            let (dh, dot) = partial_backward(
                dev,
                &mut acc,
                &mut dg.all_mut(),
                dw,
                &dy,
                normed,
                grads[j].weights,
                partial,
            )
            .unwrap();
            let want: Vec<f32> = want_part[j].iter().map(|x| x + 0.5).collect();
            let (dh, dot) = (dev.download(&dh).unwrap(), dev.download(&dot).unwrap());
            // <dh, h> nearly cancels (as in the norm's test).
            assert_row_dots(&dot, &dh, &saved[j].0, d, 1e-6, &format!("consumer {j}: <dh, h>"));
            for (name, got, want) in [
                ("partial", dev.download(&acc).unwrap(), &want),
                ("dh", dh, &dhs[j]),
                ("gain", dev.download(&dg).unwrap(), &want_dg[j]),
            ] {
                assert_close_to_largest(&got, want, 1e-5, &format!("consumer {j}: {name}"));
            }
        }
        let after_partials = dev.download(&dws).unwrap();
        // Each source from all of its readers at once, as the backward pass reaches it.
        for i in 0..c {
            let (v, r) = (up(&srcs[i]), up(&rs[i]));
            let src = Source { v: v.all(), rstd: r.all() };
            let mut out = [dev.output(rows * d).unwrap()];
            // The readers in the backward pass's order, last first.
            let readers: Vec<(usize, ConsumerGrad<f32>)> =
                grads.iter().enumerate().rev().map(|(j, g)| (j, *g)).collect();
            source_grads(dev, &mut out, false, &mut b, s, &readers, i, src, d).unwrap();
            query_grads(dev, &mut dws.all_mut(), b.all(), v.all(), rows, d).unwrap();
            let got = dev.download(&out[0]).unwrap();
            assert_close_to_largest(&got, &want_src[i], 1e-5, &format!("source {i}"));
        }
        let got = dev.download(&dws).unwrap();
        assert_close_to_largest(&got, &want_dw.concat(), 1e-5, "query gradients");
        // A block of readers at a time into every source: consumers 9 to 5 start the sums, 4
        // to 0 add to them; the coefficients go to a slab of b per source.
        let (v, r) = (up(&srcs.concat()), up(&rs.concat()));
        let all = Source { v: v.all(), rstd: r.all() };
        let mut outs: Vec<_> = (0..c).map(|_| dev.output(rows * d).unwrap()).collect();
        let mut slabs = dev.zeros(c * s * rows).unwrap();
        for (block, accumulate) in [(5..10, false), (0..5, true)] {
            let readers: Vec<(usize, ConsumerGrad<f32>)> =
                block.rev().map(|j| (j, grads[j])).collect();
            source_grads(dev, &mut outs, accumulate, &mut slabs, s, &readers, 0, all, d).unwrap();
        }
        let mut dws = up(&after_partials);
        for (i, out) in outs.iter().enumerate() {
            let got = dev.download(out).unwrap();
            assert_close_to_largest(&got, &want_src[i], 1e-5, &format!("source {i} by block"));
            let b = slabs.slice(i * s * rows..(i + 1) * s * rows);
            let v = v.slice(i * rows * d..(i + 1) * rows * d);
            query_grads(dev, &mut dws.all_mut(), b, v, rows, d).unwrap();
        }
        let got = dev.download(&dws).unwrap();
        assert_close_to_largest(&got, &want_dw.concat(), 1e-5, "query gradients by block");
        // A reader of one source weighs it 1 whatever its logit: its gradient passes to the
        // source unchanged and none reaches its query, exactly (on the CPU, the two dot
        // products cancel).
        let (alpha, logits) = (up(&vec![1.0f32; rows]), up(&rand_vec(rows, 7, 3.0)));
        let (w, v0, r0) = (wg.slice(0..d), up(&srcs[0]), up(&rs[0]));
        let weights = Weights { alpha: &alpha, logits: &logits, n_sources: 1, w };
        let single = ConsumerGrad { dh: &gdev[0].0, dh_dot_h: &gdev[0].1, weights };
        let (mut out, mut b1) = ([dev.output(rows * d).unwrap()], dev.output(rows).unwrap());
        let src = Source { v: v0.all(), rstd: r0.all() };
        source_grads(dev, &mut out, false, &mut b1, 1, &[(0, single)], 0, src, d).unwrap();
        assert_eq!(dev.download(&out[0]).unwrap(), dhs[0], "one source's gradient");
        assert!(dev.download(&b1).unwrap().iter().all(|b| *b == 0.0), "one source's query");

        // The products that turn the effective query's gradient into q's and γ's.
        let (q, gamma) = (rand_vec(d, 5, 1.0), rand_vec(d, 6, 1.0));
        let (qg, gg) = (up(&q), up(&gamma));
        let mut y = up(&vec![1.0f32; d]);
        product(dev, &mut y.all_mut(), qg.all(), gg.all(), true).unwrap();
        let want: Vec<f32> = q.iter().zip(&gamma).map(|(a, b)| 1.0 + a * b).collect();
        assert_close_to_largest(&dev.download(&y).unwrap(), &want, 1e-6, "accumulated product");
        product(dev, &mut y.all_mut(), qg.all(), gg.all(), false).unwrap();
        let want: Vec<f32> = q.iter().zip(&gamma).map(|(a, b)| a * b).collect();
        assert_eq!(dev.download(&y).unwrap(), want, "product");
    }
    crate::gpu::on_cpu_and_gpu!(the_backward_matches_the_cpu);
}
