//! The bf16 kernels against the CPU's f32 kernels.
//!
//! The inputs are bf16 values, which f32 holds exactly, so both sides compute on the same
//! numbers. A bf16 kernel computes in f32 and rounds each output once to bf16, to the nearest:
//! bf16 keeps 8 significant bits, so the rounding moves a value by at most half a unit in its
//! last place, 2^-8 of its size. The bound is that plus the f32 kernels' own error, which the
//! fp32 tests hold to 1e-5 of the largest value: |got − want| ≤ 2^-8·|want| + 1e-5·max|want|.
//! Outputs in f32 (statistics, the loss, gain gradients) keep the fp32 bound. Phase 2 of the
//! depth attention mixes phase 1's rounded mix `o1` (at most its whole weight) into its input,
//! which then rounds: 2^-8·(|want| + |o1|) there; attention's forward mixes the values with
//! probabilities rounded to bf16: 2^-8·(|want| + the largest value) there. Attention's
//! backward reads the forward's rounded output and rounds the probabilities and their
//! gradients for its products: 2^-6 of the largest value; the training pass against the CPU
//! engine (`crate::train::gpu::model`) holds it closer, through every gradient's cosine.

use super::act::Act;
use super::attention;
use super::buffer::{Bf16, Buf};
use super::cross_entropy;
use super::depth;
use super::device::{Device, Ids};
use super::elementwise::{embedding_forward, swiglu_backward, swiglu_forward};
use super::rmsnorm;
use super::rope::{self, RopeTables};
use crate::kernels::attention::AttnShape;
use crate::kernels::rope::{Positions, RopeTable};
use crate::testutil::{assert_close_to_largest, rand_vec};

/// `n` random bf16 values (scaled by `scale`), as f32.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    rand_vec(n, seed, scale).into_iter().map(|x| Bf16::from_f32(x).to_f32()).collect()
}

fn up(dev: &Device, x: &[f32]) -> Buf<Bf16> {
    dev.upload(&x.iter().map(|&v| Bf16::from_f32(v)).collect::<Vec<_>>()).unwrap()
}

fn down(dev: &Device, x: &Buf<Bf16>) -> Vec<f32> {
    dev.download(x).unwrap().into_iter().map(|v| v.to_f32()).collect()
}

/// Every value within `rounding` of its own size plus 1e-5 of the largest.
pub(super) fn within(got: &[f32], want: &[f32], rounding: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let largest = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let bound = rounding * w.abs() + 1e-5 * largest;
        assert!((g - w).abs() <= bound, "{what}[{i}]: got {g}, want {w} (bound {bound})");
    }
}

pub(super) const ONCE: f32 = 1.0 / 256.0;

fn bf16_kernels_match_the_cpu(dev: &Device) {
    // RMSNorm forward and backward.
    // Rows of 203 values: 16-byte chunks, and a chunk of 3 at each row's end.
    let (rows, d) = (37, 203);
    let (x, dy) = (values(rows * d, 1, 3.0), values(rows * d, 2, 1.0));
    let g: Vec<f32> = rand_vec(d, 3, 0.5).iter().map(|v| 1.0 + v).collect();
    let (want_y, want_rstd) = crate::kernels::rmsnorm::forward(&x, &g, d, 1e-5);
    let mut want_dg = vec![0.0f32; d];
    let want_dx = crate::kernels::rmsnorm::backward(&mut want_dg, &dy, &x, &g, &want_rstd, d, None);
    let (xd, dyd, gd) = (up(dev, &x), up(dev, &dy), dev.upload(&g).unwrap());
    let (y, rstd) = rmsnorm::forward(dev, &xd, gd.all(), d, 1e-5).unwrap();
    let mut dg = dev.zeros(d).unwrap();
    let dx =
        rmsnorm::backward(dev, &mut dg.all_mut(), &dyd, &xd, gd.all(), &rstd, d, None).unwrap();
    within(&down(dev, &y), &want_y, ONCE, "rmsnorm y");
    assert_close_to_largest(&dev.download(&rstd).unwrap(), &want_rstd, 1e-5, "rmsnorm rstd");
    within(&down(dev, &dx), &want_dx, ONCE, "rmsnorm dx");
    assert_close_to_largest(&dev.download(&dg).unwrap(), &want_dg, 1e-5, "rmsnorm dg");

    // SwiGLU both ways.
    let f = 96;
    let (gu, dact) = (values(rows * 2 * f, 4, 2.0), values(rows * f, 5, 1.0));
    let want_act = crate::kernels::swiglu::forward(&gu, f);
    let mut want_dgu = vec![0.0f32; gu.len()];
    crate::kernels::swiglu::backward(&mut want_dgu, &dact, &gu, f);
    let (gud, dactd) = (up(dev, &gu), up(dev, &dact));
    within(&down(dev, &swiglu_forward(dev, &gud, f).unwrap()), &want_act, ONCE, "swiglu act");
    let dgu = swiglu_backward(dev, &dactd, &gud, f).unwrap();
    within(&down(dev, &dgu), &want_dgu, ONCE, "swiglu dgu");

    // The embedding's rows, rounded.
    let (vocab, table) = (11, rand_vec(11 * d, 6, 1.0));
    let ids: Vec<u32> = (0..rows as u32).map(|t| t * 7 % vocab as u32).collect();
    let want: Vec<f32> = ids.iter().flat_map(|&i| table[i as usize * d..][..d].to_vec()).collect();
    let (table_d, ids_d) = (dev.upload(&table).unwrap(), Ids::upload(dev, &ids, vocab).unwrap());
    let out = embedding_forward::<Bf16>(dev, table_d.all(), &ids_d, d).unwrap();
    within(&down(dev, &out), &want, ONCE, "embedding");

    // RoPE both ways.
    let (hd, heads, seq) = (64, 3, 25);
    let width = heads * hd;
    let table = RopeTable::new(hd, 64, 10000.0);
    let gpu_table = RopeTables::upload(dev, &table).unwrap();
    let x = values(2 * seq * width, 7, 2.0);
    let positions: Vec<u32> = (0..2 * seq as u32).map(|r| r % seq as u32).collect();
    let positions = gpu_table.positions(dev, &positions).unwrap();
    for inverse in [false, true] {
        let mut want = x.clone();
        let packed = Positions::Packed(seq);
        crate::kernels::rope::apply(&mut want, width, 0, heads, packed, &table, inverse);
        let mut got = up(dev, &x);
        rope::apply(dev, &mut got, width, 0, heads, &positions, &gpu_table, inverse).unwrap();
        within(&down(dev, &got), &want, ONCE, &format!("rope, inverse {inverse}"));
    }

    // Cross-entropy: the loss (f32) and the logits' gradient.
    let v = 300;
    let logits = values(rows * v, 8, 4.0);
    let targets: Vec<u32> = (0..rows as u32).map(|t| t * 13 % v as u32).collect();
    let (want_loss, want_dlogits) =
        crate::kernels::cross_entropy::loss_and_grad(&logits, &targets, v);
    let targets_d = Ids::upload(dev, &targets, v).unwrap();
    let (loss, dlogits) =
        cross_entropy::loss_and_grad(dev, up(dev, &logits), &targets_d, v).unwrap();
    assert!((loss - want_loss).abs() <= 1e-5 * want_loss, "loss {loss} vs {want_loss}");
    within(&down(dev, &dlogits), &want_dlogits, ONCE, "dlogits");

    // Attention forward on the tensor cores: the output and its statistics, over grouped and
    // plain heads, sequences that end inside a tile and span several blocks, every head size
    // the kernels are built for. Its product with the values takes the probabilities rounded
    // to bf16 (2^-8 of each): 2^-8 of the largest value more. In the last case the first
    // query's one score is -128, so that e^128 (past f32) would meet the zero rows past the
    // sequence in backward's tiles, whose statistics are the first row's, unless they are
    // masked.
    let shapes = [
        (AttnShape { batch: 2, seq: 37, heads: 4, kv_heads: 2, head_dim: 16 }, false),
        (AttnShape { batch: 1, seq: 90, heads: 2, kv_heads: 2, head_dim: 32 }, false),
        (AttnShape { batch: 1, seq: 150, heads: 2, kv_heads: 1, head_dim: 64 }, false),
        (AttnShape { batch: 1, seq: 100, heads: 3, kv_heads: 1, head_dim: 96 }, false),
        (AttnShape { batch: 1, seq: 70, heads: 1, kv_heads: 1, head_dim: 128 }, false),
        (AttnShape { batch: 1, seq: 150, heads: 2, kv_heads: 1, head_dim: 64 }, true),
    ];
    for (s, first_score_far_below) in shapes {
        assert!(attention::on_tensor_cores::<Bf16>(s), "{s:?} is not on the tensor cores");
        let mut qkv = values(s.batch * s.seq * s.qkv_width(), 9, 2.0);
        if first_score_far_below {
            // Token 0's first query head all 4s, its key all -4s: 64 * -16 / sqrt(64).
            let (hd, keys) = (s.head_dim, s.heads * s.head_dim);
            qkv[..hd].fill(4.0);
            qkv[keys..keys + hd].fill(-4.0);
        }
        let (want_out, want_stats) = crate::kernels::attention::forward(&qkv, s);
        let (out, stats) = attention::forward(dev, &up(dev, &qkv), s).unwrap();
        let largest = qkv.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (i, (g, w)) in down(dev, &out).iter().zip(&want_out).enumerate() {
            let bound = ONCE * (w.abs() + largest) + 1e-5 * largest;
            assert!((g - w).abs() <= bound, "{s:?}: attention out[{i}]: got {g}, want {w}");
        }
        let stats_h = dev.download(&stats).unwrap();
        assert_close_to_largest(&stats_h, &want_stats, 1e-5, &format!("{s:?}: attention stats"));
        // Where a warp owns two tiles of rows, the kernel with one a warp gives the same bits:
        // each row meets the same key tiles (of 64, which start at multiples of 64 as the
        // warps' rows start at multiples of 32) and sums them in the same order.
        if s.head_dim <= 64 {
            let (out16, stats16) = attention::forward_with(dev, &up(dev, &qkv), s, 16).unwrap();
            assert!(down(dev, &out16) == down(dev, &out), "{s:?}: 16 rows a warp, out");
            assert!(dev.download(&stats16).unwrap() == stats_h, "{s:?}: 16 rows a warp, stats");
        }
        // Backward, from the forward's own output and statistics: its products take the
        // probabilities and their gradients rounded to bf16, and it reads the forward's rounded
        // output, so each value is held to 2^-6 of the largest.
        let dout = values(s.batch * s.seq * s.out_width(), 16, 1.0);
        let mut want_dqkv = vec![0.0f32; qkv.len()];
        crate::kernels::attention::backward(&mut want_dqkv, &dout, &qkv, &want_stats, s);
        let dqkv = attention::backward(dev, &up(dev, &dout), &up(dev, &qkv), &out, &stats, s);
        let got = down(dev, &dqkv.unwrap());
        assert_close_to_largest(&got, &want_dqkv, 1.0 / 64.0, &format!("{s:?}: attention dqkv"));
    }

    // The depth attention's two phases: a block of 3 consumers over 4 sources, the later two
    // reading a partial sum that phase 2 makes, and its input's norm.
    let (c, consumers) = (4, 3);
    let srcs = values(c * rows * d, 10, 2.0);
    let ws = rand_vec(consumers * d, 11, 0.2);
    let mut rs = vec![0.0f32; c * rows];
    crate::kernels::rmsnorm::rstd(&mut rs, &srcs, d, 1e-6);
    let mut p1 = crate::kernels::depth::Phase1::default();
    crate::kernels::depth::phase1(&mut p1, &srcs, &rs, &ws, rows, d);
    let (sd, rd, wd) = (up(dev, &srcs), dev.upload(&rs).unwrap(), dev.upload(&ws).unwrap());
    let g1 = depth::phase1(dev, sd.all(), rd.all(), wd.all(), rows, d).unwrap();
    // Consumer j > 0's partial sum is the previous output, plus (j = 2) the sum before it,
    // which the kernel stores rounded to bf16 and reads back.
    let (out, prev) = (values(rows * d, 12, 1.5), values(rows * d, 13, 1.0));
    let (out_d, prev_d) = (up(dev, &out), up(dev, &prev));
    for j in 0..consumers {
        let w = &ws[j * d..(j + 1) * d];
        let sum: Vec<f32> = match j {
            2 => out.iter().zip(&prev).map(|(a, b)| Bf16::from_f32(a + b).to_f32()).collect(),
            _ => out.clone(),
        };
        let mut pr = vec![0.0f32; rows];
        crate::kernels::rmsnorm::rstd(&mut pr, &sum, d, 1e-6);
        // Phase 1's mix alone (the input of a consumer without a partial sum), then merged.
        let o1 = crate::kernels::depth::phase2(None, &mut p1, j, None, w, d);
        crate::kernels::depth::phase1(&mut p1, &srcs, &rs, &ws, rows, d);
        let read = (j > 0).then_some((sum.as_slice(), pr.as_slice()));
        let want = crate::kernels::depth::phase2(None, &mut p1, j, read, w, d);
        crate::kernels::depth::phase1(&mut p1, &srcs, &rs, &ws, rows, d);
        let (mut sum_d, mut pr_d) = (dev.copy(&out_d).unwrap(), dev.zeros(rows).unwrap());
        let update = (j > 0).then(|| depth::PartialSum {
            sum: &mut sum_d,
            rstd: &mut pr_d,
            prev: (j == 2).then(|| prev_d.all()),
        });
        let wj = wd.slice(j * d..(j + 1) * d);
        let got = depth::input(dev, &g1, j, update, wj, gd.all(), d, 1e-6).unwrap();
        let h = down(dev, &got.h);
        let largest = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (i, (g, w)) in h.iter().zip(&want).enumerate() {
            let bound = ONCE * (w.abs() + o1[i].abs()) + 1e-5 * largest;
            assert!((g - w).abs() <= bound, "depth h of {j}[{i}]: got {g}, want {w}");
        }
        if j > 0 {
            assert_eq!(down(dev, &sum_d), sum, "partial sum of {j}");
            let pr_got = dev.download(&pr_d).unwrap();
            assert_close_to_largest(&pr_got, &pr, 1e-5, &format!("partial rstd of {j}"));
        }
        // The norm the sublayer takes, of the rounded h the kernel stored.
        let (want_xn, want_r) = crate::kernels::rmsnorm::forward(&h, &g, d, 1e-6);
        within(&down(dev, &got.xn), &want_xn, ONCE, &format!("depth xn of {j}"));
        let r = dev.download(&got.rstd).unwrap();
        assert_close_to_largest(&r, &want_r, 1e-5, &format!("depth rstd of {j}"));
    }
}
crate::gpu::on_cpu_and_gpu!(bf16_kernels_match_the_cpu);

/// The bf16 rounding the kernels do (`from_f32<bf16>` in reduce.cuh) is the host's, ties to
/// even, on values that are halfway between two bf16 values and on the edges.
fn bf16_rounds_as_the_host(dev: &Device) {
    let mut x: Vec<f32> = vec![0.0, -0.0, 1.0, f32::MAX, f32::MIN_POSITIVE, 1e-40, f32::INFINITY];
    // Halfway cases: the 16 dropped bits 0x8000, with an even and an odd kept bit.
    x.extend(
        [0x3f80_8000u32, 0x3f81_8000, 0xbf80_8000, 0x3f80_7fff, 0x3f80_8001].map(f32::from_bits),
    );
    x.extend(rand_vec(1000, 13, 100.0));
    let want: Vec<u16> = x.iter().map(|&v| Bf16::from_f32(v).0).collect();
    let xd = dev.upload(&x).unwrap();
    let got: Vec<u16> =
        dev.download(&Bf16::narrow(dev, xd).unwrap()).unwrap().iter().map(|b| b.0).collect();
    assert_eq!(got, want);
}
crate::gpu::on_cpu_and_gpu!(bf16_rounds_as_the_host);

/// The tensor cores' product against the same product through warp shuffles (the emulator's)
/// and against the CPU: the fragments' layout as the kernels read and write them.
fn the_tensor_cores_multiply_as_emulated(dev: &Device) {
    let (a, b) = (values(16 * 16, 14, 1.0), values(16 * 8, 15, 1.0));
    let mut want = vec![0.0f32; 16 * 8];
    for i in 0..16 {
        for j in 0..8 {
            want[i * 8 + j] = (0..16).map(|k| a[i * 16 + k] * b[k * 8 + j]).sum();
        }
    }
    let (mut tensor, mut shuffled) = (dev.zeros(16 * 8).unwrap(), dev.zeros(16 * 8).unwrap());
    let (ad, bd) = (up(dev, &a), up(dev, &b));
    let args = [tensor.arg_mut(), shuffled.arg_mut(), ad.arg(), bd.arg()];
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the kernel's arguments in its order; one warp reads 16 x 16 and 16 x 8 values and
    // writes 16 x 8 twice.
    unsafe { dev.launch("mma_check", cfg, &args) }.unwrap();
    let tensor = dev.download(&tensor).unwrap();
    assert_close_to_largest(&tensor, &want, 1e-5, "tensor cores");
    assert_close_to_largest(&dev.download(&shuffled).unwrap(), &tensor, 1e-5, "shuffled");
}
crate::gpu::on_cpu_and_gpu!(the_tensor_cores_multiply_as_emulated);

/// The fragments the tensor-core attention loads from shared memory (through ldmatrix on a
/// GPU, word by word in the emulator) against mma.m16n8k16's layout, written out here: lane
/// (g, q) holds of B (k x n) column g at rows 2q, 2q + 1 and 2q + 8, 2q + 9, and of A rows g and
/// g + 8 at columns 2q, 2q + 1 and 2q + 8, 2q + 9, the lower index in the low half.
fn the_fragments_load_as_emulated(dev: &Device) {
    // Distinct bits everywhere, so that any value in the wrong place shows.
    let tile: Vec<Bf16> = (0..16 * 32).map(|i| Bf16(0x3f00 + i as u16)).collect();
    let at = |r: usize, c: usize| tile[r * 32 + c].0 as u32;
    let pair = |(r0, c0): (usize, usize), (r1, c1): (usize, usize)| at(r0, c0) | at(r1, c1) << 16;
    let mut want = Vec::new();
    for lane in 0..32 {
        let (g, q) = (lane / 4, lane % 4);
        // Keys as n (tile rows 0.., then 8..), head columns 16..31 as k.
        for i in 0..4 {
            let (row, col) = (8 * (i / 2) + g, 16 + 8 * (i % 2) + 2 * q);
            want.push(pair((row, col), (row, col + 1)));
        }
        // Tile rows as k, head columns 16.. then 24.. as n.
        for i in 0..4 {
            let (row, col) = (8 * (i % 2) + 2 * q, 16 + 8 * (i / 2) + g);
            want.push(pair((row, col), (row + 1, col)));
        }
        // Tile rows as A's rows, head columns 16..31 as its columns.
        for i in 0..4 {
            let (row, col) = (8 * (i % 2) + g, 16 + 8 * (i / 2) + 2 * q);
            want.push(pair((row, col), (row, col + 1)));
        }
    }
    let tile_d = dev.upload(&tile).unwrap();
    let mut out = dev.output::<u32>(32 * 12).unwrap();
    let args = [out.arg_mut(), tile_d.arg()];
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the kernel's arguments in its order; one warp reads 16 x 32 values and writes 12
    // words a lane.
    unsafe { dev.launch("fragment_check", cfg, &args) }.unwrap();
    assert_eq!(dev.download(&out).unwrap(), want);
}
crate::gpu::on_cpu_and_gpu!(the_fragments_load_as_emulated);
