//! AVX-512 VNNI dot products that take two 32-element blocks per 512-bit vector.
//!
//! A 512-bit `vpdpbusd` multiplies 64 weight bytes with 64 activation bytes: two
//! blocks at once, block i in lanes 0..8 and block i + 1 in lanes 8..16. The two
//! blocks' scale products are spread over their lanes and multiplied in with one FMA,
//! so even blocks accumulate in the low lanes and odd blocks in the high ones; the 16
//! lanes are summed at the end. That is a different association of the float sums
//! from the AVX2 kernels' (parity bound against the scalar reference: relative L2 ≤
//! 1e-6), but one fixed sequence per (row, token) whatever the batch, as everywhere.
//!
//! Activations come as [`ActRow`]s whose `quants` are contiguous, so one 64-byte
//! load covers two blocks.
//!
//! Safety: every kernel here requires AVX-512 F/BW/VL/VNNI and AVX2/FMA/F16C. They are
//! reachable only through [`kernels`], which `Kernels::new` calls for
//! `Isa::Avx512Vnni` after checking `Isa::available`.

use std::arch::x86_64::*;

use super::{ActRow, ActType, VecDot1Fn, VecDot4Fn, VecDotFn};
use crate::blocks::*;
use crate::GgmlType;

/// Weight rows walked together against one token (see `avx2::DECODE_ROWS`).
const DECODE_ROWS: usize = 4;

/// The kernels for a weight type, if this set has its own.
pub(crate) fn kernels(weights: GgmlType) -> Option<(VecDotFn, VecDot1Fn, VecDot4Fn)> {
    match weights {
        GgmlType::Q4_1 => Some(super::row_entries!(rows, Q4_1Pairs, ActType::Q8_1, DECODE_ROWS)),
        GgmlType::Q5_0 => Some(super::row_entries!(rows, Signed<Q5_0Codes>, ActType::Q8_0, DECODE_ROWS)),
        GgmlType::Q8_0 => Some(super::row_entries!(rows, Signed<Q8_0Codes>, ActType::Q8_0, DECODE_ROWS)),
        _ => None,
    }
}

/// The sum of 16 lanes: the halves added, then `avx2`'s 8-lane order.
#[inline(always)]
unsafe fn hsum16(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    let s = _mm256_add_ps(lo, hi);
    let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Two blocks' 16 bytes of nibbles as 64 codes in the activations' order: block 0's
/// low nibbles, its high nibbles, then block 1's.
#[inline(always)]
unsafe fn nibbles2(qs0: &[u8; 16], qs1: &[u8; 16]) -> __m512i {
    let x = _mm256_set_m128i(_mm_loadu_si128(qs1.as_ptr().cast()), _mm_loadu_si128(qs0.as_ptr().cast()));
    let y = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(x), _mm256_srli_epi16::<4>(x));
    _mm512_and_si512(_mm512_shuffle_i64x2::<0b11_01_10_00>(y, y), _mm512_set1_epi8(0x0F))
}

/// One block's nibbles as 32 codes: the low nibbles, then the high ones.
#[inline(always)]
unsafe fn nibbles1(qs: &[u8; 16]) -> __m256i {
    let x = _mm_loadu_si128(qs.as_ptr().cast());
    _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(x), x), _mm256_set1_epi8(0x0F))
}

/// Four f16 values (as the u16s of a u64, lowest first) to f32.
#[inline(always)]
unsafe fn f16x4(bits: u64) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi64_si128(bits as i64))
}

/// A kernel taking two blocks per vector: what it needs of an activation row, and its
/// dot products of M weight rows with N activation rows.
trait PairKernel {
    type W: Block;
    /// Whether `a` fits weight rows of `blocks` blocks.
    fn fits(a: &ActRow, blocks: usize) -> bool;
    /// # Safety
    /// The features of [`rows`]; every `w[m]` has as many blocks as `w[0]`, and every
    /// `a[r]` fits rows of that many.
    unsafe fn dot<const M: usize, const N: usize>(w: [&[Self::W]; M], a: &[ActRow; N]) -> [[f32; N]; M];
}

/// `out[i] = K·(row i of w, a)` for consecutive rows of `row_bytes`, M rows at a time,
/// the activation rows checked once.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn rows<K: PairKernel, const M: usize, const N: usize>(w: &[u8], row_bytes: usize, a: [ActRow<'_>; N], out: &mut [[f32; N]]) {
    assert!(row_bytes > 0 && w.len() == row_bytes * out.len(), "weights are not out.len() rows");
    let blocks = row_bytes / std::mem::size_of::<K::W>();
    assert!(a.iter().all(|r| K::fits(r, blocks)), "activation row does not match the weights");
    let row = |i: usize| as_blocks::<K::W>(&w[i * row_bytes..(i + 1) * row_bytes]);
    let whole = out.len() / M * M;
    for first in (0..whole).step_by(M) {
        let mut rows: [&[K::W]; M] = [&[]; M];
        for (m, r) in rows.iter_mut().enumerate() {
            *r = row(first + m);
        }
        if N == 1 {
            super::avx2::prefetch_ahead(w, (first + 4 * M) * row_bytes, M * row_bytes);
        }
        out[first..first + M].copy_from_slice(&K::dot::<M, N>(rows, &a));
    }
    for (i, o) in out.iter_mut().enumerate().skip(whole) {
        *o = K::dot::<1, N>([row(i)], &a)[0];
    }
}

struct Q4_1Pairs;

impl PairKernel for Q4_1Pairs {
    type W = BlockQ4_1;
    fn fits(a: &ActRow, blocks: usize) -> bool {
        a.quants.len() == 32 * blocks && a.scales.len() == 2 * blocks
    }
    #[inline(always)]
    unsafe fn dot<const M: usize, const N: usize>(w: [&[BlockQ4_1]; M], a: &[ActRow; N]) -> [[f32; N]; M] {
        dot_q4_1(w, a)
    }
}

/// Q4_1 (see [`PairKernel::dot`]): unsigned codes times the activations, plus the
/// minimum times the activations' block sums.
#[inline(always)]
unsafe fn dot_q4_1<const M: usize, const N: usize>(w: [&[BlockQ4_1]; M], a: &[ActRow; N]) -> [[f32; N]; M] {
    let (mut q, mut s) = ([std::ptr::null(); N], [std::ptr::null(); N]);
    for r in 0..N {
        (q[r], s[r]) = (a[r].quants.as_ptr(), a[r].scales.as_ptr());
    }
    let nb = w[0].len();
    let mut acc = [[_mm512_setzero_ps(); N]; M];
    // Lanes [d·d, m·s, d·d, m·s] of the block pairs: lanes 1 and 3 sum the minimums.
    let mut mins = [[_mm_setzero_ps(); N]; M];
    // Lane j of the scale vector: product 0 (block i) for j < 8, product 2 (block i + 1) above.
    let spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    let scale_bits = |b: &BlockQ4_1| u16::from_le_bytes(b.d.0) as u64 | (u16::from_le_bytes(b.m.0) as u64) << 16;
    for p in 0..nb / 2 {
        let i = 2 * p;
        for m in 0..M {
            let (b0, b1) = (w[m].get_unchecked(i), w[m].get_unchecked(i + 1));
            let wq = nibbles2(&b0.qs, &b1.qs);
            let wsc = f16x4(scale_bits(b0) | scale_bits(b1) << 32);
            for r in 0..N {
                let aq = _mm512_loadu_si512(q[r].add(64 * p).cast());
                let dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, aq);
                let prods = _mm_mul_ps(wsc, _mm_loadu_ps(s[r].add(4 * p)));
                let sc = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(prods));
                acc[m][r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(dp), acc[m][r]);
                mins[m][r] = _mm_add_ps(mins[m][r], prods);
            }
        }
    }
    if nb % 2 == 1 {
        // The last block alone, in the low lanes (the high ones get zeros).
        let i = nb - 1;
        for m in 0..M {
            let b0 = w[m].get_unchecked(i);
            let wq = _mm512_zextsi256_si512(nibbles1(&b0.qs));
            let wsc = f16x4(scale_bits(b0));
            for r in 0..N {
                let aq = _mm512_zextsi256_si512(_mm256_loadu_si256(q[r].add(32 * i).cast()));
                let dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, aq);
                let ds = _mm_castpd_ps(_mm_load_sd(s[r].add(2 * i).cast()));
                let prods = _mm_mul_ps(wsc, ds);
                let sc = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(prods));
                acc[m][r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(dp), acc[m][r]);
                mins[m][r] = _mm_add_ps(mins[m][r], prods);
            }
        }
    }
    let mut out = [[0.0; N]; M];
    for m in 0..M {
        for r in 0..N {
            let v = mins[m][r];
            out[m][r] = hsum16(acc[m][r]) + (_mm_cvtss_f32(_mm_movehdup_ps(v)) + _mm_cvtss_f32(_mm_shuffle_ps::<0b11>(v, v)));
        }
    }
    out
}

/// A weight format of 32-element blocks with one f16 scale and signed codes, read as
/// unsigned codes `c + OFFSET` (so that `vpdpbusd` can take them) with the offset
/// taken back through the activations' four-quant sums: Σ c·a = Σ (c + 2^SHIFT)·a −
/// 2^SHIFT·Σ a, all in exact i32 lanes.
trait SignedCodes {
    type W: Block;
    /// log2 of the offset.
    const SHIFT: u32;
    fn d(b: &Self::W) -> F16Le;
    /// Two blocks' offset codes: block 0 in bytes 0..32, block 1 in 32..64.
    unsafe fn codes2(b0: &Self::W, b1: &Self::W) -> __m512i;
    /// One block's offset codes in bytes 0..32.
    unsafe fn codes1(b0: &Self::W) -> __m256i;
}

struct Q5_0Codes;
struct Q8_0Codes;

/// A [`PairKernel`] for a [`SignedCodes`] format.
struct Signed<K>(std::marker::PhantomData<K>);

impl<K: SignedCodes> PairKernel for Signed<K> {
    type W = K::W;
    fn fits(a: &ActRow, blocks: usize) -> bool {
        a.quants.len() == 32 * blocks && a.scales.len() == blocks && a.neg_sums4.len() == 8 * blocks
    }
    #[inline(always)]
    unsafe fn dot<const M: usize, const N: usize>(w: [&[K::W]; M], a: &[ActRow; N]) -> [[f32; N]; M] {
        dot_signed::<K, M, N>(w, a)
    }
}

impl SignedCodes for Q5_0Codes {
    type W = BlockQ5_0;
    const SHIFT: u32 = 4;
    fn d(b: &BlockQ5_0) -> F16Le {
        b.d
    }
    #[inline(always)]
    unsafe fn codes2(b0: &BlockQ5_0, b1: &BlockQ5_0) -> __m512i {
        let nibbles = nibbles2(&b0.qs, &b1.qs);
        // Bit j of a block's qh is its element j's fifth bit: code + 16 where set.
        let high = u32::from_le_bytes(b0.qh) as u64 | (u32::from_le_bytes(b1.qh) as u64) << 32;
        _mm512_mask_add_epi8(nibbles, high, nibbles, _mm512_set1_epi8(16))
    }
    #[inline(always)]
    unsafe fn codes1(b0: &BlockQ5_0) -> __m256i {
        let nibbles = nibbles1(&b0.qs);
        _mm256_mask_add_epi8(nibbles, u32::from_le_bytes(b0.qh), nibbles, _mm256_set1_epi8(16))
    }
}

impl SignedCodes for Q8_0Codes {
    type W = BlockQ8_0;
    const SHIFT: u32 = 7;
    fn d(b: &BlockQ8_0) -> F16Le {
        b.d
    }
    #[inline(always)]
    unsafe fn codes2(b0: &BlockQ8_0, b1: &BlockQ8_0) -> __m512i {
        let lo = _mm512_castsi256_si512(_mm256_loadu_si256(b0.qs.as_ptr().cast()));
        let x = _mm512_inserti64x4::<1>(lo, _mm256_loadu_si256(b1.qs.as_ptr().cast()));
        _mm512_xor_si512(x, _mm512_set1_epi8(-128))
    }
    #[inline(always)]
    unsafe fn codes1(b0: &BlockQ8_0) -> __m256i {
        _mm256_xor_si256(_mm256_loadu_si256(b0.qs.as_ptr().cast()), _mm256_set1_epi8(-128))
    }
}

/// A [`SignedCodes`] format (see [`PairKernel::dot`]).
#[inline(always)]
unsafe fn dot_signed<K: SignedCodes, const M: usize, const N: usize>(w: [&[K::W]; M], a: &[ActRow; N]) -> [[f32; N]; M] {
    let (mut q, mut s, mut g) = ([std::ptr::null(); N], [std::ptr::null(); N], [std::ptr::null(); N]);
    for r in 0..N {
        (q[r], s[r], g[r]) = (a[r].quants.as_ptr(), a[r].scales.as_ptr(), a[r].neg_sums4.as_ptr());
    }
    let nb = w[0].len();
    let mut acc = [[_mm512_setzero_ps(); N]; M];
    let spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let bits = |b: &K::W| u16::from_le_bytes(K::d(b).0) as u64;
    for p in 0..nb / 2 {
        let i = 2 * p;
        for m in 0..M {
            let (b0, b1) = (w[m].get_unchecked(i), w[m].get_unchecked(i + 1));
            let wq = K::codes2(b0, b1);
            let wsc = f16x4(bits(b0) | bits(b1) << 16);
            for r in 0..N {
                let offset = _mm512_sll_epi32(_mm512_loadu_si512(g[r].add(16 * p).cast()), _mm_cvtsi32_si128(K::SHIFT as i32));
                let dp = _mm512_dpbusd_epi32(offset, wq, _mm512_loadu_si512(q[r].add(64 * p).cast()));
                let ds = _mm_castpd_ps(_mm_load_sd(s[r].add(i).cast()));
                let sc = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(wsc, ds)));
                acc[m][r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(dp), acc[m][r]);
            }
        }
    }
    if nb % 2 == 1 {
        // The last block alone, in the low lanes (the high ones get zeros).
        let i = nb - 1;
        for m in 0..M {
            let b0 = w[m].get_unchecked(i);
            let wq = _mm512_zextsi256_si512(K::codes1(b0));
            let wsc = f16x4(bits(b0));
            for r in 0..N {
                let offset = _mm512_zextsi256_si512(_mm256_loadu_si256(g[r].add(8 * i).cast()));
                let offset = _mm512_sll_epi32(offset, _mm_cvtsi32_si128(K::SHIFT as i32));
                let aq = _mm512_zextsi256_si512(_mm256_loadu_si256(q[r].add(32 * i).cast()));
                let dp = _mm512_dpbusd_epi32(offset, wq, aq);
                let ds = _mm_load_ss(s[r].add(i));
                let sc = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(wsc, ds)));
                acc[m][r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(dp), acc[m][r]);
            }
        }
    }
    let mut out = [[0.0; N]; M];
    for m in 0..M {
        for r in 0..N {
            out[m][r] = hsum16(acc[m][r]);
        }
    }
    out
}
