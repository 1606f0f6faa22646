//! ggml's x86 dot products, the ones llama.cpp runs on AVX2 machines without AVX-512,
//! as scalar statements of the same arithmetic, so that a matrix product gives the
//! bits llama.cpp gives there on any machine; where the CPU has AVX2 and FMA, most run
//! as ggml's own instruction sequences ([`avx2`]), tested bit for bit against them.
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

#[inline(always)]
fn pairs<'a, W: Block, A: Block>(w: &'a [u8], a: &'a [u8]) -> impl Iterator<Item = (&'a W, &'a A)> {
    as_blocks::<W>(w).iter().zip(as_blocks::<A>(a))
}

/// Eight lane chains over blocks: `d` and the 32 codes of each block against the
/// activation quants.
#[inline(always)]
fn lanes(acc: &mut [f32; 8], d: f32, codes: &[i8; 32], qs: &[i8; 32]) {
    // Products of pairs first, then pairs of pairs (the shape of `vpmaddwd`).
    let (c16, q16): ([i16; 32], [i16; 32]) = (codes.map(i16::from), qs.map(i16::from));
    let pairs: [i32; 16] =
        std::array::from_fn(|i| c16[2 * i] as i32 * q16[2 * i] as i32 + c16[2 * i + 1] as i32 * q16[2 * i + 1] as i32);
    let isum: [i32; 8] = std::array::from_fn(|j| pairs[2 * j] + pairs[2 * j + 1]);
    for (acc, &isum) in acc.iter_mut().zip(&isum) {
        *acc = d.mul_add(isum as f32, *acc);
    }
}

/// The 32 codes of a block of nibbles: low nibbles are elements 0..16, high 16..32.
#[inline(always)]
fn nibbles(qs: &[u8; 16]) -> [i8; 32] {
    let mut codes = [0i8; 32];
    for (i, &b) in qs.iter().enumerate() {
        codes[i] = (b & 0xF) as i8;
        codes[i + 16] = (b >> 4) as i8;
    }
    codes
}

/// Defines each kernel as its `#[inline(always)]` portable body, run where the CPU has
/// AVX2 and FMA by a copy compiled for them (then `mul_add` is one instruction rather
/// than a call, and the integer sums vectorize) or by the kernel named after `/` in
/// [`avx2`], which is ggml's own instruction sequence. All compute the same operations in
/// the same order, each exactly rounded: the same bits (tested).
macro_rules! kernels {
    (@avx2 $body:ident) => { $body };
    (@avx2 $body:ident $simd:ident) => { avx2::$simd };
    ($($(#[$doc:meta])* $name:ident => $body:ident $(/ $simd:ident)?;)*) => {$(
        $(#[$doc])*
        pub fn $name(w: &[u8], a: &[u8]) -> f32 {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                fn compiled_for_avx2(w: &[u8], a: &[u8]) -> f32 {
                    (kernels!(@avx2 $body $($simd)?))(w, a)
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU has the features the copy is compiled for.
                    return unsafe { compiled_for_avx2(w, a) };
                }
            }
            $body(w, a)
        }
    )*};
}

kernels! {
    /// `ggml_vec_dot_q4_1_q8_1` (AVX2).
    dot_q4_1_q8_1 => q4_1_q8_1 / q4_1_q8_1;
    /// `ggml_vec_dot_q8_0_q8_0` (AVX2); llamafile's `tinyBLAS_Q0_AVX`, which takes
    /// batches of two or more tokens, computes the same lanes and sums.
    dot_q8_0_q8_0 => q8_0_q8_0 / q8_0_q8_0;
    /// `ggml_vec_dot_q5_0_q8_0` (AVX2; llamafile's `tinyBLAS_Q0_AVX` for batches
    /// computes the same): the codes offset by 16.
    dot_q5_0_q8_0 => q5_0_q8_0 / q5_0_q8_0;
    /// `ggml_vec_dot_q6_K_q8_K` (AVX2). Lane l holds the integer sum, scales applied, of
    /// the codes (unsigned, 0..64) at positions 4l..4l+4 of each 32-code vector, less 32
    /// times the activation sums of 16-groups 2l and 2l+1 with their scales (the offset
    /// of the codes, taken in lanes of its own pairing); one fused chain per lane over
    /// the blocks.
    dot_q6_k_q8_k => q6_k_q8_k / q6_k_q8_k;
    /// Q4_K as ggml runs it on AVX2: rows repacked eight at a time (`q4_K_8x8_q8_K`), a
    /// token alone through `ggml_gemv_q4_K_8x8_q8_K`: one fused step per super-block for
    /// the scaled sums and one for the minimums, subtracted at the end.
    dot_q4_k_q8_k_gemv => q4_k_gemv;
    /// As [`dot_q4_k_q8_k_gemv`], for the tokens of a batch that ggml takes four at a
    /// time (`ggml_gemm_q4_K_8x8_q8_K`): a fused step per pair of 32-weight groups.
    dot_q4_k_q8_k_gemm => q4_k_gemm;
}

#[inline(always)]
fn q4_1_q8_1(w: &[u8], a: &[u8]) -> f32 {
    let (mut acc, mut mins) = ([0.0f32; 8], 0.0f32);
    for (w, a) in pairs::<BlockQ4_1, BlockQ8_1>(w, a) {
        mins = w.m.get().mul_add(a.s.get(), mins);
        lanes(&mut acc, w.d.get() * a.d.get(), &nibbles(&w.qs), &a.qs);
    }
    hsum8(acc) + mins
}

#[inline(always)]
fn q8_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (w, a) in pairs::<BlockQ8_0, BlockQ8_0>(w, a) {
        lanes(&mut acc, w.d.get() * a.d.get(), &w.qs, &a.qs);
    }
    hsum8(acc)
}

/// Q5_0's fifth bits as the sign fill of a code less 16: byte i of entry `b` is 0xF0
/// where bit i of `b` is clear (the code, 0..16, is negative once 16 is taken away).
const NEGATIVE: [u64; 256] = {
    let mut table = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut i = 0;
        while i < 8 {
            if b >> i & 1 == 0 {
                table[b] |= 0xF0 << (8 * i);
            }
            i += 1;
        }
        b += 1;
    }
    table
};

#[inline(always)]
fn q5_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (w, a) in pairs::<BlockQ5_0, BlockQ8_0>(w, a) {
        // A code less 16 is its nibble with the sign bits filled where the fifth bit is 0.
        let mut codes = nibbles(&w.qs);
        for (codes, &qh) in codes.chunks_exact_mut(8).zip(&w.qh) {
            let eight = u64::from_le_bytes(std::array::from_fn(|i| codes[i] as u8)) | NEGATIVE[qh as usize];
            codes.iter_mut().zip(eight.to_le_bytes()).for_each(|(c, b)| *c = b as i8);
        }
        lanes(&mut acc, w.d.get() * a.d.get(), &codes, &a.qs);
    }
    hsum8(acc)
}

#[inline(always)]
fn q6_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (w, a) in pairs::<BlockQ6K, BlockQ8K>(w, a) {
        let mut lane = [0i32; 8];
        // Element k = 128n + 32r + p: low bits from ql (r's parity picks the nibble,
        // r / 2 the half), high bits from qh, scale of its 16-group.
        for n in 0..2 {
            for r in 0..4 {
                let ql = &w.ql[64 * n + 32 * (r % 2)..][..32];
                let qh = &w.qh[32 * n..][..32];
                let (shift, high) = (4 * (r / 2) as u32, 2 * r as u32);
                let base = 128 * n + 32 * r;
                let (s0, s1) = (w.scales[base / 16] as i32, w.scales[base / 16 + 1] as i32);
                let qs = &a.qs[base..base + 32];
                let mut sums = [0i32; 8];
                for p in 0..32 {
                    let code = (((ql[p] >> shift) & 0xF) | (((qh[p] >> high) & 3) << 4)) as i32;
                    let scale = if p < 16 { s0 } else { s1 };
                    sums[p / 4] += scale * code * qs[p] as i32;
                }
                for (l, s) in lane.iter_mut().zip(&sums) {
                    *l += s;
                }
            }
        }
        for (l, v) in lane.iter_mut().enumerate() {
            *v -= 32 * (a.bsum(2 * l) * w.scales[2 * l] as i32 + a.bsum(2 * l + 1) * w.scales[2 * l + 1] as i32);
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
        let codes: i32 = bytes.iter().zip(qs).map(|(&b, &q)| ((b >> shift) & 0xF) as i32 * q as i32).sum();
        isum += sc as i32 * codes;
        imin += m as i32 * (a.bsum(2 * j) + a.bsum(2 * j + 1));
    }
    (isum, imin)
}

#[inline(always)]
fn q4_k_gemv(w: &[u8], a: &[u8]) -> f32 {
    q4_k_repacked(w, a, 8)
}

#[inline(always)]
fn q4_k_gemm(w: &[u8], a: &[u8]) -> f32 {
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

/// ggml's AVX2 kernels: a block's (or for Q6_K a 32-element group's) 32 codes as
/// bytes in one register, `maddubs` and `madd` making the eight lanes' exact integer
/// sums, one fused multiply-add per lane. The portable bodies above are their scalar
/// reference, bit for bit.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{hsum8, pairs};
    use crate::blocks::*;

    /// `acc + d × (lane sums of codes · qs)`: lane j sums elements 4j..4j+4. Exact for
    /// codes in -128..=127 against quants in -127..=127 (what ggml's quantizers make).
    #[inline(always)]
    fn lanes(acc: __m256, d: f32, codes: __m256i, qs: __m256i) -> __m256 {
        // SAFETY (all intrinsics here): only called from functions compiled for AVX2
        // and FMA, which run only where the CPU has them.
        unsafe {
            let products = _mm256_maddubs_epi16(_mm256_sign_epi8(codes, codes), _mm256_sign_epi8(qs, codes));
            let sums = _mm256_madd_epi16(products, _mm256_set1_epi16(1));
            _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sums), acc)
        }
    }

    /// A block's 16 bytes of nibbles as 32 codes: low nibbles first, then high.
    #[inline(always)]
    fn nibbles(qs: &[u8; 16]) -> __m256i {
        unsafe {
            let bytes = _mm_loadu_si128(qs.as_ptr().cast());
            let mask = _mm_set1_epi8(0xF);
            _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask))
        }
    }

    #[inline(always)]
    fn load(qs: &[i8; 32]) -> __m256i {
        unsafe { _mm256_loadu_si256(qs.as_ptr().cast()) }
    }

    #[inline(always)]
    fn finish(acc: __m256) -> f32 {
        let mut lanes = [0.0f32; 8];
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        hsum8(lanes)
    }

    #[target_feature(enable = "avx2,fma")]
    pub fn q4_1_q8_1(w: &[u8], a: &[u8]) -> f32 {
        let (mut acc, mut mins) = (_mm256_setzero_ps(), 0.0f32);
        for (w, a) in pairs::<BlockQ4_1, BlockQ8_1>(w, a) {
            mins = w.m.get().mul_add(a.s.get(), mins);
            acc = lanes(acc, w.d.get() * a.d.get(), nibbles(&w.qs), load(&a.qs));
        }
        finish(acc) + mins
    }

    #[target_feature(enable = "avx2,fma")]
    pub fn q8_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (w, a) in pairs::<BlockQ8_0, BlockQ8_0>(w, a) {
            acc = lanes(acc, w.d.get() * a.d.get(), load(&w.qs), load(&a.qs));
        }
        finish(acc)
    }

    #[target_feature(enable = "avx2,fma")]
    pub fn q6_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let (low4, low2) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(3));
        let load32 = |bytes: &[u8]| unsafe { _mm256_loadu_si256(bytes[..32].as_ptr().cast()) };
        for (w, a) in pairs::<BlockQ6K, BlockQ8K>(w, a) {
            let mut sums = _mm256_setzero_si256();
            for n in 0..2 {
                let (ql, qh) = ([load32(&w.ql[64 * n..]), load32(&w.ql[64 * n + 32..])], load32(&w.qh[32 * n..]));
                for r in 0..4 {
                    // Codes 128n + 32r + 0..32: low bits from a nibble of ql, high from qh.
                    let low = _mm256_and_si256(_mm256_srl_epi16(ql[r % 2], _mm_cvtsi32_si128(4 * (r / 2) as i32)), low4);
                    let high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * r as i32)), low2);
                    let codes = _mm256_or_si256(low, _mm256_slli_epi16::<4>(high));
                    let base = 128 * n + 32 * r;
                    let qs = unsafe { _mm256_loadu_si256(a.qs[base..base + 32].as_ptr().cast()) };
                    let (s0, s1) = (w.scales[base / 16] as i16, w.scales[base / 16 + 1] as i16);
                    let scales = _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0));
                    sums = _mm256_add_epi32(sums, _mm256_madd_epi16(scales, _mm256_maddubs_epi16(codes, qs)));
                }
            }
            // The codes' offset of 32, from the activations' 16-sums.
            let bsums = unsafe { _mm256_loadu_si256(a.bsums.as_ptr().cast()) };
            let scales = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(w.scales.as_ptr().cast()) });
            sums = _mm256_sub_epi32(sums, _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, scales)));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(a.d() * w.d.get()), _mm256_cvtepi32_ps(sums), acc);
        }
        finish(acc)
    }

    #[target_feature(enable = "avx2,fma")]
    pub fn q5_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (w, a) in pairs::<BlockQ5_0, BlockQ8_0>(w, a) {
            // ggml's `bytes_from_bits_32`: 0xF0 in each byte whose fifth bit is clear,
            // OR-ed into the nibble, is the code less 16.
            let qh = u32::from_le_bytes(w.qh);
            let spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32(qh as i32),
                _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0),
            );
            let bit = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
            let set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, bit), _mm256_set1_epi64x(-1));
            let fill = _mm256_andnot_si256(set, _mm256_set1_epi8(0xF0u8 as i8));
            acc = lanes(acc, w.d.get() * a.d.get(), _mm256_or_si256(nibbles(&w.qs), fill), load(&a.qs));
        }
        finish(acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::ActType;
    use crate::GgmlType;

    /// Against astra's scalar reference (itself tested against f64): the same terms,
    /// so they differ only by float association, within f32 rounding of the terms'
    /// magnitudes. And the copy compiled for AVX2 and FMA gives the portable code's bits.
    #[test]
    fn ggml_dots_are_the_reference_dot_product() {
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
        use crate::dot::scalar;
        type Dot = fn(&[u8], &[u8]) -> f32;
        // Each kernel, its portable body, and astra's scalar reference.
        let cases: [(GgmlType, Dot, Dot, Dot); 6] = [
            (GgmlType::Q4_1, dot_q4_1_q8_1, q4_1_q8_1, scalar::dot_q4_1_q8_1),
            (GgmlType::Q8_0, dot_q8_0_q8_0, q8_0_q8_0, scalar::dot_q8_0_q8_0),
            (GgmlType::Q5_0, dot_q5_0_q8_0, q5_0_q8_0, scalar::dot_q5_0_q8_0),
            (GgmlType::Q6_K, dot_q6_k_q8_k, q6_k_q8_k, scalar::dot_q6_k_q8_k),
            (GgmlType::Q4_K, dot_q4_k_q8_k_gemv, q4_k_gemv, scalar::dot_q4_k_q8_k),
            (GgmlType::Q4_K, dot_q4_k_q8_k_gemm, q4_k_gemm, scalar::dot_q4_k_q8_k),
        ];
        for (ty, dot, portable, reference) in cases {
            let wq = match ty {
                // No quantizer for the K-quants here: random codes, small f16 scales.
                GgmlType::Q4_K | GgmlType::Q6_K => {
                    let mut bytes: Vec<u8> = (0..crate::row_bytes(ty, n).unwrap()).map(|_| (next().to_bits() >> 7) as u8).collect();
                    for b in bytes.chunks_exact_mut(crate::row_bytes(ty, QK_K).unwrap()) {
                        let scales = if ty == GgmlType::Q4_K { 0..4 } else { b.len() - 2..b.len() };
                        for at in scales.step_by(2) {
                            b[at..at + 2].copy_from_slice(&half::f16::from_f32(0.01 + 0.01 * next().abs()).to_le_bytes());
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
            assert!((got - want).abs() <= 1e-6 * magnitude, "{ty:?}: {got} vs {want}");
            assert_ne!(got, 0.0);
            // Where the CPU has AVX2 and FMA, `dot` ran the copy compiled for them.
            assert_eq!(got.to_bits(), portable(&wq, &aq).to_bits(), "{ty:?}: the AVX2 copy's bits");
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
