use attnres::kernels::matmul::{matmul, threads};
use std::time::Instant;
fn main() {
    let n = 2048;
    for (din, dout) in [(256, 768), (256, 256), (256, 1408), (704, 256), (256, 4096)] {
        let x = vec![0.1f32; n * din];
        let w = vec![0.2f32; dout * din];
        let dy = vec![0.3f32; n * dout];
        let mut y = vec![0.0f32; n * dout];
        let mut dx = vec![0.0f32; n * din];
        let mut dw = vec![0.0f32; dout * din];
        let fl = 2.0 * (n * din * dout) as f64;
        let time = |f: &mut dyn FnMut()| { f(); let mut b = 1e9f64; for _ in 0..10 { let t = Instant::now(); f(); b = b.min(t.elapsed().as_secs_f64()); } fl / b / 1e9 };
        let a = time(&mut || matmul(&mut y, &x, false, &w, true, n, din, dout, false, threads()));
        let b = time(&mut || matmul(&mut dx, &dy, false, &w, false, n, dout, din, false, threads()));
        let c = time(&mut || matmul(&mut dw, &dy, true, &x, false, dout, n, din, true, threads()));
        // alternative for dW: compute dWᵀ = Xᵀ·dY  into [din, dout] layout then... (just measure)
        let mut dwt = vec![0.0f32; din * dout];
        let d = time(&mut || matmul(&mut dwt, &x, true, &dy, false, din, n, dout, true, threads()));
        println!("in {din:4} out {dout:4}: fwd {a:6.1}  dX {b:6.1}  dW {c:6.1}  dWt {d:6.1} GFLOP/s");
    }
}
