//! The searches ggml's K-quant reference quantisers (`quantize_row_q{4,5,6}_K_ref`) run for each
//! sub-block's scale (and minimum), written as they compute them: the same f32 operations in
//! the same order, so that the blocks come out as llama.cpp's quantizer writes them.

/// ggml's `GROUP_MAX_EPS`: a sub-block whose largest magnitude is below it is all zeros.
pub const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `nearest_int`: `x` rounded to the nearest integer, ties to even, by adding 1.5·2^23
/// and reading the low mantissa bits (`|x|` at most 2^22).
pub fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// ggml's `make_qkx2_quants` (without the absolute-error option): levels `l[i]` in `0..=nmax`
/// with a scale and a minimum such that `x[i] ≈ scale · l[i] − min`, searched over `nstep + 1`
/// scales around `nmax / (max − min)` for the least `weights`-weighted squared error. Returns
/// `(scale, min)`.
pub fn scale_and_min(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    (rmin, rdelta, nstep): (f32, f32, i32),
) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        min = if x[i] < min { x[i] } else { min };
        max = if x[i] > max { x[i] } else { max };
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let level = |iscale: f32, x: f32, min: f32| nearest_int(iscale * (x - min)).clamp(0, nmax);
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        l[i] = level(iscale, x[i], min) as u8;
        let diff = scale * l[i] as f32 + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    let mut aux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let li = level(iscale, x[i], min);
            aux[i] = li as u8;
            let (w, lf) = (weights[i], li as f32);
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                error += weights[i] * (diff * diff);
            }
            if error < best_error {
                l[..n].copy_from_slice(&aux[..n]);
                (best_error, scale, min) = (error, this_scale, this_min);
            }
        }
    }
    (scale, -min)
}

/// ggml's `make_qx_quants` with weights `x²` (`rmse_type` 1): signed levels `l[i] + nmax` in
/// `0..2·nmax` with a scale such that `x[i] ≈ scale · l[i]`, searched over 19 scales around
/// `−nmax / max` (max the value of largest magnitude). Returns the scale.
pub fn scale_signed(nmax: i32, x: &[f32], l: &mut [u8]) -> f32 {
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            (amax, max) = (v.abs(), v);
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, x: f32| nearest_int(iscale * x).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let (w, lf) = (v * v, level(iscale, v) as f32);
            sumlx += w * v * lf;
            suml2 += w * lf * lf;
        }
        (sumlx, suml2)
    };
    let mut iscale = -(nmax as f32) / max;
    for (l, &v) in l.iter_mut().zip(x) {
        *l = (level(iscale, v) + nmax) as u8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (l, &v) in l.iter_mut().zip(x) {
                *l = (level(iscale, v) + nmax) as u8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        for (x, want) in
            [(0.5, 0), (1.5, 2), (2.5, 2), (-0.5, 0), (-1.5, -2), (3.49, 3), (-7.51, -8)]
        {
            assert_eq!(nearest_int(x), want, "{x}");
        }
        for i in -1000..1000 {
            let x = i as f32 * 0.37;
            assert_eq!(nearest_int(x), x.round_ties_even() as i32, "{x}");
        }
    }
}
