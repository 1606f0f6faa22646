//! The weight quantizers `astra quantize` writes with: ggml's reference quantizers
//! (`quantize_row_*_ref`), which llama-quantize runs when it has no importance matrix,
//! bit for bit. Every float operation is the C code's, in its order, rounded once per
//! operation (no fused multiply-adds).

use crate::blocks::*;

/// Below this a group's largest magnitude counts as zero (ggml's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// Round to nearest, ties to even (ggml's `nearest_int`, for |v| ≤ 2^22).
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12582912.0).to_bits();
    (bits & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Q8_0 as `quantize_row_q8_0_ref`: d = max|x| / 127, quants round(x / d) with ties away
/// from zero. (The activation quantizer of [`crate::quantize`] follows ggml's x86 code.)
pub fn quantize_q8_0_ref(x: &[f32], out: &mut [BlockQ8_0]) {
    for (x, b) in x.chunks_exact(32).zip(out.iter_mut()) {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = F16Le::from_f32(d);
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
        }
    }
}

/// A group's scale and minimum by ggml's `make_qkx2_quants` (weighted least squares over
/// `nstep + 1` trial scales): the quants in `l`, and (scale, −min).
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * q as f32 + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    let mut aux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmaxf) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = q as u8;
            let (w, q) = (weights[i], q as f32);
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&aux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// A group's signed scale by ggml's `make_qx_quants` with `rmse_type` 1 (weights x²,
/// 18 trial scales around nmax / max): the quants, offset by `nmax`, in `l`.
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let (mut max, mut amax) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let nmaxf = nmax as f32;
    let quant = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let q = quant(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let mut iscale = -nmaxf / max;
    for (q, &v) in l.iter_mut().zip(x) {
        *q = (quant(iscale, v) + nmax) as i8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmaxf + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (q, &v) in l.iter_mut().zip(x) {
                *q = (quant(iscale, v) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// The eight six-bit scales and mins of a Q4_K/Q5_K block, packed as ggml packs them.
fn pack_scales_k4(scales: &[f32; 8], mins: &[f32; 8], max_scale: f32, max_min: f32) -> [u8; 12] {
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut out = [0u8; 12];
    for j in 0..8 {
        // As the C code: the int narrowed to a byte, then capped.
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            out[j] = ls;
            out[j + 4] = lm;
        } else {
            out[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            out[j - 4] |= (ls >> 4) << 6;
            out[j] |= (lm >> 4) << 6;
        }
    }
    out
}

/// The quants of a Q4_K/Q5_K block (0..=nmax) once its scales are packed: each group's
/// from its stored scale and min, or, where that scale is zero, the group's first fit.
fn requantize_k4(x: &[f32], d: F16Le, dmin: F16Le, scales: &[u8; 12], nmax: i32, l: &mut [u8]) {
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, scales);
        let d = d.get() * sc as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin.get() * m as f32;
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, nmax) as u8;
        }
    }
}

/// A Q4_K/Q5_K block's first fit: per group of 32, weights √(mean x²) + |x|.
fn fit_k4(x: &[f32], nmax: i32, rmin: f32, nstep: i32, l: &mut [u8; QK_K]) -> ([f32; 8], [f32; 8]) {
    let (mut scales, mut mins) = ([0.0f32; 8], [0.0f32; 8]);
    let mut weights = [0.0f32; 32];
    for j in 0..8 {
        let g = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in g {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &v) in weights.iter_mut().zip(g) {
            *w = av_x + v.abs();
        }
        (scales[j], mins[j]) = make_qkx2_quants(
            nmax,
            g,
            &weights,
            &mut l[32 * j..32 * j + 32],
            rmin,
            0.1,
            nstep,
        );
    }
    (scales, mins)
}

/// The largest of `v` above zero (0 when none is).
fn positive_max(v: &[f32; 8]) -> f32 {
    v.iter().fold(0.0f32, |m, &s| if s > m { s } else { m })
}

/// Q4_K as `quantize_row_q4_K_ref`.
pub fn quantize_q4_k_ref(x: &[f32], out: &mut [BlockQ4K]) {
    let mut l = [0u8; QK_K];
    for (x, b) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (scales, mins) = fit_k4(x, 15, -1.0, 20, &mut l);
        let (max_scale, max_min) = (positive_max(&scales), positive_max(&mins));
        b.scales = pack_scales_k4(&scales, &mins, max_scale, max_min);
        b.d = F16Le::from_f32(max_scale / 63.0);
        b.dmin = F16Le::from_f32(max_min / 63.0);
        requantize_k4(x, b.d, b.dmin, &b.scales, 15, &mut l);
        for (q, chunk) in b.qs.chunks_exact_mut(32).zip(l.chunks_exact(64)) {
            for i in 0..32 {
                q[i] = chunk[i] | (chunk[i + 32] << 4);
            }
        }
    }
}

/// Q5_K as `quantize_row_q5_K_ref`.
pub fn quantize_q5_k_ref(x: &[f32], out: &mut [BlockQ5K]) {
    let mut l = [0u8; QK_K];
    for (x, b) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (scales, mins) = fit_k4(x, 31, -0.5, 15, &mut l);
        let (max_scale, max_min) = (positive_max(&scales), positive_max(&mins));
        b.scales = pack_scales_k4(&scales, &mins, max_scale, max_min);
        b.d = F16Le::from_f32(max_scale / 63.0);
        b.dmin = F16Le::from_f32(max_min / 63.0);
        requantize_k4(x, b.d, b.dmin, &b.scales, 31, &mut l);
        b.qh = [0; 32];
        for (n, (q, chunk)) in
            b.qs.chunks_exact_mut(32)
                .zip(l.chunks_exact(64))
                .enumerate()
        {
            let (m1, m2) = (1u8 << (2 * n), 2u8 << (2 * n));
            for j in 0..32 {
                let (mut l1, mut l2) = (chunk[j], chunk[j + 32]);
                if l1 > 15 {
                    l1 -= 16;
                    b.qh[j] |= m1;
                }
                if l2 > 15 {
                    l2 -= 16;
                    b.qh[j] |= m2;
                }
                q[j] = l1 | (l2 << 4);
            }
        }
    }
}

/// Q6_K as `quantize_row_q6_K_ref`.
pub fn quantize_q6_k_ref(x: &[f32], out: &mut [BlockQ6K]) {
    let mut l = [0i8; QK_K];
    for (x, b) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let mut scales = [0.0f32; 16];
        let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
        for ib in 0..16 {
            let s = make_qx_quants(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
            scales[ib] = s;
            if s.abs() > max_abs_scale {
                max_abs_scale = s.abs();
                max_scale = s;
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            *b = BlockQ6K {
                ql: [0; 128],
                qh: [0; 64],
                scales: [0; 16],
                d: F16Le::from_f32(0.0),
            };
            continue;
        }
        let iscale = -128.0 / max_scale;
        b.d = F16Le::from_f32(1.0 / iscale);
        for (sc, &s) in b.scales.iter_mut().zip(&scales) {
            *sc = nearest_int(iscale * s).min(127) as i8;
        }
        for j in 0..16 {
            let d = b.d.get() * b.scales[j] as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                let q = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
                l[16 * j + ii] = (q + 32) as i8;
            }
        }
        let l: [u8; QK_K] = std::array::from_fn(|i| l[i] as u8);
        for (half, (ql, qh)) in
            b.ql.chunks_exact_mut(64)
                .zip(b.qh.chunks_exact_mut(32))
                .enumerate()
        {
            let l = &l[128 * half..];
            for i in 0..32 {
                let (q1, q2, q3, q4) = (l[i], l[i + 32], l[i + 64], l[i + 96]);
                ql[i] = (q1 & 0xF) | ((q3 & 0xF) << 4);
                ql[i + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
                qh[i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
            }
        }
    }
}
