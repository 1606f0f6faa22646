//! ggml's x86 dot products, the ones llama.cpp runs on AVX2 machines without AVX-512,
//! as scalar statements of the same arithmetic, so that a matrix product gives the
//! bits llama.cpp gives there on any machine; on AVX2 machines, as ggml's own
//! instruction sequences ([`avx2`]), which the statements here are the reference of,
//! bit for bit.
//!
//! ggml widens a 32-element block's products into eight float lanes, lane j holding
//! the exact integer sum of elements 4j..4j+4; each lane is a chain of fused
//! multiply-adds of (weight scale × activation scale) and that sum over the blocks, and
//! the lanes are added at the end as `hsum_float_8` adds them. Types with a minimum
//! keep its terms apart: a fused chain of minimum × activation block sum, added last.
//! This differs from astra's own kernels ([`super::scalar`]) only in where the float
//! roundings fall, but a rounding moved can flip an activation's 8-bit rounding in a
//! later layer, and such flips grow: matching llama.cpp's logits closely takes its
//! arithmetic exactly.

use crate::blocks::*;

/// ggml's `hsum_float_8`: the two halves added lane by lane, then lanes 0+2 and 1+3,
/// then those two.
#[inline(always)]
pub fn hsum8(x: [f32; 8]) -> f32 {
    let h = [x[0] + x[4], x[1] + x[5], x[2] + x[6], x[3] + x[7]];
    (h[0] + h[2]) + (h[1] + h[3])
}

use super::VecDotFn;
use crate::GgmlType;

#[inline(always)]
fn pairs<'a, W: Block, A: Block>(w: &'a [u8], a: &'a [u8]) -> impl Iterator<Item = (&'a W, &'a A)> {
    as_blocks::<W>(w).iter().zip(as_blocks::<A>(a))
}

/// The portable kernels for `weights`: the dot product, and where ggml takes a batch's
/// whole groups of four tokens apart, theirs.
pub(crate) fn kernels(weights: GgmlType) -> Option<(VecDotFn, Option<VecDotFn>)> {
    Some(match weights {
        GgmlType::Q4_1 => (dot_q4_1_q8_1, None),
        GgmlType::Q5_0 => (dot_q5_0_q8_0, None),
        GgmlType::Q8_0 => (dot_q8_0_q8_0, None),
        GgmlType::Q4_K => (dot_q4_k_q8_k_gemv, Some(dot_q4_k_q8_k_gemm as VecDotFn)),
        GgmlType::Q6_K => (dot_q6_k_q8_k, None),
        _ => return None,
    })
}

/// Eight lane chains over blocks: `d` and the 32 codes of each block (as i32) against
/// the activation quants.
#[inline(always)]
fn lanes(acc: &mut [f32; 8], d: f32, codes: &[i32; 32], qs: &[i8; 32]) {
    for (j, acc) in acc.iter_mut().enumerate() {
        let isum: i32 = (4 * j..4 * j + 4).map(|e| codes[e] * qs[e] as i32).sum();
        *acc = d.mul_add(isum as f32, *acc);
    }
}

/// The 32 codes of a block of nibbles: low nibbles are elements 0..16, high 16..32.
#[inline(always)]
fn nibbles(qs: &[u8; 16]) -> [i32; 32] {
    std::array::from_fn(|e| {
        if e < 16 {
            (qs[e] & 0xF) as i32
        } else {
            (qs[e - 16] >> 4) as i32
        }
    })
}

/// `ggml_vec_dot_q4_1_q8_1` (AVX2).
pub fn dot_q4_1_q8_1(w: &[u8], a: &[u8]) -> f32 {
    let (mut acc, mut mins) = ([0.0f32; 8], 0.0f32);
    for (w, a) in pairs::<BlockQ4_1, BlockQ8_1>(w, a) {
        mins = w.m.get().mul_add(a.s.get(), mins);
        lanes(&mut acc, w.d.get() * a.d.get(), &nibbles(&w.qs), &a.qs);
    }
    hsum8(acc) + mins
}

/// `ggml_vec_dot_q8_0_q8_0` (AVX2); llamafile's `tinyBLAS_Q0_AVX`, which takes
/// batches of two or more tokens, computes the same lanes and sums.
pub fn dot_q8_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (w, a) in pairs::<BlockQ8_0, BlockQ8_0>(w, a) {
        lanes(
            &mut acc,
            w.d.get() * a.d.get(),
            &w.qs.map(|q| q as i32),
            &a.qs,
        );
    }
    hsum8(acc)
}

/// `ggml_vec_dot_q5_0_q8_0` (AVX2; llamafile's `tinyBLAS_Q0_AVX` for batches computes
/// the same): the codes offset by 16.
pub fn dot_q5_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (w, a) in pairs::<BlockQ5_0, BlockQ8_0>(w, a) {
        let qh = u32::from_le_bytes(w.qh);
        let codes = nibbles(&w.qs);
        let codes: [i32; 32] =
            std::array::from_fn(|e| (codes[e] | (((qh >> e) & 1) << 4) as i32) - 16);
        lanes(&mut acc, w.d.get() * a.d.get(), &codes, &a.qs);
    }
    hsum8(acc)
}

/// `ggml_vec_dot_q6_K_q8_K` (AVX2). Lane l holds the integer sum, scales applied, of
/// the codes (unsigned, 0..64) at positions 4l..4l+4 of each 32-code vector, less 32
/// times the activation sums of 16-groups 2l and 2l+1 with their scales (the offset
/// of the codes, taken in lanes of its own pairing); one fused chain per lane over
/// the blocks.
pub fn dot_q6_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (w, a) in pairs::<BlockQ6K, BlockQ8K>(w, a) {
        let mut lane = [0i32; 8];
        for k in 0..QK_K {
            let (n, r, p) = (k / 128, (k % 128) / 32, k % 32);
            let ql = w.ql[64 * n + 32 * (r % 2) + p];
            let low = if r < 2 { ql & 0xF } else { ql >> 4 };
            let code = (low | (((w.qh[32 * n + p] >> (2 * r)) & 3) << 4)) as i32;
            lane[p / 4] += w.scales[k / 16] as i32 * code * a.qs[k] as i32;
        }
        for (l, v) in lane.iter_mut().enumerate() {
            *v -= 32
                * (a.bsum(2 * l) * w.scales[2 * l] as i32
                    + a.bsum(2 * l + 1) * w.scales[2 * l + 1] as i32);
        }
        let d = a.d() * w.d.get();
        for (acc, &v) in acc.iter_mut().zip(&lane) {
            *acc = d.mul_add(v as f32, *acc);
        }
    }
    hsum8(acc)
}

/// A Q4_K block's integer sums for groups `groups` (of eight 32-weight groups): the
/// scaled code sums, and the minimums times the activation sums.
#[inline(always)]
fn q4_k_sums(w: &BlockQ4K, a: &BlockQ8K, groups: std::ops::Range<usize>) -> (i32, i32) {
    let (mut isum, mut imin) = (0i32, 0i32);
    for j in groups {
        let (sc, m) = scale_min_k4(j, &w.scales);
        let shift = 4 * (j % 2) as u32;
        let bytes = &w.qs[32 * (j / 2)..][..32];
        let qs = &a.qs[32 * j..][..32];
        let codes: i32 = bytes
            .iter()
            .zip(qs)
            .map(|(&b, &q)| ((b >> shift) & 0xF) as i32 * q as i32)
            .sum();
        isum += sc as i32 * codes;
        imin += m as i32 * (a.bsum(2 * j) + a.bsum(2 * j + 1));
    }
    (isum, imin)
}

/// Q4_K as ggml runs it on AVX2: rows repacked eight at a time (`q4_K_8x8_q8_K`), a
/// token alone through `ggml_gemv_q4_K_8x8_q8_K`: one fused step per super-block for
/// the scaled sums and one for the minimums, subtracted at the end.
#[inline(always)]
pub fn dot_q4_k_q8_k_gemv(w: &[u8], a: &[u8]) -> f32 {
    q4_k_repacked(w, a, 8)
}

/// As [`dot_q4_k_q8_k_gemv`], for the tokens of a batch that ggml takes four at a time
/// (`ggml_gemm_q4_K_8x8_q8_K`): a fused step per pair of 32-weight groups.
#[inline(always)]
pub fn dot_q4_k_q8_k_gemm(w: &[u8], a: &[u8]) -> f32 {
    q4_k_repacked(w, a, 2)
}

/// The repacked Q4_K kernels' arithmetic, a fused step every `step` groups.
#[inline(always)]
fn q4_k_repacked(w: &[u8], a: &[u8], step: usize) -> f32 {
    let (mut acc, mut acc_min) = (0.0f32, 0.0f32);
    for (w, a) in pairs::<BlockQ4K, BlockQ8K>(w, a) {
        let (d, dmin) = (w.d.get() * a.d(), w.dmin.get() * a.d());
        for g in (0..8).step_by(step) {
            let (isum, imin) = q4_k_sums(w, a, g..g + step);
            acc = (isum as f32).mul_add(d, acc);
            acc_min = (imin as f32).mul_add(dmin, acc_min);
        }
    }
    acc - acc_min
}

/// The kernels above as ggml's AVX2 build runs them: a block's (or for Q6_K a
/// 32-element group's) 32 codes as bytes in one register, `maddubs` and `madd` making
/// the eight lanes' exact integer sums, one fused multiply-add per lane; Q4_K as the
/// portable statement compiled for AVX2 and FMA (its integer sums vectorized, each
/// `mul_add` one instruction). Every kernel needs AVX2, FMA and F16C: they are handed
/// out only by `Kernels::ggml` on an available AVX2 set.
#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use std::arch::x86_64::*;

    use super::{hsum8, pairs};
    use crate::blocks::*;
    use crate::dot::avx2::{bits_to_bytes, dot_i8, load, load_u8, nibbles, scale_pair, srl16};
    use crate::dot::VecDotFn;
    use crate::GgmlType;

    /// The kernels for `weights`, as [`super::kernels`] gives them.
    pub(crate) fn kernels(weights: GgmlType) -> Option<(VecDotFn, Option<VecDotFn>)> {
        Some(match weights {
            GgmlType::Q4_1 => (avx2_dot_fn!(q4_1_q8_1), None),
            GgmlType::Q5_0 => (avx2_dot_fn!(q5_0_q8_0), None),
            GgmlType::Q8_0 => (avx2_dot_fn!(q8_0_q8_0), None),
            GgmlType::Q4_K => (avx2_dot_fn!(q4_k_gemv), Some(avx2_dot_fn!(q4_k_gemm))),
            GgmlType::Q6_K => (avx2_dot_fn!(q6_k_q8_k), None),
            _ => return None,
        })
    }

    /// `acc + d × (lane sums of codes · qs)`: lane j sums elements 4j..4j+4. Exact for
    /// codes in -128..=127 against quants in -127..=127 (what ggml's quantizers make).
    #[inline(always)]
    unsafe fn lanes(acc: __m256, d: f32, codes: __m256i, qs: __m256i) -> __m256 {
        _mm256_fmadd_ps(
            _mm256_set1_ps(d),
            _mm256_cvtepi32_ps(dot_i8(codes, qs)),
            acc,
        )
    }

    #[inline(always)]
    unsafe fn finish(acc: __m256) -> f32 {
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        hsum8(lanes)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_1_q8_1(w: &[u8], a: &[u8]) -> f32 {
        let (mut acc, mut mins) = (_mm256_setzero_ps(), 0.0f32);
        for (w, a) in pairs::<BlockQ4_1, BlockQ8_1>(w, a) {
            mins = w.m.get().mul_add(a.s.get(), mins);
            acc = lanes(acc, w.d.get() * a.d.get(), nibbles(&w.qs), load(&a.qs));
        }
        finish(acc) + mins
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (w, a) in pairs::<BlockQ8_0, BlockQ8_0>(w, a) {
            acc = lanes(acc, w.d.get() * a.d.get(), load(&w.qs), load(&a.qs));
        }
        finish(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q5_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (w, a) in pairs::<BlockQ5_0, BlockQ8_0>(w, a) {
            // ggml's `bytes_from_bits_32`: 0xF0 OR-ed into each nibble whose fifth bit is
            // clear is the code less 16.
            let fill = _mm256_andnot_si256(
                bits_to_bytes(u32::from_le_bytes(w.qh)),
                _mm256_set1_epi8(0xF0u8 as i8),
            );
            acc = lanes(
                acc,
                w.d.get() * a.d.get(),
                _mm256_or_si256(nibbles(&w.qs), fill),
                load(&a.qs),
            );
        }
        finish(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let (low4, low2) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(3));
        for (w, a) in pairs::<BlockQ6K, BlockQ8K>(w, a) {
            let mut sums = _mm256_setzero_si256();
            for n in 0..2 {
                let (ql, qh) = (
                    [load_u8(&w.ql[64 * n..]), load_u8(&w.ql[64 * n + 32..])],
                    load_u8(&w.qh[32 * n..]),
                );
                for r in 0..4 {
                    // Codes 128n + 32r + 0..32: low bits from a nibble of ql, high from qh.
                    let low = _mm256_and_si256(srl16(ql[r % 2], 4 * (r / 2) as i32), low4);
                    let high = _mm256_and_si256(srl16(qh, 2 * r as i32), low2);
                    let codes = _mm256_or_si256(low, _mm256_slli_epi16::<4>(high));
                    let base = 128 * n + 32 * r;
                    let scales =
                        scale_pair(w.scales[base / 16] as i16, w.scales[base / 16 + 1] as i16);
                    sums = _mm256_add_epi32(
                        sums,
                        _mm256_madd_epi16(scales, _mm256_maddubs_epi16(codes, load(&a.qs[base..]))),
                    );
                }
            }
            // The codes' offset of 32, from the activations' 16-sums.
            let scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(w.scales.as_ptr().cast()));
            let offset = _mm256_madd_epi16(load_u8(a.bsums.as_flattened()), scales);
            sums = _mm256_sub_epi32(sums, _mm256_slli_epi32::<5>(offset));
            acc = _mm256_fmadd_ps(
                _mm256_set1_ps(a.d() * w.d.get()),
                _mm256_cvtepi32_ps(sums),
                acc,
            );
        }
        finish(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_k_gemv(w: &[u8], a: &[u8]) -> f32 {
        super::dot_q4_k_q8_k_gemv(w, a)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_k_gemm(w: &[u8], a: &[u8]) -> f32 {
        super::dot_q4_k_q8_k_gemm(w, a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::ActType;
    use crate::GgmlType;

    /// Against astra's scalar reference (itself tested against f64): the same terms,
    /// so they differ only by float association, within f32 rounding of the terms'
    /// magnitudes. And ggml's AVX2 sequences ([`avx2`]) give the portable kernels' bits.
    #[test]
    fn ggml_dots_are_the_reference_dot_product() {
        use crate::dot::{scalar, Isa, Kernels};
        let mut seed = 0x9E37_79B9u32;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed as f32 / u32::MAX as f32) * 2.0 - 1.0
        };
        let n = 4096;
        let w: Vec<f32> = (0..n).map(|_| next()).collect();
        let x: Vec<f32> = (0..n).map(|_| next()).collect();
        let avx2 = Isa::Avx2.available();
        if !avx2 {
            eprintln!("SKIPPED (in part): no AVX2 here, so ggml's AVX2 sequences are not compared");
        }
        // Each type, whether its kernel for a batch's groups of four is meant, and
        // astra's scalar reference.
        type Dot = fn(&[u8], &[u8]) -> f32;
        let cases: [(GgmlType, bool, Dot); 6] = [
            (GgmlType::Q4_1, false, scalar::dot_q4_1_q8_1),
            (GgmlType::Q8_0, false, scalar::dot_q8_0_q8_0),
            (GgmlType::Q5_0, false, scalar::dot_q5_0_q8_0),
            (GgmlType::Q6_K, false, scalar::dot_q6_k_q8_k),
            (GgmlType::Q4_K, false, scalar::dot_q4_k_q8_k),
            (GgmlType::Q4_K, true, scalar::dot_q4_k_q8_k),
        ];
        let kernel = |ty, isa, in_fours: bool| {
            let k = Kernels::ggml(ty, isa).unwrap();
            assert_eq!(k.isa, isa);
            if in_fours {
                k.dot_in_fours.unwrap()
            } else {
                k.dot
            }
        };
        for (ty, in_fours, reference) in cases {
            let dot = kernel(ty, Isa::Scalar, in_fours);
            let wq = match ty {
                // No quantizer for the K-quants here: random codes, small f16 scales.
                GgmlType::Q4_K | GgmlType::Q6_K => {
                    let mut bytes: Vec<u8> = (0..crate::row_bytes(ty, n).unwrap())
                        .map(|_| (next().to_bits() >> 7) as u8)
                        .collect();
                    for b in bytes.chunks_exact_mut(crate::row_bytes(ty, QK_K).unwrap()) {
                        let scales = if ty == GgmlType::Q4_K {
                            0..4
                        } else {
                            b.len() - 2..b.len()
                        };
                        for at in scales.step_by(2) {
                            b[at..at + 2].copy_from_slice(
                                &half::f16::from_f32(0.01 + 0.01 * next().abs()).to_le_bytes(),
                            );
                        }
                    }
                    bytes
                }
                _ => crate::quantize(ty, &w).unwrap(),
            };
            let w: Vec<f32> = {
                let mut d = vec![0.0f32; n];
                crate::dequantize(ty, &wq, &mut d).unwrap();
                d
            };
            let act = ActType::for_weights(ty).unwrap();
            let mut aq = vec![0u8; act.row_bytes(n).unwrap()];
            act.quantize(&x, &mut aq);
            let magnitude: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            let (got, want) = (dot(&wq, &aq), reference(&wq, &aq));
            assert!(
                (got - want).abs() <= 1e-6 * magnitude,
                "{ty:?}: {got} vs {want}"
            );
            assert_ne!(got, 0.0);
            if avx2 {
                let simd = kernel(ty, Isa::Avx2, in_fours);
                assert_eq!(
                    simd(&wq, &aq).to_bits(),
                    got.to_bits(),
                    "{ty:?}: the AVX2 kernel's bits"
                );
            }
        }
    }

    /// The lane order of `hsum_float_8`, seen where association matters.
    #[test]
    fn hsum8_adds_as_ggml() {
        let big = 1.0e8f32;
        // (x0+x4 + x2+x6) + (x1+x5 + x3+x7): the 1.0s meet each other before the big ones.
        assert_eq!(hsum8([big, 1.0, -big, 1.0, 0.0, 0.0, 0.0, 0.0]), 2.0);
        assert_eq!(hsum8([big, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]), big);
    }
}
