//! Dequantization: the scalar reference that defines each format's values.
//!
//! Each function follows ggml's `dequantize_row_*` (ggml-quants.c) operation for
//! operation, so that the values are exact matches of ggml's, not approximations:
//! the same products in the same order, in f32, without fused multiply-adds.

use crate::blocks::*;
use crate::iq2s_grid::IQ2S_GRID;
use crate::iq2xs_grid::{IQ2XS_GRID, IQ2XXS_GRID};
use crate::iq3s_grid::IQ3S_GRID;

pub fn dequantize_q4_0(blocks: &[BlockQ4_0], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let d = b.d.get();
        for j in 0..16 {
            y[j] = ((b.qs[j] & 0xF) as i32 - 8) as f32 * d;
            y[j + 16] = ((b.qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

pub fn dequantize_q4_1(blocks: &[BlockQ4_1], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let (d, m) = (b.d.get(), b.m.get());
        for j in 0..16 {
            y[j] = (b.qs[j] & 0xF) as f32 * d + m;
            y[j + 16] = (b.qs[j] >> 4) as f32 * d + m;
        }
    }
}

/// The fifth bits of a Q5 block for weights j and j + 16, shifted into place.
#[inline(always)]
fn q5_high_bits(qh: [u8; 4], j: usize) -> (u8, u8) {
    let qh = u32::from_le_bytes(qh);
    (
        (((qh >> j) << 4) & 0x10) as u8,
        ((qh >> (j + 12)) & 0x10) as u8,
    )
}

pub fn dequantize_q5_0(blocks: &[BlockQ5_0], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let d = b.d.get();
        for j in 0..16 {
            let (h0, h1) = q5_high_bits(b.qh, j);
            y[j] = (((b.qs[j] & 0xF) | h0) as i32 - 16) as f32 * d;
            y[j + 16] = (((b.qs[j] >> 4) | h1) as i32 - 16) as f32 * d;
        }
    }
}

pub fn dequantize_q5_1(blocks: &[BlockQ5_1], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let (d, m) = (b.d.get(), b.m.get());
        for j in 0..16 {
            let (h0, h1) = q5_high_bits(b.qh, j);
            y[j] = ((b.qs[j] & 0xF) | h0) as f32 * d + m;
            y[j + 16] = ((b.qs[j] >> 4) | h1) as f32 * d + m;
        }
    }
}

pub fn dequantize_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let d = b.d.get();
        for (y, &q) in y.iter_mut().zip(&b.qs) {
            *y = q as f32 * d;
        }
    }
}

pub fn dequantize_q8_1(blocks: &[BlockQ8_1], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let d = b.d.get();
        for (y, &q) in y.iter_mut().zip(&b.qs) {
            *y = q as f32 * d;
        }
    }
}

pub fn dequantize_q2_k(blocks: &[BlockQ2K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let (d, min) = (b.d.get(), b.dmin.get());
        let mut is = 0;
        for (half, y) in y.chunks_exact_mut(128).enumerate() {
            let q = &b.qs[32 * half..32 * half + 32];
            for (j, y) in y.chunks_exact_mut(32).enumerate() {
                let shift = 2 * j;
                for (part, y) in y.chunks_exact_mut(16).enumerate() {
                    let sc = b.scales[is];
                    is += 1;
                    let dl = d * (sc & 0xF) as f32;
                    let ml = min * (sc >> 4) as f32;
                    for (l, y) in y.iter_mut().enumerate() {
                        *y = dl * ((q[16 * part + l] >> shift) & 3) as f32 - ml;
                    }
                }
            }
        }
    }
}

pub fn dequantize_q3_k(blocks: &[BlockQ3K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d_all = b.d.get();
        let scales = q3k_scales(&b.scales);
        let mut is = 0;
        let mut m = 1u8;
        for (half, y) in y.chunks_exact_mut(128).enumerate() {
            let q = &b.qs[32 * half..32 * half + 32];
            for (j, y) in y.chunks_exact_mut(32).enumerate() {
                let shift = 2 * j;
                for (part, y) in y.chunks_exact_mut(16).enumerate() {
                    let dl = d_all * scales[is] as f32;
                    is += 1;
                    for (l, y) in y.iter_mut().enumerate() {
                        let k = 16 * part + l;
                        let low = ((q[k] >> shift) & 3) as i8;
                        let high = if b.hmask[k] & m != 0 { 0 } else { 4 };
                        *y = dl * (low - high) as f32;
                    }
                }
                m <<= 1;
            }
        }
    }
}

pub fn dequantize_q4_k(blocks: &[BlockQ4K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let (d, min) = (b.d.get(), b.dmin.get());
        for (j, y) in y.chunks_exact_mut(64).enumerate() {
            let q = &b.qs[32 * j..32 * j + 32];
            let (sc1, m1) = scale_min_k4(2 * j, &b.scales);
            let (sc2, m2) = scale_min_k4(2 * j + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0xF) as f32 - m1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

pub fn dequantize_q5_k(blocks: &[BlockQ5K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let (d, min) = (b.d.get(), b.dmin.get());
        for (j, y) in y.chunks_exact_mut(64).enumerate() {
            let ql = &b.qs[32 * j..32 * j + 32];
            let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
            let (sc1, m1) = scale_min_k4(2 * j, &b.scales);
            let (sc2, m2) = scale_min_k4(2 * j + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            for l in 0..32 {
                let h1 = if b.qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if b.qh[l] & u2 != 0 { 16 } else { 0 };
                y[l] = d1 * ((ql[l] & 0xF) + h1) as f32 - m1;
                y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
            }
        }
    }
}

pub fn dequantize_q6_k(blocks: &[BlockQ6K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.get();
        for (n, y) in y.chunks_exact_mut(128).enumerate() {
            let ql = &b.ql[64 * n..64 * n + 64];
            let qh = &b.qh[32 * n..32 * n + 32];
            let sc = &b.scales[8 * n..8 * n + 8];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * sc[is] as f32 * q1 as f32;
                y[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
                y[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
                y[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
            }
        }
    }
}

pub fn dequantize_q8_k(blocks: &[BlockQ8K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d();
        for (y, &q) in y.iter_mut().zip(&b.qs) {
            *y = d * q as f32;
        }
    }
}

/// The grid point of group `l` (0..4) of 32-weight group `ib32` of an IQ2_S block:
/// eight magnitudes, the index's two high bits coming from `qh`.
#[inline(always)]
pub(crate) fn iq2s_grid_point(b: &BlockIq2S, ib32: usize, l: usize) -> [u8; 8] {
    let index = b.qs[4 * ib32 + l] as usize | ((b.qh[ib32] as usize) << (8 - 2 * l) & 0x300);
    IQ2S_GRID[index].to_le_bytes()
}

/// The sign byte of group `l` of 32-weight group `ib32` (bit j set: weight j negative).
#[inline(always)]
pub(crate) fn iq2s_signs(b: &BlockIq2S, ib32: usize, l: usize) -> u8 {
    b.qs[32 + 4 * ib32 + l]
}

/// The scales of the two 16-weight halves of a 32-weight group whose 4-bit scales
/// are packed in `scales` (IQ2_XS, IQ2_S): `d · (0.5 + s) / 4`.
#[inline(always)]
fn half_scales(d: f32, scales: u8) -> [f32; 2] {
    [
        d * (0.5 + (scales & 0xF) as f32) * 0.25,
        d * (0.5 + (scales >> 4) as f32) * 0.25,
    ]
}

/// Eight weights `scale · grid[j]`, negated where `signs` has bit j set.
#[inline(always)]
fn signed_grid(scale: f32, grid: [u8; 8], signs: u8, y: &mut [f32]) {
    for j in 0..8 {
        let sign = if signs & (1 << j) != 0 { -1.0 } else { 1.0 };
        y[j] = scale * grid[j] as f32 * sign;
    }
}

pub fn dequantize_iq2_s(blocks: &[BlockIq2S], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.get();
        for (ib32, y) in y.chunks_exact_mut(32).enumerate() {
            let db = half_scales(d, b.scales[ib32]);
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let signs = iq2s_signs(b, ib32, l);
                signed_grid(db[l / 2], iq2s_grid_point(b, ib32, l), signs, y);
            }
        }
    }
}

/// The four magnitudes of grid index `k` (0..8) of 32-weight group `ib32` of an IQ3_S
/// block (weights 4k..4k + 4 of the group): its byte in `qs`, its ninth bit bit k of
/// the group's `qh` byte.
#[inline(always)]
pub(crate) fn iq3s_grid_point(b: &BlockIq3S, ib32: usize, k: usize) -> [u8; 4] {
    let index = b.qs[8 * ib32 + k] as usize | (((b.qh[ib32] >> k) as usize & 1) << 8);
    IQ3S_GRID[index].to_le_bytes()
}

/// The multiplier of group `ib32` of an IQ3_S block: 2s + 1 for its 4-bit scale s (the
/// low nibble of its byte for even groups, the high one for odd).
#[inline(always)]
pub(crate) fn iq3s_scale(b: &BlockIq3S, ib32: usize) -> i32 {
    2 * ((b.scales[ib32 / 2] >> (4 * (ib32 % 2))) & 0xF) as i32 + 1
}

pub fn dequantize_iq3_s(blocks: &[BlockIq3S], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.get();
        for (ib32, y) in y.chunks_exact_mut(32).enumerate() {
            let db = d * iq3s_scale(b, ib32) as f32;
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let (lo, hi) = (
                    iq3s_grid_point(b, ib32, 2 * l),
                    iq3s_grid_point(b, ib32, 2 * l + 1),
                );
                let grid = [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]];
                signed_grid(db, grid, b.signs[4 * ib32 + l], y);
            }
        }
    }
}

/// The eight signs of a 7-bit sign code (bit j set: weight j negative): the eighth is
/// the parity of the seven, so that an even number of weights is negative (ggml's
/// `ksigns_iq2xs`).
#[inline(always)]
pub(crate) fn iq2_signs(code: u32) -> u8 {
    let code = (code & 127) as u8;
    code | (((code.count_ones() & 1) as u8) << 7)
}

/// The two u32s of 32-weight group `ib32` of an IQ2_XXS block: four grid indices, then
/// four 7-bit sign codes under a 4-bit scale.
#[inline(always)]
pub(crate) fn iq2xxs_group(b: &BlockIq2Xxs, ib32: usize) -> (u32, u32) {
    let q = |k: usize| u16::from_le_bytes(b.qs[4 * ib32 + k]) as u32;
    (q(0) | q(1) << 16, q(2) | q(3) << 16)
}

/// Grid point `l` (0..4) of IQ2_XXS group `(grid, signs)` and its sign byte.
#[inline(always)]
pub(crate) fn iq2xxs_point(group: (u32, u32), l: usize) -> ([u8; 8], u8) {
    let index = (group.0 >> (8 * l)) & 0xFF;
    (
        IQ2XXS_GRID[index as usize].to_le_bytes(),
        iq2_signs(group.1 >> (7 * l)),
    )
}

pub fn dequantize_iq2_xxs(blocks: &[BlockIq2Xxs], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.get();
        for (ib32, y) in y.chunks_exact_mut(32).enumerate() {
            let group = iq2xxs_group(b, ib32);
            let db = d * (0.5 + (group.1 >> 28) as f32) * 0.25;
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let (grid, signs) = iq2xxs_point(group, l);
                signed_grid(db, grid, signs, y);
            }
        }
    }
}

/// Grid point `l` (0..4) of 32-weight group `ib32` of an IQ2_XS block and its sign byte.
#[inline(always)]
pub(crate) fn iq2xs_point(b: &BlockIq2Xs, ib32: usize, l: usize) -> ([u8; 8], u8) {
    let q = u16::from_le_bytes(b.qs[4 * ib32 + l]) as u32;
    (
        IQ2XS_GRID[(q & 511) as usize].to_le_bytes(),
        iq2_signs(q >> 9),
    )
}

pub fn dequantize_iq2_xs(blocks: &[BlockIq2Xs], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.get();
        for (ib32, y) in y.chunks_exact_mut(32).enumerate() {
            let db = half_scales(d, b.scales[ib32]);
            for (l, y) in y.chunks_exact_mut(8).enumerate() {
                let (grid, signs) = iq2xs_point(b, ib32, l);
                signed_grid(db[l / 2], grid, signs, y);
            }
        }
    }
}

pub fn dequantize_iq4_nl(blocks: &[BlockIq4Nl], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(32)) {
        let d = b.d.get();
        for j in 0..16 {
            y[j] = d * KVALUES_IQ4NL[(b.qs[j] & 0xF) as usize] as f32;
            y[j + 16] = d * KVALUES_IQ4NL[(b.qs[j] >> 4) as usize] as f32;
        }
    }
}

pub fn dequantize_q2_0(blocks: &[BlockQ2_0], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(64)) {
        let d = b.d.get();
        for (j, y) in y.iter_mut().enumerate() {
            let q = (b.qs[j / 4] >> (2 * (j % 4))) & 3;
            *y = (q as i32 - 1) as f32 * d;
        }
    }
}

pub fn dequantize_f16(bytes: &[u8], out: &mut [f32]) {
    for (y, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *y = F16Le([b[0], b[1]]).get();
    }
}

pub fn dequantize_bf16(bytes: &[u8], out: &mut [f32]) {
    for (y, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *y = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
}

pub fn dequantize_f32(bytes: &[u8], out: &mut [f32]) {
    for (y, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}
