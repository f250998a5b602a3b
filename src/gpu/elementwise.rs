//! The GPU's elementwise operations (`kernels/swiglu.cu`, `kernels/embedding.cu`): what
//! `crate::kernels::swiglu` and `crate::kernels::embedding` compute on the CPU, with the same
//! buffers.

use super::act::{kernel, Act};

use super::buffer::{Arg, Buf, Slice, SliceMut};

use super::device::{Device, Ids};
use super::{per_value, ROW_CHUNK};
use anyhow::Result;
use cudarc::driver::LaunchConfig;

/// SwiGLU forward: `act[rows, F]` from the fused `gu[rows, 2F]`.
pub fn swiglu_forward<A: Act>(dev: &Device, gu: &Buf<A>, f: usize) -> Result<Buf<A>> {
    let rows = gu.len() / (2 * f);
    assert!(rows * 2 * f == gu.len() && f <= i32::MAX as usize);
    let mut act = dev.output(rows * f)?;
    let args = [act.arg_mut(), gu.arg(), Arg::i64(rows), Arg::i32(f as i32)];
    // SAFETY: the kernel's arguments in its order; `act` holds rows·F values, `gu` rows·2F.
    unsafe {
        dev.launch(&kernel::<A>("swiglu_forward"), per_value(rows * f.div_ceil(ROW_CHUNK)), &args)
    }?;
    Ok(act)
}

/// SwiGLU backward: `dgu[rows, 2F]` from `dact[rows, F]`.
pub fn swiglu_backward<A: Act>(
    dev: &Device,
    dact: &Buf<A>,
    gu: &Buf<A>,
    f: usize,
) -> Result<Buf<A>> {
    let rows = gu.len() / (2 * f);
    assert!(rows * 2 * f == gu.len() && dact.len() == rows * f && f <= i32::MAX as usize);
    let mut dgu = dev.output(gu.len())?;
    let args = [dgu.arg_mut(), dact.arg(), gu.arg(), Arg::i64(rows), Arg::i32(f as i32)];
    // SAFETY: as in `swiglu_forward`.
    unsafe {
        dev.launch(&kernel::<A>("swiglu_backward"), per_value(rows * f.div_ceil(ROW_CHUNK)), &args)
    }?;
    Ok(dgu)
}

/// Embedding forward: `out[tokens, d]`, row `t` the table's row `ids[t]`.
pub fn embedding_forward<A: Act>(
    dev: &Device,
    table: Slice<f32>,
    ids: &Ids,
    d: usize,
) -> Result<Buf<A>> {
    assert!(ids.below * d <= table.len() && d <= i32::MAX as usize);
    let mut out = dev.output(ids.len() * d)?;
    let args = [out.arg_mut(), table.arg(), ids.buf.arg(), Arg::i64(ids.len()), Arg::i32(d as i32)];
    // SAFETY: the kernel's arguments in its order; every id indexes a row of `table` (checked
    // when the ids were uploaded, against a vocabulary the table holds).
    unsafe { dev.launch(&kernel::<A>("embedding_forward"), per_value(ids.len() * d), &args) }?;
    Ok(out)
}

/// The tokens grouped by id, for the embedding's backward: `order` holds the token positions of
/// each id that occurs in token order, `rows[g]`'s from `starts[g]` to `starts[g + 1]`.
fn tokens_by_id(ids: &[u32]) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut order: Vec<u32> = (0..ids.len() as u32).collect();
    // A stable sort: each id's tokens stay in order.
    order.sort_by_key(|&t| ids[t as usize]);
    let (mut starts, mut rows) = (Vec::new(), Vec::new());
    for (i, &t) in order.iter().enumerate() {
        let id = ids[t as usize];
        if rows.last() != Some(&id) {
            rows.push(id);
            starts.push(i as u32);
        }
    }
    starts.push(order.len() as u32);
    (order, starts, rows)
}

/// Embedding backward: `dtable[ids[t]] += dout[t]` for `t` in order, as the CPU adds them (the
/// same bits in f32).
pub fn embedding_backward<A: Act>(
    dev: &Device,
    dtable: &mut SliceMut<f32>,
    dout: &Buf<A>,
    ids: &Ids,
    d: usize,
) -> Result<()> {
    assert!(ids.below * d <= dtable.len() && dout.len() == ids.len() * d);
    assert!(ids.len() <= u32::MAX as usize && d <= i32::MAX as usize);
    let (order, starts, rows) = tokens_by_id(&ids.host);
    if rows.is_empty() {
        return Ok(());
    }
    let (order_d, starts_d, rows_d) =
        (dev.upload(&order)?, dev.upload(&starts)?, dev.upload(&rows)?);
    let args = [
        dtable.arg_mut(),
        dout.arg(),
        order_d.arg(),
        starts_d.arg(),
        rows_d.arg(),
        Arg::i32(d as i32),
    ];
    let threads = d.next_multiple_of(32).min(256) as u32;
    let cfg = LaunchConfig {
        grid_dim: (rows.len() as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the kernel's arguments in its order; every id indexes a row of `dtable` (checked
    // when the ids were uploaded), `order` holds positions of `dout`'s rows and `starts` a
    // bound into it per block, and one more.
    unsafe { dev.launch(&kernel::<A>("embedding_backward"), cfg, &args) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{embedding, swiglu};
    use crate::testutil::{assert_close_to_largest, rand_vec};

    /// F = 203: each row's last chunk is short, and most rows start unaligned.
    fn swiglu_matches_the_cpu_kernel(dev: &Device) {
        for (rows, f) in [(37, 1000), (5, 203)] {
            check_swiglu(dev, rows, f);
        }
    }

    fn check_swiglu(dev: &Device, rows: usize, f: usize) {
        let gu = rand_vec(rows * 2 * f, 1, 4.0);
        let dact = rand_vec(rows * f, 2, 1.0);
        let want_act = swiglu::forward(&gu, f);
        let mut want_dgu = vec![0.0f32; gu.len()];
        swiglu::backward(&mut want_dgu, &dact, &gu, f);
        let (gu_d, dact_d) = (dev.upload(&gu).unwrap(), dev.upload(&dact).unwrap());
        let act = dev.download(&swiglu_forward(dev, &gu_d, f).unwrap()).unwrap();
        let dgu = dev.download(&swiglu_backward(dev, &dact_d, &gu_d, f).unwrap()).unwrap();
        for (name, got, want) in [("act", act, want_act), ("dgu", dgu, want_dgu)] {
            assert_close_to_largest(&got, &want, 1e-5, name);
        }
    }
    crate::gpu::on_cpu_and_gpu!(swiglu_matches_the_cpu_kernel);

    /// Repeated ids included, so that the gradient's sums meet: in the CPU's order, to the bit.
    fn embedding_matches_the_cpu_kernel(dev: &Device) {
        let (vocab, d) = (50, 96);
        let ids: Vec<u32> = (0..300u32).map(|t| (t * 7 + t / 3) % vocab as u32).collect();
        let table = rand_vec(vocab * d, 3, 1.0);
        let dout = rand_vec(ids.len() * d, 4, 1.0);
        let mut want_out = vec![0.0f32; ids.len() * d];
        embedding::forward(&mut want_out, &table, &ids, d);
        let mut want_dtable = vec![0.5f32; vocab * d];
        embedding::backward(&mut want_dtable, &dout, &ids, d);
        let (table_d, dout_d) = (dev.upload(&table).unwrap(), dev.upload(&dout).unwrap());
        let ids_d = Ids::upload(dev, &ids, vocab).unwrap();
        let out = dev
            .download(&embedding_forward::<f32>(dev, table_d.all(), &ids_d, d).unwrap())
            .unwrap();
        assert_eq!(out, want_out, "a gather is exact");
        let mut dtable = dev.upload(&vec![0.5f32; vocab * d]).unwrap();
        embedding_backward(dev, &mut dtable.all_mut(), &dout_d, &ids_d, d).unwrap();
        let dtable = dev.download(&dtable).unwrap();
        assert!(dtable == want_dtable, "dtable: not the CPU's bits");
    }
    crate::gpu::on_cpu_and_gpu!(embedding_matches_the_cpu_kernel);
}
