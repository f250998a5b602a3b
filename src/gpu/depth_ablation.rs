//! The depth attention with the ablation options on the GPU (`kernels/depth_ablation.cu`):
//! what `crate::kernels::depth::ablation` computes on the CPU, one consumer in one pass over
//! the sources it reads ([`forward`], [`backward`]), with the pieces of the input-dependent
//! query around it ([`read_sum`], [`read_spread`], [`query_backward`]) and the completed
//! sources' gradients, summed in f32, handed on as activations ([`narrow`]).

use super::act::{kernel, Act};
use super::buffer::{Arg, Buf, Slice};
use super::device::Device;
use super::{per_row, per_value};
use crate::kernels::depth::ablation::{Gate, Options};
use anyhow::Result;
use cudarc::driver::LaunchConfig;

/// The sources one consumer reads: the embedding (completed source 0), the completed sources
/// `first..completed`, and the partial sum last when it reads one.
#[derive(Clone, Copy)]
pub struct Read<'a, A: Act> {
    /// Every completed source, `[n, rows, d]`, and their 1/rms `[n, rows]`.
    pub values: Slice<'a, A>,
    pub rstds: Slice<'a, f32>,
    /// The partial sum and its 1/rms.
    pub partial: Option<(Slice<'a, A>, Slice<'a, f32>)>,
    pub first: usize,
    pub completed: usize,
    pub rows: usize,
    pub d: usize,
}

impl<A: Act> Read<'_, A> {
    /// The completed sources read.
    fn nc(&self) -> usize {
        1 + self.completed - self.first
    }

    /// The sources read.
    pub fn k(&self) -> usize {
        self.nc() + self.partial.is_some() as usize
    }

    /// The kernels' arguments for the read: values, rstds, p, pr, first, nc, rows, d.
    fn args(&self) -> [Arg; 8] {
        let (rows, d) = (self.rows, self.d);
        let n = self.rstds.len() / rows;
        assert!(n * rows == self.rstds.len() && self.values.len() == n * rows * d);
        assert!(1 <= self.first && self.first <= self.completed && self.completed <= n);
        assert!(self.partial.is_none_or(|(p, r)| p.len() == rows * d && r.len() == rows));
        assert!(self.values.len() <= i32::MAX as usize * d, "{n} sources of {rows} rows");
        let (p, pr) = self.partial.map_or((Arg::null(), Arg::null()), |(p, r)| (p.arg(), r.arg()));
        [
            self.values.arg(),
            self.rstds.arg(),
            p,
            pr,
            Arg::i32(self.first as i32),
            Arg::i32(self.nc() as i32),
            Arg::i32(rows as i32),
            Arg::i32(d as i32),
        ]
    }

    /// The source-gradient arguments: every completed source's (f32, laid out as `values`), and
    /// the partial sum's when read.
    fn grad_args(&self, dvalues: &mut Buf<f32>, dp: Option<&mut Buf<A>>) -> [Arg; 2] {
        assert_eq!(dvalues.len(), self.values.len(), "a gradient for every completed source");
        assert_eq!(dp.is_some(), self.partial.is_some(), "a gradient for the partial sum read");
        let dp = dp.map_or(Arg::null(), |g| {
            assert_eq!(g.len(), self.rows * self.d);
            g.arg_mut()
        });
        [dvalues.arg_mut(), dp]
    }
}

/// Where a consumer's logits come from.
#[derive(Clone, Copy)]
pub enum Query<'a> {
    /// The effective query `[d]` of every token.
    Static(Slice<'a, f32>),
    /// One query per token, `[rows, d]`, times the key-norm gain `[d]` when given.
    PerToken { q: Slice<'a, f32>, gain: Option<Slice<'a, f32>> },
    /// The consumer's learned logits over all of the model's sources (`[n_cols]`), the
    /// partial sum's at `partial_col`.
    Scalar { logits: Slice<'a, f32>, partial_col: usize },
}

impl Query<'_> {
    /// The arguments w, stride, gain, scalars, partial_col, n_cols for `rows` tokens of `d`.
    fn args(&self, rows: usize, d: usize) -> [Arg; 6] {
        let int = |v: usize| Arg::i32(v as i32);
        match *self {
            Query::Static(w) => {
                assert_eq!(w.len(), d);
                [w.arg(), int(0), Arg::null(), Arg::null(), int(0), int(0)]
            }
            Query::PerToken { q, gain } => {
                assert!(q.len() == rows * d && gain.is_none_or(|g| g.len() == d));
                let gain = gain.map_or(Arg::null(), |g| g.arg());
                [q.arg(), int(d), gain, Arg::null(), int(0), int(0)]
            }
            Query::Scalar { logits, partial_col } => {
                assert!(partial_col < logits.len() && logits.len() <= i32::MAX as usize);
                [
                    Arg::null(),
                    int(0),
                    Arg::null(),
                    logits.arg(),
                    int(partial_col),
                    int(logits.len()),
                ]
            }
        }
    }

    /// Values of the query's gradient per token.
    fn grad_width(&self, d: usize) -> usize {
        match self {
            Query::Scalar { logits, .. } => logits.len(),
            _ => d,
        }
    }
}

/// The options as the kernels take them: gate, key_norm, heads.
fn option_args(o: Options, d: usize, scalar: bool) -> [Arg; 3] {
    assert!(o.heads >= 1 && d.is_multiple_of(o.heads), "{} heads over {d} channels", o.heads);
    assert!(!scalar || o.heads == 1, "content-free logits have one head");
    let gate = match o.gate {
        Gate::Softmax => 0,
        Gate::Sigmoid => 1,
        Gate::Identity => 2,
    };
    [Arg::i32(gate), Arg::i32(o.key_norm as i32), Arg::i32(o.heads as i32)]
}

/// A block per token with `floats` of dynamic shared memory.
fn per_token(rows: usize, d: usize, floats: usize) -> LaunchConfig {
    LaunchConfig { shared_mem_bytes: (floats * size_of::<f32>()) as u32, ..per_row(rows, d) }
}

/// A consumer's input `h` (`[rows, d]`) and its weights and logits over the sources it read
/// (`[rows, k, heads]`, the completed sources first).
pub fn forward<A: Act>(
    dev: &Device,
    read: &Read<A>,
    query: &Query,
    o: Options,
) -> Result<(Buf<A>, Buf<f32>, Buf<f32>)> {
    let (rows, d, k) = (read.rows, read.d, read.k());
    let scalar = matches!(query, Query::Scalar { .. });
    let (mut h, mut alpha, mut logits) =
        (dev.output(rows * d)?, dev.output(rows * k * o.heads)?, dev.output(rows * k * o.heads)?);
    let [w, stride, gain, scalars, partial_col, _] = query.args(rows, d);
    let mut args = vec![h.arg_mut(), alpha.arg_mut(), logits.arg_mut()];
    args.extend(read.args());
    args.extend([w, stride, gain, scalars, partial_col]);
    args.extend(option_args(o, d, scalar));
    let cfg = per_token(rows, d, k * o.heads);
    // SAFETY: the kernel's arguments in its order; the outputs hold `rows` rows of `d` and of
    // k·heads, the inputs are checked by `Read::args` and `Query::args`; shared memory holds
    // a token's k·heads weights.
    unsafe { dev.launch(&kernel::<A>("depth_ablation_forward"), cfg, &args) }?;
    Ok((h, alpha, logits))
}

/// The backward of [`forward`] from `dh`, the gradient of `h`: adds each source's gradient
/// into `dvalues` (the completed sources', f32, laid out as `read.values`) or `dp` (the
/// partial sum's), and returns the query's gradient per token: `[rows, d]` of the effective
/// query's, or with scalar logits `[rows, n_cols]` (zero where a source was not read).
#[allow(clippy::too_many_arguments)]
pub fn backward<A: Act>(
    dev: &Device,
    dvalues: &mut Buf<f32>,
    dp: Option<&mut Buf<A>>,
    dh: &Buf<A>,
    read: &Read<A>,
    alpha: &Buf<f32>,
    logits: &Buf<f32>,
    query: &Query,
    o: Options,
) -> Result<Buf<f32>> {
    let (rows, d, k) = (read.rows, read.d, read.k());
    assert!(
        dh.len() == rows * d && alpha.len() == rows * k * o.heads && logits.len() == alpha.len()
    );
    let scalar = matches!(query, Query::Scalar { .. });
    let mut dq = dev.output(rows * query.grad_width(d))?;
    let [dv, dp] = read.grad_args(dvalues, dp);
    let mut args = vec![dv, dp, dq.arg_mut(), dh.arg()];
    args.extend(read.args());
    args.extend([alpha.arg(), logits.arg()]);
    args.extend(query.args(rows, d));
    args.extend(option_args(o, d, scalar));
    let cfg = per_token(rows, d, 3 * k * o.heads + k);
    // SAFETY: as in `forward`; the gradients are checked by `Read::grad_args` and `dq` holds
    // a row of the query's gradient per token; shared memory holds a token's three rows of
    // k·heads and one of k.
    unsafe { dev.launch(&kernel::<A>("depth_ablation_backward"), cfg, &args) }?;
    Ok(dq)
}

/// The sum of the sources `read` reads, `[rows, d]`: the input-dependent query's input.
pub fn read_sum<A: Act>(dev: &Device, read: &Read<A>) -> Result<Buf<A>> {
    let mut x = dev.output(read.rows * read.d)?;
    let mut args = vec![x.arg_mut()];
    args.extend(read.args());
    // SAFETY: the kernel's arguments in its order; `x` holds `rows` rows of `d`.
    unsafe {
        dev.launch(&kernel::<A>("depth_ablation_read_sum"), per_row(read.rows, read.d), &args)
    }?;
    Ok(x)
}

/// Adds `dx`, the gradient of [`read_sum`]'s sum, into the gradient of every source read.
pub fn read_spread<A: Act>(
    dev: &Device,
    dvalues: &mut Buf<f32>,
    dp: Option<&mut Buf<A>>,
    dx: &Buf<A>,
    read: &Read<A>,
) -> Result<()> {
    assert_eq!(dx.len(), read.rows * read.d);
    let [dv, dp] = read.grad_args(dvalues, dp);
    let mut args = vec![dv, dp, dx.arg()];
    args.extend(read.args());
    let cfg = per_row(read.rows, read.d);
    // SAFETY: the kernel's arguments in its order, checked by `Read::grad_args` and above.
    unsafe { dev.launch(&kernel::<A>("depth_ablation_read_spread"), cfg, &args) }
}

/// The input-dependent query's backward through its gain: from `dw`, the effective query's
/// gradient (`[rows, d]`), the gradient of `q = W·x̂` as an activation (`dw ⊙ γ`, or `dw`
/// without a gain) and, with a gain, the rows `dw ⊙ q` whose column sums are the gain's.
pub fn query_backward<A: Act>(
    dev: &Device,
    dw: &Buf<f32>,
    q: &Buf<f32>,
    gain: Option<Slice<f32>>,
    d: usize,
) -> Result<(Buf<A>, Option<Buf<f32>>)> {
    let n = dw.len();
    assert!(q.len() == n && n.is_multiple_of(d) && gain.is_none_or(|g| g.len() == d));
    let mut dq = dev.output(n)?;
    let mut parts = gain.map(|_| dev.output(n)).transpose()?;
    let args = [
        dq.arg_mut(),
        parts.as_mut().map_or(Arg::null(), |p| p.arg_mut()),
        dw.arg(),
        q.arg(),
        gain.map_or(Arg::null(), |g| g.arg()),
        Arg::i32(d as i32),
        Arg::i64(n),
    ];
    // SAFETY: the kernel's arguments in its order; every buffer holds `n` values, the gain `d`.
    unsafe { dev.launch(&kernel::<A>("depth_ablation_query_backward"), per_value(n), &args) }?;
    Ok((dq, parts))
}

/// `x` in the activations' type: a completed source's gradient, summed in f32.
pub fn narrow<A: Act>(dev: &Device, x: Slice<f32>) -> Result<Buf<A>> {
    let n = x.len();
    let mut y = dev.output(n)?;
    let args = [y.arg_mut(), x.arg(), Arg::i64(n)];
    // SAFETY: the kernel's arguments in its order; two runs of `n` values.
    unsafe { dev.launch(&kernel::<A>("depth_ablation_narrow"), per_value(n), &args) }?;
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::bf16_tests::{within, ONCE};
    use crate::gpu::buffer::Bf16;
    use crate::kernels::depth::ablation::{self as cpu, Query as CpuQuery};
    use crate::kernels::depth::reference::rstd_of;
    use crate::testutil::rand_vec;

    const EPS: f32 = 1e-6;

    /// `n` random values that type `A` holds exactly, so that both sides take the same inputs.
    fn values<A: Act>(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        rand_vec(n, seed, scale).into_iter().map(|x| A::from_f32(x).to_f32()).collect()
    }

    fn up<A: Act>(dev: &Device, x: &[f32]) -> Buf<A> {
        dev.upload(&x.iter().map(|&v| A::from_f32(v)).collect::<Vec<A>>()).unwrap()
    }

    fn down<A: Act>(dev: &Device, x: &Buf<A>) -> Vec<f32> {
        dev.download(x).unwrap().into_iter().map(|v| v.to_f32()).collect()
    }

    /// The query kinds the tests take.
    #[derive(Clone, Copy, Debug)]
    enum Kind {
        Static,
        PerToken { gain: bool },
        Scalar,
    }

    /// Completed sources; the first read after the embedding (a window); the model's sources.
    const N: usize = 5;
    const FIRST: usize = 3;
    const N_COLS: usize = 7;

    /// The sources one consumer reads, on the host and on the device: the embedding and the
    /// latest two of five completed sources, and with `partial` a partial sum.
    struct Sources<A: Act> {
        rows: usize,
        d: usize,
        values: Vec<f32>,
        rstds: Vec<f32>,
        p: Vec<f32>,
        pr: Vec<f32>,
        partial: bool,
        on_device: (Buf<A>, Buf<f32>, Buf<A>, Buf<f32>),
    }

    impl<A: Act> Sources<A> {
        fn new(dev: &Device, rows: usize, d: usize, partial: bool) -> Sources<A> {
            let (values, p) = (values::<A>(N * rows * d, 1, 2.0), values::<A>(rows * d, 2, 1.5));
            let (rstds, pr) = (rstd_of(&values, d, EPS), rstd_of(&p, d, EPS));
            let on_device = (
                up::<A>(dev, &values),
                dev.upload(&rstds).unwrap(),
                up::<A>(dev, &p),
                dev.upload(&pr).unwrap(),
            );
            Sources { rows, d, values, rstds, p, pr, partial, on_device }
        }

        /// The completed sources read, in order.
        fn completed_read(&self) -> Vec<usize> {
            std::iter::once(0).chain(FIRST..N).collect()
        }

        /// Each source's column among the model's sources (the partial sum's last).
        fn columns(&self) -> Vec<usize> {
            let partial = self.partial.then_some(N_COLS - 1);
            self.completed_read().into_iter().chain(partial).collect()
        }

        /// The sources read and their 1/rms, as the CPU takes them: a list.
        fn on_host(&self) -> (Vec<&[f32]>, Vec<&[f32]>) {
            let (rows, plane) = (self.rows, self.rows * self.d);
            let read = self.completed_read();
            let mut sv: Vec<&[f32]> =
                read.iter().map(|&i| &self.values[i * plane..(i + 1) * plane]).collect();
            let mut rv: Vec<&[f32]> =
                read.iter().map(|&i| &self.rstds[i * rows..(i + 1) * rows]).collect();
            if self.partial {
                sv.push(&self.p);
                rv.push(&self.pr);
            }
            (sv, rv)
        }

        /// The gradients of the sources read among `dvalues` (every completed source's) and
        /// `dp`, as the CPU takes them.
        fn grads_on_host<'a>(
            &self,
            dvalues: &'a mut [f32],
            dp: &'a mut [f32],
        ) -> Vec<&'a mut [f32]> {
            let plane = self.rows * self.d;
            let mut read = self.completed_read().into_iter().peekable();
            let mut grads: Vec<&mut [f32]> = dvalues
                .chunks_mut(plane)
                .enumerate()
                .filter_map(|(i, g)| read.next_if_eq(&i).map(|_| g))
                .collect();
            if self.partial {
                grads.push(dp);
            }
            grads
        }

        fn read(&self) -> Read<'_, A> {
            let (v, r, p, pr) = &self.on_device;
            Read {
                values: v.all(),
                rstds: r.all(),
                partial: self.partial.then(|| (p.all(), pr.all())),
                first: FIRST,
                completed: N,
                rows: self.rows,
                d: self.d,
            }
        }
    }

    /// One consumer's forward and backward against the CPU kernel's, with query `kind` and
    /// options `o`.
    fn check_consumer<A: Act>(
        dev: &Device,
        rounding: f32,
        s: &Sources<A>,
        kind: Kind,
        o: Options,
        at: &str,
    ) {
        let (rows, d, heads) = (s.rows, s.d, o.heads);
        let (sv, rv) = s.on_host();
        let k = sv.len();
        let (q, gain) = (rand_vec(rows * d, 3, 0.8), rand_vec(d, 4, 0.5));
        let gain: Vec<f32> = gain.iter().map(|g| 1.0 + g).collect();
        let scalars = rand_vec(N_COLS, 5, 1.0);
        let cpu_w: Vec<f32> = match kind {
            Kind::Static => q[..d].to_vec(),
            Kind::PerToken { gain: false } => q.clone(),
            Kind::PerToken { gain: true } => {
                q.chunks(d).flat_map(|r| r.iter().zip(&gain).map(|(a, b)| a * b)).collect()
            }
            Kind::Scalar => s.columns().iter().map(|&c| scalars[c]).collect(),
        };
        let cpu_q = match kind {
            Kind::Static => CpuQuery::Static(&cpu_w),
            Kind::PerToken { .. } => CpuQuery::PerToken(&cpu_w),
            Kind::Scalar => CpuQuery::Scalar(&cpu_w),
        };
        let mut want_h = vec![0.0; rows * d];
        let (mut want_a, mut want_l) = (vec![0.0; rows * k * heads], vec![0.0; rows * k * heads]);
        cpu::forward(&mut want_h, &mut want_a, &mut want_l, &sv, &rv, cpu_q, o, d);

        let (qg, gg, sg) =
            (dev.upload(&q).unwrap(), dev.upload(&gain).unwrap(), dev.upload(&scalars).unwrap());
        let query = match kind {
            Kind::Static => Query::Static(qg.slice(0..d)),
            Kind::PerToken { gain } => {
                Query::PerToken { q: qg.all(), gain: gain.then(|| gg.all()) }
            }
            Kind::Scalar => Query::Scalar { logits: sg.all(), partial_col: N_COLS - 1 },
        };
        let read = s.read();
        let (h, alpha, logits) = forward(dev, &read, &query, o).unwrap();
        within(&down(dev, &h), &want_h, rounding, &format!("{at}: h"));
        within(&dev.download(&alpha).unwrap(), &want_a, 0.0, &format!("{at}: alpha"));
        within(&dev.download(&logits).unwrap(), &want_l, 0.0, &format!("{at}: logits"));

        // Backward into gradients that already hold something (it adds).
        let dh = values::<A>(rows * d, 6, 1.0);
        let (dv0, dp0) = (rand_vec(N * rows * d, 7, 0.5), values::<A>(rows * d, 8, 0.5));
        let (mut want_dv, mut want_dp) = (dv0.clone(), dp0.clone());
        // The query's gradient has the query's shape.
        let mut want_dq = vec![0.0; cpu_w.len()];
        let mut dsrc = s.grads_on_host(&mut want_dv, &mut want_dp);
        cpu::backward(&mut dsrc, &mut want_dq, &dh, &sv, &rv, &want_a, &want_l, cpu_q, o, d);
        let (mut dvg, mut dpg, dhg) =
            (dev.upload(&dv0).unwrap(), up::<A>(dev, &dp0), up::<A>(dev, &dh));
        let dp = s.partial.then_some(&mut dpg);
        let dq = backward(dev, &mut dvg, dp, &dhg, &read, &alpha, &logits, &query, o).unwrap();
        let dq = dev.download(&dq).unwrap();
        // Static and scalar queries' gradients are the sums over the tokens.
        let width = dq.len() / rows;
        let summed: Vec<f32> =
            (0..width).map(|c| (0..rows).map(|t| dq[t * width + c]).sum()).collect();
        let got_dq = match kind {
            Kind::Static => summed,
            Kind::PerToken { .. } => dq.clone(),
            Kind::Scalar => {
                let cols = s.columns();
                let unread = (0..N_COLS).filter(|c| !cols.contains(c));
                assert!(unread.map(|c| summed[c]).all(|x| x == 0.0), "{at}: unread columns");
                cols.iter().map(|&c| summed[c]).collect()
            }
        };
        within(&got_dq, &want_dq, 0.0, &format!("{at}: dq"));
        within(&dev.download(&dvg).unwrap(), &want_dv, 0.0, &format!("{at}: dvalues"));
        if s.partial {
            within(&down(dev, &dpg), &want_dp, rounding, &format!("{at}: dp"));
        }
    }

    /// The sum of the sources read, and its gradient spread back to each.
    fn check_read_sum_and_spread<A: Act>(dev: &Device, rounding: f32, s: &Sources<A>, at: &str) {
        let (sv, _) = s.on_host();
        let plane = s.rows * s.d;
        let want_x: Vec<f32> = (0..plane).map(|j| sv.iter().map(|v| v[j]).sum()).collect();
        let x = down(dev, &read_sum(dev, &s.read()).unwrap());
        within(&x, &want_x, rounding, &format!("{at}: read_sum"));
        let dx = values::<A>(plane, 6, 1.0);
        let (dv0, dp0) = (rand_vec(N * plane, 7, 0.5), values::<A>(plane, 8, 0.5));
        let (mut want_dv, mut want_dp) = (dv0.clone(), dp0.clone());
        for g in s.grads_on_host(&mut want_dv, &mut want_dp) {
            g.iter_mut().zip(&dx).for_each(|(a, b)| *a += b);
        }
        let (mut dvg, mut dpg, dxg) =
            (dev.upload(&dv0).unwrap(), up::<A>(dev, &dp0), up::<A>(dev, &dx));
        read_spread(dev, &mut dvg, s.partial.then_some(&mut dpg), &dxg, &s.read()).unwrap();
        within(&dev.download(&dvg).unwrap(), &want_dv, 0.0, &format!("{at}: read_spread"));
        if s.partial {
            within(&down(dev, &dpg), &want_dp, rounding, &format!("{at}: read_spread p"));
        }
    }

    /// The input-dependent query's backward through its gain, and f32 sums narrowed.
    fn check_query_backward_and_narrow<A: Act>(dev: &Device, rounding: f32) {
        let (rows, d) = (5, 203);
        let (dw, q) = (rand_vec(rows * d, 9, 1.0), rand_vec(rows * d, 10, 1.0));
        let gain = rand_vec(d, 11, 1.0);
        let (dwg, qg, gg) =
            (dev.upload(&dw).unwrap(), dev.upload(&q).unwrap(), dev.upload(&gain).unwrap());
        let (dq, parts) = query_backward::<A>(dev, &dwg, &qg, Some(gg.all()), d).unwrap();
        let want_dq: Vec<f32> = dw.iter().enumerate().map(|(i, x)| x * gain[i % d]).collect();
        let want_parts: Vec<f32> = dw.iter().zip(&q).map(|(a, b)| a * b).collect();
        within(&down(dev, &dq), &want_dq, rounding, "query_backward dq");
        within(&dev.download(&parts.unwrap()).unwrap(), &want_parts, 0.0, "query_backward parts");
        let (dq, parts) = query_backward::<A>(dev, &dwg, &qg, None, d).unwrap();
        assert!(parts.is_none());
        within(&down(dev, &dq), &dw, rounding, "query_backward dq without a gain");
        let narrowed = down(dev, &narrow::<A>(dev, dwg.slice(d..3 * d)).unwrap());
        within(&narrowed, &dw[d..3 * d], rounding, "narrow");
    }

    /// The ablations' kernels against the CPU's: one consumer reading the embedding and the
    /// latest two of five completed sources (a window), with and without a partial sum, for
    /// every kind of query and gate, with and without key norm, over one head or several.
    /// Activations of type `A`, within `rounding` of their size (plus 1e-5 of the largest
    /// value: the f32 kernels' own error) where the kernel rounds them once.
    fn check<A: Act>(dev: &Device, rounding: f32) {
        use Gate::*;
        let cases = [
            // Rows of one warp's chunks, of 203 values (heads of 29: unaligned), of 1000 (a
            // block of four warps).
            (9, 96, Kind::Static, Softmax, false, 1),
            (9, 96, Kind::Static, Sigmoid, true, 3),
            (5, 203, Kind::PerToken { gain: true }, Softmax, true, 7),
            (5, 203, Kind::PerToken { gain: false }, Sigmoid, false, 1),
            (4, 1000, Kind::Static, Softmax, true, 4),
            (6, 96, Kind::Scalar, Softmax, true, 1),
            (6, 96, Kind::Scalar, Identity, true, 1),
        ];
        for (rows, d, kind, gate, key_norm, heads) in cases {
            for partial in [true, false] {
                let at = format!("{rows}x{d} {kind:?} {gate:?} key norm {key_norm} heads {heads}");
                let at = format!("{at} partial {partial}");
                let s = Sources::<A>::new(dev, rows, d, partial);
                check_consumer(dev, rounding, &s, kind, Options { key_norm, gate, heads }, &at);
                check_read_sum_and_spread(dev, rounding, &s, &at);
            }
        }
        check_query_backward_and_narrow::<A>(dev, rounding);
    }

    fn the_ablations_match_the_cpu(dev: &Device) {
        check::<f32>(dev, 0.0);
    }
    crate::gpu::on_cpu_and_gpu!(the_ablations_match_the_cpu);

    fn the_bf16_ablations_match_the_cpu(dev: &Device) {
        check::<Bf16>(dev, ONCE);
    }
    crate::gpu::on_cpu_and_gpu!(the_bf16_ablations_match_the_cpu);
}
