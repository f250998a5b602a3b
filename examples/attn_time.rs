use attnres::kernels::attention::{self, AttnShape};
use std::time::Instant;
fn main() {
    let s = AttnShape { batch: 8, seq: 256, heads: 4, kv_heads: 4, head_dim: 64 };
    let qkv: Vec<f32> = (0..s.batch * s.seq * s.qkv_width()).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    let mut out = vec![0.0; s.batch * s.seq * s.out_width()];
    let mut p = vec![0.0; s.probs_len()];
    let mut d = vec![0.0; qkv.len()];
    for _ in 0..3 {
        let t = Instant::now();
        attention::forward(&mut out, &mut p, &qkv, s);
        let f = t.elapsed().as_secs_f64();
        let t = Instant::now();
        attention::backward(&mut d, &out, &qkv, &p, s);
        println!("fwd {:.1} ms bwd {:.1} ms", f * 1e3, t.elapsed().as_secs_f64() * 1e3);
    }
}
