//! Causal attention on the GPU (`kernels/attention.cu`): what `crate::kernels::attention`
//! computes on the CPU, with the same buffers (the packed `qkv`, the `[B, H, T, 2]` softmax
//! statistics), in memory that grows with T.

use super::act::{kernel, Act};
use super::blas::DType;
use super::buffer::{Arg, Buf};
use super::device::Device;
use super::per_value;
use crate::kernels::attention::AttnShape;
use anyhow::{bail, ensure, Result};
use cudarc::driver::LaunchConfig;

/// Rows per block and rows per shared tile, as the kernels define them (ROWS, TILE).
const ROWS: usize = 64;
const TILE: usize = 32;
/// The longest head the kernels hold (MAX_HD).
const MAX_HEAD_DIM: usize = 128;

fn check<A: Act>(s: AttnShape, qkv: &Buf<A>) -> Result<()> {
    ensure!(
        s.head_dim <= MAX_HEAD_DIM,
        "the GPU's attention takes heads of up to {MAX_HEAD_DIM} values, not {}",
        s.head_dim
    );
    assert!(s.kv_heads > 0 && s.heads.is_multiple_of(s.kv_heads));
    // Sequences-by-heads are the launches' grid y.
    ensure!(
        s.batch * s.heads <= 65_535,
        "the GPU's attention takes at most 65,535 sequences x heads at once, not {} x {}",
        s.batch,
        s.heads
    );
    assert!(s.seq <= i32::MAX as usize);
    assert_eq!(qkv.len(), s.batch * s.seq * s.qkv_width());
    Ok(())
}

/// Blocks of ROWS rows over `y` sequences-by-heads; `shared` floats of dynamic shared memory.
fn blocks(s: AttnShape, y: usize, shared: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (s.seq.div_ceil(ROWS) as u32, y as u32, 1),
        block_dim: (ROWS as u32, 1, 1),
        shared_mem_bytes: (shared * size_of::<f32>()) as u32,
    }
}

/// The arguments every attention kernel ends with.
fn shape_args(s: AttnShape) -> [Arg; 5] {
    [
        Arg::i32(s.seq as i32),
        Arg::i32(s.heads as i32),
        Arg::i32(s.kv_heads as i32),
        Arg::i32(s.head_dim as i32),
        Arg::f32(1.0 / (s.head_dim as f32).sqrt()),
    ]
}

/// Warps per block of the tensor-core kernels (`FLASH_WARPS` in `kernels/flash.cu`), and the
/// rows each owns in backward.
const FLASH_WARPS: usize = 4;
const BACKWARD_WARP_ROWS: usize = 16;

/// The head sizes the tensor-core kernels are instantiated for (`NAME_hdN` in
/// `kernels/flash.cu`): each is compiled with its loops unrolled, so that the fragments stay in
/// registers.
const FLASH_HEADS: [usize; 5] = [16, 32, 64, 96, 128];

/// Whether attention runs on the tensor cores: in bf16, with heads of a size in [`FLASH_HEADS`].
pub(crate) fn on_tensor_cores<A: Act>(s: AttnShape) -> bool {
    A::TYPE == DType::Bf16 && FLASH_HEADS.contains(&s.head_dim)
}

/// The tensor-core kernel `name` for the shape's head size.
fn flash(name: &str, s: AttnShape) -> String {
    format!("{name}_hd{}", s.head_dim)
}

/// The tensor-core kernels' launch: blocks of FLASH_WARPS warps, each owning `warp_rows` rows,
/// over `y` sequences-by-heads.
fn flash_blocks(s: AttnShape, y: usize, warp_rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (s.seq.div_ceil(FLASH_WARPS * warp_rows) as u32, y as u32, 1),
        block_dim: (32 * FLASH_WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Query rows a warp owns in the tensor-core forward (`ForwardTiles` in `kernels/flash.cu`):
/// two tiles of 16 for heads of up to 64 values, one for longer heads.
fn forward_warp_rows(head_dim: usize) -> usize {
    if head_dim <= 64 {
        32
    } else {
        16
    }
}

/// The forward's rows a warp as `ATTNRES_FLASH_WARP_ROWS` sets them (`set`): unset, the
/// kernels' choice ([`forward_warp_rows`]); `16`, one tile of 16 for every head (the `_warp16`
/// kernels), to measure the two against each other.
fn warp_rows_from(set: Option<&str>, head_dim: usize) -> Result<usize> {
    match set {
        None => Ok(forward_warp_rows(head_dim)),
        Some("16") => Ok(16),
        Some(v) => bail!("ATTNRES_FLASH_WARP_ROWS is 16 or unset, not {v:?}"),
    }
}

/// Forward: `out[B·T, H·hd]` and the statistics `[B, H, T, 2]`; on the tensor cores
/// (`kernels/flash.cu`) where [`on_tensor_cores`].
pub fn forward<A: Act>(dev: &Device, qkv: &Buf<A>, s: AttnShape) -> Result<(Buf<A>, Buf<f32>)> {
    let set = std::env::var_os("ATTNRES_FLASH_WARP_ROWS");
    let warp_rows =
        warp_rows_from(set.as_ref().map(|v| v.to_string_lossy()).as_deref(), s.head_dim)?;
    forward_with(dev, qkv, s, warp_rows)
}

/// [`forward`], on the tensor cores with `warp_rows` query rows a warp (16, or
/// [`forward_warp_rows`]).
pub(super) fn forward_with<A: Act>(
    dev: &Device,
    qkv: &Buf<A>,
    s: AttnShape,
    warp_rows: usize,
) -> Result<(Buf<A>, Buf<f32>)> {
    check(s, qkv)?;
    let (mut out, mut stats) =
        (dev.output(s.batch * s.seq * s.out_width())?, dev.output(s.stats_len())?);
    if on_tensor_cores::<A>(s) {
        let mut args = vec![out.arg_mut(), stats.arg_mut(), qkv.arg()];
        args.extend(shape_args(s));
        let mut name = flash("flash_forward_bf16", s);
        if warp_rows != forward_warp_rows(s.head_dim) {
            assert_eq!(warp_rows, 16, "the forward's kernels take 16 rows a warp or their own");
            name += "_warp16";
        }
        let cfg = flash_blocks(s, s.batch * s.heads, warp_rows);
        // SAFETY: the kernel's arguments in its order; `out`, `stats` and `qkv` hold the
        // shape's values (checked), and the kernel is the one for its head size and rows.
        unsafe { dev.launch(&name, cfg, &args) }?;
        return Ok((out, stats));
    }
    let mut args = vec![out.arg_mut(), stats.arg_mut(), qkv.arg()];
    args.extend(shape_args(s));
    let cfg = blocks(s, s.batch * s.heads, 2 * TILE * s.head_dim);
    // SAFETY: the kernel's arguments in its order; `out`, `stats` and `qkv` hold the shape's
    // values (checked), and the shared memory two tiles of keys and values.
    unsafe { dev.launch(&kernel::<A>("attention_forward"), cfg, &args) }?;
    Ok((out, stats))
}

/// Backward: `dqkv` (every column written) from `dout`, with what forward returned.
pub fn backward<A: Act>(
    dev: &Device,
    dout: &Buf<A>,
    qkv: &Buf<A>,
    out: &Buf<A>,
    stats: &Buf<f32>,
    s: AttnShape,
) -> Result<Buf<A>> {
    check(s, qkv)?;
    let rows = s.batch * s.seq;
    assert!(dout.len() == rows * s.out_width() && out.len() == dout.len());
    assert_eq!(stats.len(), s.stats_len());
    let mut delta = dev.output::<f32>(rows * s.heads)?;
    let args = [
        delta.arg_mut(),
        dout.arg(),
        out.arg(),
        Arg::i64(rows),
        Arg::i32(s.seq as i32),
        Arg::i32(s.heads as i32),
        Arg::i32(s.head_dim as i32),
    ];
    // SAFETY: the kernel's arguments in its order; one thread per row and head.
    unsafe {
        dev.launch(&kernel::<A>("attention_backward_delta"), per_value(rows * s.heads), &args)
    }?;
    let mut dqkv = dev.output(qkv.len())?;
    let mut args = vec![dqkv.arg_mut(), dout.arg(), qkv.arg(), stats.arg(), delta.arg()];
    args.extend(shape_args(s));
    let hd = s.head_dim;
    if on_tensor_cores::<A>(s) {
        // SAFETY: as in `forward`; each kernel writes its own columns of `dqkv`.
        unsafe {
            let (dq, dkv) =
                (flash("flash_backward_dq_bf16", s), flash("flash_backward_dkv_bf16", s));
            let rows = BACKWARD_WARP_ROWS;
            dev.launch(&dq, flash_blocks(s, s.batch * s.heads, rows), &args)?;
            dev.launch(&dkv, flash_blocks(s, s.batch * s.kv_heads, rows), &args)?;
        }
        return Ok(dqkv);
    }
    // SAFETY: as in `forward`; each kernel writes its own columns of `dqkv`.
    unsafe {
        dev.launch(
            &kernel::<A>("attention_backward_dq"),
            blocks(s, s.batch * s.heads, 2 * TILE * hd),
            &args,
        )?;
        let cfg = blocks(s, s.batch * s.kv_heads, 2 * TILE * hd + 3 * TILE);
        dev.launch(&kernel::<A>("attention_backward_dkv"), cfg, &args)?;
    }
    Ok(dqkv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::attention as cpu;
    use crate::testutil::{assert_close_to_largest, rand_vec};

    /// Grouped and plain heads, sequences that end mid-tile and span several blocks.
    fn attention_matches_the_cpu_kernel(dev: &Device) {
        let shapes = [
            AttnShape { batch: 2, seq: 37, heads: 4, kv_heads: 2, head_dim: 16 },
            AttnShape { batch: 1, seq: 150, heads: 2, kv_heads: 2, head_dim: 64 },
            AttnShape { batch: 1, seq: 70, heads: 3, kv_heads: 1, head_dim: 128 },
        ];
        for s in shapes {
            let qkv = rand_vec(s.batch * s.seq * s.qkv_width(), 1, 2.0);
            let dout = rand_vec(s.batch * s.seq * s.out_width(), 2, 1.0);
            let (want_out, want_stats) = cpu::forward(&qkv, s);
            let mut want_dqkv = vec![0.0f32; qkv.len()];
            cpu::backward(&mut want_dqkv, &dout, &qkv, &want_stats, s);

            let (qkv_d, dout_d) = (dev.upload(&qkv).unwrap(), dev.upload(&dout).unwrap());
            let (out, stats) = forward(dev, &qkv_d, s).unwrap();
            let dqkv = backward(dev, &dout_d, &qkv_d, &out, &stats, s).unwrap();
            let at = format!("{s:?}");
            for (name, got, want) in [
                ("out", dev.download(&out).unwrap(), want_out),
                ("stats", dev.download(&stats).unwrap(), want_stats),
                ("dqkv", dev.download(&dqkv).unwrap(), want_dqkv),
            ] {
                assert_close_to_largest(&got, &want, 1e-5, &format!("{at}: {name}"));
            }
        }
    }
    crate::gpu::on_cpu_and_gpu!(attention_matches_the_cpu_kernel);

    #[test]
    fn the_forward_takes_its_rows_a_warp_from_the_environment() {
        assert_eq!(warp_rows_from(None, 64).unwrap(), 32);
        assert_eq!(warp_rows_from(None, 128).unwrap(), 16);
        assert_eq!(warp_rows_from(Some("16"), 64).unwrap(), 16);
        let e = warp_rows_from(Some("32"), 128).unwrap_err().to_string();
        assert!(e.contains("ATTNRES_FLASH_WARP_ROWS") && e.contains("\"32\""), "{e}");
    }
}
