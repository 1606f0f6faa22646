//! Quantization: activations (Q8_0, Q8_K) for the dot products, and the simple
//! weight types for `astra quantize` and synthetic models.
//!
//! Activations are quantized by this one scalar implementation on every machine, so
//! that a token's quantized activations are bit-identical wherever and however it is
//! computed. The arithmetic is that of ggml's x86 quantizers, the ones llama.cpp runs
//! on the machines astra is compared with: Q8_0/Q8_1 multiply by 127 / max|x| and round
//! to nearest, ties to even (`_mm256_round_ps`); Q8_K as `quantize_row_q8_K_ref`. (The
//! portable ggml reference for Q8_0 rounds ties away from zero and divides by d; the
//! results differ only in rare last-place cases, which matter when matching llama.cpp's
//! logits closely.)

use crate::blocks::*;

/// Index and value of the element with the largest magnitude (the first, on ties).
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

/// Round to nearest, ties to even, for |v| < 2^22 (ggml's `nearest_int`: adding 1.5·2^23
/// leaves the rounded integer in the low mantissa bits). Inline, unlike `rintf`.
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12582912.0).to_bits();
    (bits & 0x007f_ffff) as i32 - 0x0040_0000
}

/// The quants of 32 activations and their f32 scale d = max|x| / 127.
fn quantize_32(x: &[f32], qs: &mut [i8; 32]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = nearest_int(v * id) as i8;
    }
    d
}

pub fn quantize_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    for (x, b) in x.chunks_exact(32).zip(out.iter_mut()) {
        b.d = F16Le::from_f32(quantize_32(x, &mut b.qs));
    }
}

pub fn quantize_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    for (x, b) in x.chunks_exact(32).zip(out.iter_mut()) {
        let d = quantize_32(x, &mut b.qs);
        let sum: i32 = b.qs.iter().map(|&q| q as i32).sum();
        b.d = F16Le::from_f32(d);
        b.s = F16Le::from_f32(d * sum as f32);
    }
}

pub fn quantize_q8_k(x: &[f32], out: &mut [BlockQ8K]) {
    for (x, b) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (amax, max) = signed_absmax(x);
        if amax == 0.0 {
            *b = BlockQ8K {
                d: [0; 4],
                qs: [0; QK_K],
                bsums: [[0; 2]; 16],
            };
            continue;
        }
        // ggml uses -127/max (not -128) so that every quant fits in [-127, 127].
        let iscale = -127.0 / max;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (sum, group) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *sum = (group.iter().map(|&q| q as i16).sum::<i16>()).to_le_bytes();
        }
        b.d = (1.0 / iscale).to_le_bytes();
    }
}

pub fn quantize_q4_0(x: &[f32], out: &mut [BlockQ4_0]) {
    for (x, b) in x.chunks_exact(32).zip(out.iter_mut()) {
        let (_, max) = signed_absmax(x);
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = F16Le::from_f32(d);
        for j in 0..16 {
            let lo = ((x[j] * id + 8.5) as i8).min(15) as u8;
            let hi = ((x[j + 16] * id + 8.5) as i8).min(15) as u8;
            b.qs[j] = lo | (hi << 4);
        }
    }
}

fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter()
        .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

pub fn quantize_q4_1(x: &[f32], out: &mut [BlockQ4_1]) {
    for (x, b) in x.chunks_exact(32).zip(out.iter_mut()) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = F16Le::from_f32(d);
        b.m = F16Le::from_f32(min);
        for j in 0..16 {
            let lo = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
            let hi = (((x[j + 16] - min) * id + 0.5) as i8).min(15) as u8;
            b.qs[j] = lo | (hi << 4);
        }
    }
}

/// Packs 32 five-bit codes into Q5 nibbles and fifth bits.
fn pack_q5(codes: &[u8; 32], qs: &mut [u8; 16], qh: &mut [u8; 4]) {
    let mut high = 0u32;
    for j in 0..16 {
        qs[j] = (codes[j] & 0xF) | ((codes[j + 16] & 0xF) << 4);
        high |= ((codes[j] as u32 >> 4) & 1) << j;
        high |= ((codes[j + 16] as u32 >> 4) & 1) << (j + 16);
    }
    *qh = high.to_le_bytes();
}

pub fn quantize_q5_0(x: &[f32], out: &mut [BlockQ5_0]) {
    for (x, b) in x.chunks_exact(32).zip(out.iter_mut()) {
        let (_, max) = signed_absmax(x);
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = F16Le::from_f32(d);
        let codes: [u8; 32] = std::array::from_fn(|j| ((x[j] * id + 16.5) as i8).min(31) as u8);
        pack_q5(&codes, &mut b.qs, &mut b.qh);
    }
}

pub fn quantize_q5_1(x: &[f32], out: &mut [BlockQ5_1]) {
    for (x, b) in x.chunks_exact(32).zip(out.iter_mut()) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = F16Le::from_f32(d);
        b.m = F16Le::from_f32(min);
        let codes: [u8; 32] =
            std::array::from_fn(|j| (((x[j] - min) * id + 0.5) as i8).min(31) as u8);
        pack_q5(&codes, &mut b.qs, &mut b.qh);
    }
}

/// Q2_0 as ggml's `quantize_row_q2_0_ref`: scale = max |x|, codes round(x / d) + 1
/// clamped to 0..=3.
pub fn quantize_q2_0(x: &[f32], out: &mut [BlockQ2_0]) {
    for (x, b) in x.chunks_exact(64).zip(out.iter_mut()) {
        let (amax, _) = signed_absmax(x);
        let d = amax;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        b.d = F16Le::from_f32(d);
        b.qs = [0; 16];
        for (j, &w) in x.iter().enumerate() {
            let q = ((w * id).round() as i32 + 1).clamp(0, 3) as u8;
            b.qs[j / 4] |= q << (2 * (j % 4));
        }
    }
}

pub fn quantize_f16(x: &[f32], out: &mut [u8]) {
    for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
        o.copy_from_slice(&F16Le::from_f32(*v).0);
    }
}

/// BF16 with round-to-nearest-even, NaN kept quiet (as ggml's `GGML_FP32_TO_BF16`).
pub fn quantize_bf16(x: &[f32], out: &mut [u8]) {
    for (v, o) in x.iter().zip(out.chunks_exact_mut(2)) {
        o.copy_from_slice(&half::bf16::from_f32(*v).to_bits().to_le_bytes());
    }
}

pub fn quantize_f32(x: &[f32], out: &mut [u8]) {
    for (v, o) in x.iter().zip(out.chunks_exact_mut(4)) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}
