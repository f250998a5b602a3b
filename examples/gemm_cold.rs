use attnres::kernels::matmul::{matmul, threads};
use std::time::Instant;
fn main() {
    let n = 2048;
    let (din, dout) = (256, 1408);
    let reps = 20;
    let xs: Vec<Vec<f32>> = (0..reps).map(|_| vec![0.1f32; n * din]).collect();
    let w = vec![0.2f32; dout * din];
    let mut ys: Vec<Vec<f32>> = (0..reps).map(|_| vec![0.0f32; n * dout]).collect();
    let fl = 2.0 * (n * din * dout) as f64;
    for round in 0..3 {
        let t = Instant::now();
        for i in 0..reps {
            matmul(&mut ys[i], &xs[i], false, &w, true, n, din, dout, false, threads());
        }
        let cold = fl * reps as f64 / t.elapsed().as_secs_f64() / 1e9;
        let t = Instant::now();
        for _ in 0..reps {
            matmul(&mut ys[0], &xs[0], false, &w, true, n, din, dout, false, threads());
        }
        let warm = fl * reps as f64 / t.elapsed().as_secs_f64() / 1e9;
        println!("round {round}: distinct buffers {cold:.0} GFLOP/s, same buffers {warm:.0} GFLOP/s");
    }
}
