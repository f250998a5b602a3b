//! Softmax cross-entropy fused with its gradient on the GPU (`kernels/cross_entropy.cu`): what
//! `crate::kernels::cross_entropy` computes on the CPU.

use super::act::{kernel, Act};

use super::buffer::{Arg, Buf};

use super::device::{Device, Ids};
use super::per_row;
use anyhow::Result;

/// The mean loss of `logits[rows, V]` against `targets`.
pub fn loss<A: Act>(dev: &Device, logits: &Buf<A>, targets: &Ids, v: usize) -> Result<f32> {
    run::<A>(dev, None, logits.arg(), logits.len(), targets, v)
}

/// The mean loss of `logits[rows, V]` against `targets`, and the gradient
/// `(softmax − onehot) / rows` written over the logits: the largest buffer of a step is not
/// held twice.
pub fn loss_and_grad<A: Act>(
    dev: &Device,
    mut logits: Buf<A>,
    targets: &Ids,
    v: usize,
) -> Result<(f32, Buf<A>)> {
    let (arg, len) = (logits.arg_mut(), logits.len());
    let loss = run::<A>(dev, Some(arg), arg, len, targets, v)?;
    Ok((loss, logits))
}

/// The kernel over `len` logits at `logits`, its gradient to `dlogits` where asked for.
fn run<A: Act>(
    dev: &Device,
    dlogits: Option<Arg>,
    logits: Arg,
    len: usize,
    targets: &Ids,
    v: usize,
) -> Result<f32> {
    let rows = targets.len();
    assert!(len == rows * v && v <= i32::MAX as usize && rows > 0);
    assert!(targets.below <= v, "targets checked against a larger vocabulary");
    let mut row_loss = dev.output(rows)?;
    let inv = 1.0 / rows as f32;
    let args = [
        dlogits.unwrap_or(Arg::null()),
        row_loss.arg_mut(),
        logits,
        targets.buf.arg(),
        Arg::i32(v as i32),
        Arg::f32(inv),
    ];
    // SAFETY: the kernel's arguments in its order (a null pointer where no gradient is asked
    // for, which the kernel checks; the gradient may be the logits themselves, which the
    // kernel allows); one block per row, every target inside its row.
    unsafe { dev.launch(&kernel::<A>("cross_entropy"), per_row(rows, v), &args) }?;
    let total: f32 = dev.download(&row_loss)?.iter().sum();
    Ok(total * inv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cross_entropy as cpu;
    use crate::testutil::{assert_close_to_largest, rand_vec};

    fn cross_entropy_matches_the_cpu_kernel(dev: &Device) {
        // A vocabulary of 1001 ends each row in part of a chunk.
        for (rows, v) in [(19, 49152), (5, 1001)] {
            check(dev, rows, v);
        }
    }

    fn check(dev: &Device, rows: usize, v: usize) {
        let logits = rand_vec(rows * v, 7, 8.0);
        let targets: Vec<u32> = (0..rows as u32).map(|r| r * 2711 % v as u32).collect();
        let (want_loss, want_grad) = cpu::loss_and_grad(&logits, &targets, v);
        let logits_dev = dev.upload(&logits).unwrap();
        let targets = Ids::upload(dev, &targets, v).unwrap();
        let no_grad_loss = loss(dev, &logits_dev, &targets, v).unwrap();
        let (got_loss, grad) = loss_and_grad(dev, logits_dev, &targets, v).unwrap();
        assert!(
            (got_loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
            "{got_loss} vs {want_loss}"
        );
        let grad = dev.download(&grad).unwrap();
        assert_close_to_largest(&grad, &want_grad, 1e-5, "dlogits");
        assert_eq!(no_grad_loss, got_loss);
    }
    crate::gpu::on_cpu_and_gpu!(cross_entropy_matches_the_cpu_kernel);
}
