//! Scalar reference dot products: a weight row (as stored) with a quantized
//! activation row, paired as ggml pairs them (32-blocks with Q8_0, 256-blocks with
//! Q8_K, float weights with f32 activations).
//!
//! Each block's integer dot product is exact; the float work per block is a product of
//! scales and one accumulation, in block order. The SIMD kernels compute the same
//! integer sums and differ only in how the float partial sums are associated.

// The reference loops index several arrays by one counter, as ggml's C reference does,
// so that they can be held against it line by line.
#![allow(clippy::needless_range_loop)]

use crate::blocks::*;
use crate::dequant::{
    iq2s_grid_point, iq2s_signs, iq2xs_point, iq2xxs_group, iq2xxs_point, iq3s_grid_point,
    iq3s_scale,
};

#[inline(always)]
fn pairs<'a, W: Block, A: Block>(w: &'a [u8], a: &'a [u8]) -> impl Iterator<Item = (&'a W, &'a A)> {
    as_blocks::<W>(w).iter().zip(as_blocks::<A>(a))
}

pub fn dot_q4_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, a) in pairs::<BlockQ4_0, BlockQ8_0>(w, a) {
        let mut isum = 0i32;
        for j in 0..16 {
            isum += ((w.qs[j] & 0xF) as i32 - 8) * a.qs[j] as i32;
            isum += ((w.qs[j] >> 4) as i32 - 8) * a.qs[j + 16] as i32;
        }
        sum += isum as f32 * (w.d.get() * a.d.get());
    }
    sum
}

/// The minimum of each block meets the activations' stored sum `s` (as ggml: the
/// scale terms accumulate block by block, the minimum terms apart, added at the end).
pub fn dot_q4_1_q8_1(w: &[u8], a: &[u8]) -> f32 {
    let (mut sum, mut mins) = (0.0f32, 0.0f32);
    for (w, a) in pairs::<BlockQ4_1, BlockQ8_1>(w, a) {
        let mut isum = 0i32;
        for j in 0..16 {
            isum += (w.qs[j] & 0xF) as i32 * a.qs[j] as i32;
            isum += (w.qs[j] >> 4) as i32 * a.qs[j + 16] as i32;
        }
        sum += isum as f32 * (w.d.get() * a.d.get());
        mins += w.m.get() * a.s.get();
    }
    sum + mins
}

/// The 32 five-bit codes of a Q5 block.
#[inline(always)]
fn q5_codes(qs: &[u8; 16], qh: [u8; 4]) -> [i32; 32] {
    let qh = u32::from_le_bytes(qh);
    std::array::from_fn(|j| {
        let nibble = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
        (nibble as u32 | (((qh >> j) & 1) << 4)) as i32
    })
}

pub fn dot_q5_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, a) in pairs::<BlockQ5_0, BlockQ8_0>(w, a) {
        let codes = q5_codes(&w.qs, w.qh);
        let isum: i32 = codes
            .iter()
            .zip(&a.qs)
            .map(|(&q, &y)| (q - 16) * y as i32)
            .sum();
        sum += isum as f32 * (w.d.get() * a.d.get());
    }
    sum
}

pub fn dot_q5_1_q8_1(w: &[u8], a: &[u8]) -> f32 {
    let (mut sum, mut mins) = (0.0f32, 0.0f32);
    for (w, a) in pairs::<BlockQ5_1, BlockQ8_1>(w, a) {
        let codes = q5_codes(&w.qs, w.qh);
        let isum: i32 = codes.iter().zip(&a.qs).map(|(&q, &y)| q * y as i32).sum();
        sum += isum as f32 * (w.d.get() * a.d.get());
        mins += w.m.get() * a.s.get();
    }
    sum + mins
}

pub fn dot_q8_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, a) in pairs::<BlockQ8_0, BlockQ8_0>(w, a) {
        let isum: i32 =
            w.qs.iter()
                .zip(&a.qs)
                .map(|(&x, &y)| x as i32 * y as i32)
                .sum();
        sum += isum as f32 * (w.d.get() * a.d.get());
    }
    sum
}

pub fn dot_iq4_nl_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, a) in pairs::<BlockIq4Nl, BlockQ8_0>(w, a) {
        let mut isum = 0i32;
        for j in 0..16 {
            isum += KVALUES_IQ4NL[(w.qs[j] & 0xF) as usize] as i32 * a.qs[j] as i32;
            isum += KVALUES_IQ4NL[(w.qs[j] >> 4) as usize] as i32 * a.qs[j + 16] as i32;
        }
        sum += isum as f32 * (w.d.get() * a.d.get());
    }
    sum
}

/// Q2_0 blocks hold 64 weights: each pairs with two Q8_0 activation blocks.
pub fn dot_q2_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    let acts = as_blocks::<BlockQ8_0>(a);
    for (w, a) in as_blocks::<BlockQ2_0>(w).iter().zip(acts.chunks_exact(2)) {
        let dw = w.d.get();
        for (half, a) in a.iter().enumerate() {
            let mut isum = 0i32;
            for (j, &y) in a.qs.iter().enumerate() {
                let k = 32 * half + j;
                let q = ((w.qs[k / 4] >> (2 * (k % 4))) & 3) as i32 - 1;
                isum += q * y as i32;
            }
            sum += isum as f32 * (dw * a.d.get());
        }
    }
    sum
}

pub fn dot_q2_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, a) in pairs::<BlockQ2K, BlockQ8K>(w, a) {
        let (mut isum, mut msum) = (0i32, 0i32);
        for g in 0..16 {
            // Group g: 16 weights, in 128-half g / 8, bit pair (g % 8) / 2, bytes
            // 16 * (g % 2) .. + 16 of that half's 32.
            let (half, shift, part) = (g / 8, 2 * ((g % 8) / 2), g % 2);
            let q = &w.qs[32 * half + 16 * part..][..16];
            let y = &a.qs[16 * g..16 * g + 16];
            let gsum: i32 = q
                .iter()
                .zip(y)
                .map(|(&q, &y)| ((q >> shift) & 3) as i32 * y as i32)
                .sum();
            isum += (w.scales[g] & 0xF) as i32 * gsum;
            msum += (w.scales[g] >> 4) as i32 * a.bsum(g);
        }
        let da = a.d();
        sum += isum as f32 * (w.d.get() * da) - msum as f32 * (w.dmin.get() * da);
    }
    sum
}

pub fn dot_q3_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, a) in pairs::<BlockQ3K, BlockQ8K>(w, a) {
        let scales = q3k_scales(&w.scales);
        let mut isum = 0i32;
        for g in 0..16 {
            let (half, j, part) = (g / 8, (g % 8) / 2, g % 2);
            let (shift, mask) = (2 * j, 1u8 << (4 * half + j));
            let mut gsum = 0i32;
            for l in 0..16 {
                let k = 16 * part + l;
                let low = ((w.qs[32 * half + k] >> shift) & 3) as i32;
                let high = if w.hmask[k] & mask != 0 { 0 } else { 4 };
                gsum += (low - high) * a.qs[16 * g + l] as i32;
            }
            isum += scales[g] as i32 * gsum;
        }
        sum += isum as f32 * (w.d.get() * a.d());
    }
    sum
}

/// Σ over the 8 groups of 32 of a Q4_K/Q5_K block: (scale × group dot, min × group
/// activation sum), given the group's five- or four-bit codes.
#[inline(always)]
fn k4_block_sums(scales: &[u8; 12], a: &BlockQ8K, code: impl Fn(usize) -> i32) -> (i32, i32) {
    let (mut isum, mut msum) = (0i32, 0i32);
    for g in 0..8 {
        let (sc, m) = scale_min_k4(g, scales);
        let gsum: i32 = (0..32)
            .map(|l| code(32 * g + l) * a.qs[32 * g + l] as i32)
            .sum();
        isum += sc as i32 * gsum;
        msum += m as i32 * (a.bsum(2 * g) + a.bsum(2 * g + 1));
    }
    (isum, msum)
}

pub fn dot_q4_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, a) in pairs::<BlockQ4K, BlockQ8K>(w, a) {
        // Weight k: byte 32 * (k / 64) + k % 32, low nibble when (k / 32) is even.
        let code = |k: usize| {
            let byte = w.qs[32 * (k / 64) + k % 32];
            (if (k / 32).is_multiple_of(2) {
                byte & 0xF
            } else {
                byte >> 4
            }) as i32
        };
        let (isum, msum) = k4_block_sums(&w.scales, a, code);
        let da = a.d();
        sum += isum as f32 * (w.d.get() * da) - msum as f32 * (w.dmin.get() * da);
    }
    sum
}

pub fn dot_q5_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, a) in pairs::<BlockQ5K, BlockQ8K>(w, a) {
        // As Q4_K, with the fifth bit of weight k at bit k / 32 of qh[k % 32].
        let code = |k: usize| {
            let byte = w.qs[32 * (k / 64) + k % 32];
            let low = if (k / 32).is_multiple_of(2) {
                byte & 0xF
            } else {
                byte >> 4
            };
            (low | (((w.qh[k % 32] >> (k / 32)) & 1) << 4)) as i32
        };
        let (isum, msum) = k4_block_sums(&w.scales, a, code);
        let da = a.d();
        sum += isum as f32 * (w.d.get() * da) - msum as f32 * (w.dmin.get() * da);
    }
    sum
}

pub fn dot_q6_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, a) in pairs::<BlockQ6K, BlockQ8K>(w, a) {
        let mut isum = 0i32;
        for k in 0..QK_K {
            // Weight k: 128-half n, quarter r = (k % 128) / 32, lane l = k % 32.
            let (n, r, l) = (k / 128, (k % 128) / 32, k % 32);
            let ql = w.ql[64 * n + 32 * (r % 2) + l];
            let low = if r < 2 { ql & 0xF } else { ql >> 4 };
            let high = (w.qh[32 * n + l] >> (2 * r)) & 3;
            let q = (low | (high << 4)) as i32 - 32;
            isum += w.scales[k / 16] as i32 * q * a.qs[k] as i32;
        }
        sum += isum as f32 * (w.d.get() * a.d());
    }
    sum
}

pub fn dot_q8_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, a) in pairs::<BlockQ8K, BlockQ8K>(w, a) {
        let isum: i32 =
            w.qs.iter()
                .zip(&a.qs)
                .map(|(&x, &y)| x as i32 * y as i32)
                .sum();
        sum += isum as f32 * (w.d() * a.d());
    }
    sum
}

/// Σ grid · sign · q8 over the eight weights of a grid point.
#[inline(always)]
fn signed_grid_dot(grid: [u8; 8], signs: u8, q8: &[i8]) -> i32 {
    (0..8)
        .map(|j| {
            let v = grid[j] as i32 * q8[j] as i32;
            if signs & (1 << j) != 0 {
                -v
            } else {
                v
            }
        })
        .sum()
}

pub fn dot_iq2_xxs_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, a) in pairs::<BlockIq2Xxs, BlockQ8K>(w, a) {
        let mut isum = 0i32;
        for ib32 in 0..8 {
            let group = iq2xxs_group(w, ib32);
            let gsum: i32 = (0..4)
                .map(|l| {
                    let (grid, signs) = iq2xxs_point(group, l);
                    signed_grid_dot(grid, signs, &a.qs[32 * ib32 + 8 * l..][..8])
                })
                .sum();
            isum += (2 * (group.1 >> 28) as i32 + 1) * gsum;
        }
        // Weight scale d * (0.5 + s) / 4 = d * (2s + 1) / 8.
        sum += isum as f32 * (w.d.get() * a.d()) * 0.125;
    }
    sum
}

pub fn dot_iq2_xs_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, a) in pairs::<BlockIq2Xs, BlockQ8K>(w, a) {
        let mut isum = 0i32;
        for ib32 in 0..8 {
            for half in 0..2 {
                let hsum: i32 = (2 * half..2 * half + 2)
                    .map(|l| {
                        let (grid, signs) = iq2xs_point(w, ib32, l);
                        signed_grid_dot(grid, signs, &a.qs[32 * ib32 + 8 * l..][..8])
                    })
                    .sum();
                let scale = (w.scales[ib32] >> (4 * half)) & 0xF;
                isum += (2 * scale as i32 + 1) * hsum;
            }
        }
        sum += isum as f32 * (w.d.get() * a.d()) * 0.125;
    }
    sum
}

pub fn dot_iq2_s_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, a) in pairs::<BlockIq2S, BlockQ8K>(w, a) {
        let mut isum = 0i32;
        for ib32 in 0..8 {
            for half in 0..2 {
                let mut hsum = 0i32;
                for l in 2 * half..2 * half + 2 {
                    let grid = iq2s_grid_point(w, ib32, l);
                    let signs = iq2s_signs(w, ib32, l);
                    for j in 0..8 {
                        let v = grid[j] as i32 * a.qs[32 * ib32 + 8 * l + j] as i32;
                        hsum += if signs & (1 << j) != 0 { -v } else { v };
                    }
                }
                let scale = (w.scales[ib32] >> (4 * half)) & 0xF;
                isum += (2 * scale as i32 + 1) * hsum;
            }
        }
        // Weight scale d * (0.5 + s) / 4 = d * (2s + 1) / 8.
        sum += isum as f32 * (w.d.get() * a.d()) * 0.125;
    }
    sum
}

/// Each group's signed grid products, times its multiplier 2s + 1, summed over the
/// block as integers; the block scaled by d times the activations' scale (ggml's
/// weight scale d · (2s + 1)).
pub fn dot_iq3_s_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, a) in pairs::<BlockIq3S, BlockQ8K>(w, a) {
        let mut isum = 0i32;
        for ib32 in 0..8 {
            let mut gsum = 0i32;
            for k in 0..8 {
                let grid = iq3s_grid_point(w, ib32, k);
                let signs = w.signs[4 * ib32 + k / 2] >> (4 * (k % 2));
                for j in 0..4 {
                    let v = grid[j] as i32 * a.qs[32 * ib32 + 4 * k + j] as i32;
                    gsum += if signs & (1 << j) != 0 { -v } else { v };
                }
            }
            isum += iq3s_scale(w, ib32) * gsum;
        }
        sum += (w.d.get() * a.d()) * isum as f32;
    }
    sum
}

/// Σ w·a over float rows, associated exactly as the SIMD kernels associate it: 32
/// lanes (four accumulators of eight) fed by fused multiply-adds, eight-lane steps for
/// what remains, the lanes reduced pairwise, then the last elements added one by one.
/// The same order gives the same bits on every instruction set, and keeps the rounding
/// error growing with n / 32 rather than n.
fn dot_floats(w: &[u8], a: &[u8], wsize: usize, weight: impl Fn(&[u8]) -> f32) -> f32 {
    let n = a.len() / 4;
    let x = |j: usize| weight(&w[j * wsize..(j + 1) * wsize]);
    let y = |j: usize| f32::from_le_bytes(a[4 * j..4 * j + 4].try_into().expect("4 bytes"));
    let mut acc = [[0.0f32; 8]; 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            for (l, lane) in acc.iter_mut().enumerate() {
                *lane = x(i + 8 * k + l).mul_add(y(i + 8 * k + l), *lane);
            }
        }
        i += 32;
    }
    while i + 8 <= n {
        for (l, lane) in acc[0].iter_mut().enumerate() {
            *lane = x(i + l).mul_add(y(i + l), *lane);
        }
        i += 8;
    }
    let lanes: [f32; 8] =
        std::array::from_fn(|l| (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]));
    let mut tail = 0.0f32;
    for j in i..n {
        tail += x(j) * y(j);
    }
    hsum8(lanes) + tail
}

/// The horizontal sum of eight lanes in the order the AVX2 kernels use: halves, then
/// quarters, then the last pair.
pub(crate) fn hsum8(v: [f32; 8]) -> f32 {
    let q: [f32; 4] = std::array::from_fn(|j| v[j] + v[j + 4]);
    let p = [q[0] + q[2], q[1] + q[3]];
    p[0] + p[1]
}

pub fn dot_f32_f32(w: &[u8], a: &[u8]) -> f32 {
    dot_floats(w, a, 4, |b| {
        f32::from_le_bytes(b.try_into().expect("4 bytes"))
    })
}

pub fn dot_f16_f32(w: &[u8], a: &[u8]) -> f32 {
    dot_floats(w, a, 2, |b| F16Le([b[0], b[1]]).get())
}

pub fn dot_bf16_f32(w: &[u8], a: &[u8]) -> f32 {
    dot_floats(w, a, 2, |b| {
        f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
    })
}
