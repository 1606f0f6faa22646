//! AVX2 + FMA + F16C dot products, one per weight type, with the signatures and the
//! integer arithmetic of `dot::scalar`.
//!
//! Each block's integer dot product is computed in 8 i32 lanes (exact), converted to
//! f32 and multiplied into 8 f32 accumulators with the block's scale; the lanes are
//! summed at the end. The result therefore differs from the scalar reference only in
//! the association of the float sums (parity bound: relative L2 ≤ 1e-6). Q4_1, Q5_0
//! and Q8_0 are not here: they run eight rows in lanes (`avx2_lanes`).
//!
//! Safety: every kernel here requires AVX2, FMA and F16C. They are reachable only
//! through [`dot_fn`], which `Kernels::new` calls after checking `Isa::Avx2.available()`.

use std::arch::x86_64::*;

use super::{ActRow, VecDot4Fn, VecDotFn};
use crate::blocks::*;
use crate::dequant::{
    iq2s_grid_point, iq2s_signs, iq2xxs_group, iq2xxs_point, iq3s_grid_point, iq3s_scale,
};
use crate::iq2xs_grid::IQ2XS_GRID;
use crate::GgmlType;

/// The kernels for a weight type: the dot product on bytes, and the four-token variant
/// where there is one.
pub(crate) fn kernels(weights: GgmlType) -> Option<(VecDotFn, Option<VecDot4Fn>)> {
    use GgmlType::*;
    // A K-quant kernel over N activation rows of bytes, run along consecutive rows.
    macro_rules! four {
        ($f:ident) => {{
            fn wrapper(w: &[u8], row_bytes: usize, a: [ActRow; 4], out: &mut [[f32; 4]]) {
                assert_eq!(
                    w.len(),
                    row_bytes * out.len(),
                    "weights are not out.len() rows"
                );
                let a = a.map(|r| r.bytes);
                for (row, o) in w.chunks_exact(row_bytes.max(1)).zip(out) {
                    // SAFETY: only handed out when AVX2/FMA/F16C are present (module doc).
                    *o = unsafe { $f(row, a) };
                }
            }
            Some(wrapper as VecDot4Fn)
        }};
    }
    Some(match weights {
        F32 => (avx2_dot_fn!(dot_f32_f32), None),
        F16 => (avx2_dot_fn!(dot_f16_f32), None),
        BF16 => (avx2_dot_fn!(dot_bf16_f32), None),
        Q4_0 => (avx2_dot_fn!(dot_q4_0_q8_0), None),
        Q5_1 => (avx2_dot_fn!(dot_q5_1_q8_1), None),
        IQ4_NL => (avx2_dot_fn!(dot_iq4_nl_q8_0), None),
        Q2_0 => (avx2_dot_fn!(dot_q2_0_q8_0), None),
        Q2_K => (avx2_dot_fn!(dot_q2_k_q8_k), None),
        Q3_K => (avx2_dot_fn!(dot_q3_k_q8_k), None),
        Q4_K => (avx2_dot_fn!(dot_q4_k_q8_k), four!(dotn_q4_k_q8_k)),
        Q5_K => (avx2_dot_fn!(dot_q5_k_q8_k), None),
        Q6_K => (avx2_dot_fn!(dot_q6_k_q8_k), four!(dotn_q6_k_q8_k)),
        Q8_K => (avx2_dot_fn!(dot_q8_k_q8_k), None),
        IQ2_XXS => (avx2_dot_fn!(dot_iq2_xxs_q8_k), None),
        IQ2_XS => (avx2_dot_fn!(dot_iq2_xs_q8_k), None),
        IQ2_S => (avx2_dot_fn!(dot_iq2_s_q8_k), None),
        IQ3_S => (avx2_dot_fn!(dot_iq3_s_q8_k), None),
        _ => return None,
    })
}

// ------------------------------------------------------------------ helpers

/// Two f16 scales to f32 with one F16C conversion (the `half` crate calls out to a
/// converter unless F16C is enabled for the whole build). The halves are combined in a
/// general register and moved in whole: inserting a 16-bit load into a vector register
/// would make the conversion wait on whatever register the compiler picks to insert
/// into, which can be the previous block's accumulator.
#[inline(always)]
pub(super) unsafe fn f16_pair(lo: F16Le, hi: F16Le) -> (f32, f32) {
    let bits = u16::from_le_bytes(lo.0) as u32 | (u16::from_le_bytes(hi.0) as u32) << 16;
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

/// The product of two f16 scales.
#[inline(always)]
unsafe fn f16_mul(x: F16Le, y: F16Le) -> f32 {
    let (x, y) = f16_pair(x, y);
    x * y
}

#[inline(always)]
unsafe fn f16(x: F16Le) -> f32 {
    f16_pair(x, x).0
}

#[inline(always)]
pub(super) unsafe fn hsum_f32(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// The exact sum of eight i32 lanes.
#[inline(always)]
pub(super) unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s)))
}

/// The exact sums of the eight i32 lanes of `x` and of `y`.
#[inline(always)]
unsafe fn hsum2_i32(x: __m256i, y: __m256i) -> (i32, i32) {
    // hadd works within 128-bit halves: twice leaves each half's total of x in its
    // lane 0 and of y in its lane 1.
    let h = _mm256_hadd_epi32(x, y);
    let h = _mm256_hadd_epi32(h, h);
    let s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
    (_mm_cvtsi128_si32(s), _mm_extract_epi32::<1>(s))
}

/// Decode streams the weights once: asks for `len` bytes of `w` from `at` (clipped to
/// `w`) ahead of their use, a few row groups early, so that their loads overlap the
/// arithmetic on the rows before them.
#[inline(always)]
pub(super) unsafe fn prefetch_ahead(w: &[u8], at: usize, len: usize) {
    for p in (at..(at + len).min(w.len())).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().add(p).cast());
    }
}

/// Tiles past the next one that a batch tile asks for ([`Ahead`]). Of the distances
/// tried in `matmul_batch` (0, 1, 2, 3 and 5 tiles past the next; a tile of SmolLM2's
/// 576 columns is 5.8 KB), two and five were the fastest, asked into L2; into L1 (at
/// one) or L3 (at two) was slower than into L2 at the same distance.
const TILES_AHEAD: usize = 2;

/// A batch tile's requests for the tile [`TILES_AHEAD`] past the next one, into L2,
/// spread evenly over the steps of its arithmetic: within a task's run of rows the
/// tiles are contiguous and the same size, so each is asked for while the tiles before
/// it compute (a run's first tiles are not asked for ahead, and its last ones ask for
/// rows past it, which another task may be computing). Into L2 rather than L1, and
/// spread rather than in a burst: a prefetch waits for a free miss buffer, and a burst
/// of L1 prefetches one tile ahead stalled the arithmetic beside them. A prefetch of an
/// address past the weights is harmless.
pub(super) struct Ahead {
    next: *const u8,
    end: *const u8,
    /// Bytes asked for per step (whole lines).
    per_step: usize,
}

impl Ahead {
    /// For a tile (`tile`, the weight bytes of its rows) whose arithmetic takes `steps`
    /// calls of [`Ahead::step`].
    #[inline(always)]
    pub(super) fn new(tile: &[u8], steps: usize) -> Ahead {
        let next = tile.as_ptr().wrapping_add((TILES_AHEAD + 1) * tile.len());
        Ahead {
            next,
            end: next.wrapping_add(tile.len()),
            per_step: 64 * tile.len().div_ceil(64).div_ceil(steps.max(1)),
        }
    }

    /// Asks for this step's share of the lines.
    ///
    /// # Safety
    /// None beyond x86-64's SSE: a prefetch never faults, whatever the address.
    #[inline(always)]
    pub(super) unsafe fn step(&mut self) {
        let stop = self.next.wrapping_add(self.per_step).min(self.end);
        while self.next < stop {
            _mm_prefetch::<_MM_HINT_T1>(self.next.cast());
            self.next = self.next.wrapping_add(64);
        }
    }
}

#[inline(always)]
pub(super) unsafe fn load(p: &[i8]) -> __m256i {
    debug_assert!(p.len() >= 32);
    _mm256_loadu_si256(p.as_ptr().cast())
}

#[inline(always)]
pub(super) unsafe fn load_u8(p: &[u8]) -> __m256i {
    debug_assert!(p.len() >= 32);
    _mm256_loadu_si256(p.as_ptr().cast())
}

/// 16 bytes of nibbles → 32 lanes: the low nibbles, then the high nibbles.
#[inline(always)]
pub(super) unsafe fn nibbles(qs: &[u8; 16]) -> __m256i {
    let x = _mm_loadu_si128(qs.as_ptr().cast());
    let hi = _mm_srli_epi16(x, 4);
    _mm256_and_si256(_mm256_set_m128i(hi, x), _mm256_set1_epi8(0x0F))
}

/// Lane k = 0xFF where bit k of `x` is set, else 0.
#[inline(always)]
pub(super) unsafe fn bits_to_bytes(x: u32) -> __m256i {
    let shuffle = _mm256_set_epi64x(
        0x0303030303030303,
        0x0202020202020202,
        0x0101010101010101,
        0x0000000000000000,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuffle);
    // Byte j of each 8 has every bit set but bit j: the OR is all ones iff bit j is set.
    let all_but_bit = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, all_but_bit), _mm256_set1_epi64x(-1))
}

/// Σ of products of unsigned bytes `x` with signed bytes `y`, in 8 i32 lanes
/// (pairs must not exceed i16: |x| · |y| · 2 ≤ 32767).
#[inline(always)]
unsafe fn dot_u8_i8(x: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))
}

/// Σ of products of signed bytes, in 8 i32 lanes (`y` must not hold -128).
#[inline(always)]
pub(super) unsafe fn dot_i8(x: __m256i, y: __m256i) -> __m256i {
    dot_u8_i8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}

/// Two i16 scales: the first for lanes 0..16 (the low 128 bits), the second for 16..32.
#[inline(always)]
pub(super) unsafe fn scale_pair(lo: i16, hi: i16) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))
}

#[inline(always)]
pub(super) unsafe fn srl16(x: __m256i, n: i32) -> __m256i {
    _mm256_srl_epi16(x, _mm_cvtsi32_si128(n))
}

// ------------------------------------------------------------------ 32-blocks × Q8_0

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (w, a) in as_blocks::<BlockQ4_0>(w)
        .iter()
        .zip(as_blocks::<BlockQ8_0>(a))
    {
        let qx = _mm256_sub_epi8(nibbles(&w.qs), _mm256_set1_epi8(8));
        let p = _mm256_cvtepi32_ps(dot_i8(qx, load(&a.qs)));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_mul(w.d, a.d)), p, acc);
    }
    hsum_f32(acc)
}

/// The products (d_w·d_a, m_w·s_a) of a Q4_1/Q5_1 block and its Q8_1 activations, from
/// one conversion of the four f16 scales: lanes [d_w, m_w, d_a, s_a].
#[inline(always)]
unsafe fn scale_products(wd: F16Le, wm: F16Le, ad: F16Le, as_: F16Le) -> __m128 {
    let bits = |x: F16Le| u16::from_le_bytes(x.0) as u64;
    let packed = bits(wd) | bits(wm) << 16 | bits(ad) << 32 | bits(as_) << 48;
    let v = _mm_cvtph_ps(_mm_cvtsi64_si128(packed as i64));
    _mm_mul_ps(v, _mm_movehl_ps(v, v))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_1_q8_1(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut mins = _mm_setzero_ps();
    for (w, a) in as_blocks::<BlockQ5_1>(w)
        .iter()
        .zip(as_blocks::<BlockQ8_1>(a))
    {
        let high = _mm256_and_si256(
            bits_to_bytes(u32::from_le_bytes(w.qh)),
            _mm256_set1_epi8(0x10),
        );
        let qx = _mm256_or_si256(nibbles(&w.qs), high);
        let p = _mm256_cvtepi32_ps(dot_u8_i8(qx, load(&a.qs)));
        let prods = scale_products(w.d, w.m, a.d, a.s);
        acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(prods), p, acc);
        mins = _mm_add_ps(mins, prods);
    }
    hsum_f32(acc) + _mm_cvtss_f32(_mm_movehdup_ps(mins))
}

// ------------------------------------------------------------------ 256-blocks, N rows

/// N activation rows at once. Each super-block's integer sum is exact; the float chains
/// `acc ← fma(Σ, d·d_a, acc)` and `min ← fma(Σ m·bsum, dmin·d_a, min)` then run over the
/// super-blocks in order: the arithmetic that the AVX-512 tiles repeat lane by lane.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dotn_q4_k_q8_k<const N: usize>(w: &[u8], a: [&[u8]; N]) -> [f32; N] {
    let w = as_blocks::<BlockQ4K>(w);
    let a = a.map(as_blocks::<BlockQ8K>);
    let (mut acc, mut mins) = ([0.0f32; N], [0.0f32; N]);
    let m4 = _mm256_set1_epi8(0x0F);
    for (i, wb) in w.iter().enumerate() {
        let (sc, mins16) = k4_scales_mins(&wb.scales);
        let mut sumi = [_mm256_setzero_si256(); N];
        for j in 0..4 {
            let q4 = load_u8(&wb.qs[32 * j..]);
            let lo = _mm256_and_si256(q4, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
            let sc_lo = _mm256_set1_epi16(scale_of(sc, 2 * j));
            let sc_hi = _mm256_set1_epi16(scale_of(sc, 2 * j + 1));
            for r in 0..N {
                let ab = &a[r][i];
                let p_lo =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load(&ab.qs[64 * j..])), sc_lo);
                let p_hi =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load(&ab.qs[64 * j + 32..])), sc_hi);
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p_lo, p_hi));
            }
        }
        let (wd, wdmin) = f16_pair(wb.d, wb.dmin);
        for r in 0..N {
            let ab = &a[r][i];
            let da = ab.d();
            let (s, m) = hsum2_i32(sumi[r], k4_min_lanes(mins16, ab));
            acc[r] = (s as f32).mul_add(wd * da, acc[r]);
            mins[r] = (m as f32).mul_add(wdmin * da, mins[r]);
        }
    }
    std::array::from_fn(|r| acc[r] - mins[r])
}

/// N activation rows at once, in the arithmetic of `dotn_q4_k_q8_k` (no minimum: the
/// codes' offset of 32 is inside the exact integer sum).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dotn_q6_k_q8_k<const N: usize>(w: &[u8], a: [&[u8]; N]) -> [f32; N] {
    let w = as_blocks::<BlockQ6K>(w);
    let a = a.map(as_blocks::<BlockQ8K>);
    let mut acc = [0.0f32; N];
    let (m4, m3) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
    for (i, wb) in w.iter().enumerate() {
        let mut sumi = [_mm256_setzero_si256(); N];
        // Each 16-element scale against its activations' sum, for the codes' offset.
        let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wb.scales.as_ptr().cast()));
        for n in 0..2 {
            let ql0 = load_u8(&wb.ql[64 * n..]);
            let ql1 = load_u8(&wb.ql[64 * n + 32..]);
            let qh = load_u8(&wb.qh[32 * n..]);
            // The two high bits at `shift`, moved above the four low ones (a function,
            // not a closure, so that its intrinsics inline).
            #[inline(always)]
            unsafe fn high(qh: __m256i, shift: i32, m3: __m256i) -> __m256i {
                _mm256_slli_epi16(_mm256_and_si256(srl16(qh, shift), m3), 4)
            }
            let quarters = [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), high(qh, 0, m3)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), high(qh, 2, m3)),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                    high(qh, 4, m3),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                    high(qh, 6, m3),
                ),
            ];
            for (q_r, q) in quarters.into_iter().enumerate() {
                let g = 8 * n + 2 * q_r;
                let sc = scale_pair(wb.scales[g] as i16, wb.scales[g + 1] as i16);
                for r in 0..N {
                    let y = load(&a[r][i].qs[128 * n + 32 * q_r..]);
                    sumi[r] = _mm256_add_epi32(
                        sumi[r],
                        _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), sc),
                    );
                }
            }
        }
        let wd = f16(wb.d);
        for r in 0..N {
            // Σ sc·(q − 32)·a = Σ sc·q·a − 32 · Σ sc·(16-element sums of a), exactly.
            let offset = _mm256_madd_epi16(_mm256_loadu_si256(a[r][i].bsums.as_ptr().cast()), sc16);
            let total = hsum_i32(_mm256_sub_epi32(sumi[r], _mm256_slli_epi32::<5>(offset)));
            acc[r] = (total as f32).mul_add(wd * a[r][i].d(), acc[r]);
        }
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_iq4_nl_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(KVALUES_IQ4NL.as_ptr().cast()));
    let mut acc = _mm256_setzero_ps();
    for (w, a) in as_blocks::<BlockIq4Nl>(w)
        .iter()
        .zip(as_blocks::<BlockQ8_0>(a))
    {
        let qx = _mm256_shuffle_epi8(table, nibbles(&w.qs));
        let p = _mm256_cvtepi32_ps(dot_i8(qx, load(&a.qs)));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_mul(w.d, a.d)), p, acc);
    }
    hsum_f32(acc)
}

/// Byte b of Q2_0 codes → its four weights (q - 1) as the bytes of a u32, low first.
const Q2_0_DECODE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut b = 0;
    while b < 256 {
        let mut k = 0;
        while k < 4 {
            let w = (((b >> (2 * k)) & 3) as i32 - 1) as i8 as u8;
            t[b] |= (w as u32) << (8 * k);
            k += 1;
        }
        b += 1;
    }
    t
};

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q2_0_q8_0(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let acts = as_blocks::<BlockQ8_0>(a);
    for (w, a) in as_blocks::<BlockQ2_0>(w).iter().zip(acts.chunks_exact(2)) {
        let dw = f16(w.d);
        for (half, a) in a.iter().enumerate() {
            let q = &w.qs[8 * half..8 * half + 8];
            let t = |i: usize| Q2_0_DECODE[q[i] as usize] as i32;
            let qx = _mm256_setr_epi32(t(0), t(1), t(2), t(3), t(4), t(5), t(6), t(7));
            let p = _mm256_cvtepi32_ps(dot_i8(qx, load(&a.qs)));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * f16(a.d)), p, acc);
        }
    }
    hsum_f32(acc)
}

// ------------------------------------------------------------------ 256-blocks × Q8_K

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q2_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut mins = 0.0f32;
    for (w, a) in as_blocks::<BlockQ2K>(w)
        .iter()
        .zip(as_blocks::<BlockQ8K>(a))
    {
        let msum: i32 = (0..16).map(|g| (w.scales[g] >> 4) as i32 * a.bsum(g)).sum();
        let mut sumi = _mm256_setzero_si256();
        for half in 0..2 {
            let q2 = load_u8(&w.qs[32 * half..]);
            for j in 0..4 {
                let q = _mm256_and_si256(srl16(q2, 2 * j as i32), _mm256_set1_epi8(3));
                let y = load(&a.qs[128 * half + 32 * j..]);
                let g = 8 * half + 2 * j;
                let sc = scale_pair((w.scales[g] & 0xF) as i16, (w.scales[g + 1] & 0xF) as i16);
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), sc));
            }
        }
        let ((wd, wdmin), da) = (f16_pair(w.d, w.dmin), a.d());
        acc = _mm256_fmadd_ps(_mm256_set1_ps(wd * da), _mm256_cvtepi32_ps(sumi), acc);
        mins += msum as f32 * (wdmin * da);
    }
    hsum_f32(acc) - mins
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q3_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (w, a) in as_blocks::<BlockQ3K>(w)
        .iter()
        .zip(as_blocks::<BlockQ8K>(a))
    {
        let scales = q3k_scales(&w.scales);
        let hbits = load_u8(&w.hmask);
        let mut sumi = _mm256_setzero_si256();
        for half in 0..2 {
            let q3 = load_u8(&w.qs[32 * half..]);
            for j in 0..4 {
                let low = _mm256_and_si256(srl16(q3, 2 * j as i32), _mm256_set1_epi8(3));
                let bit =
                    _mm256_and_si256(srl16(hbits, (4 * half + j) as i32), _mm256_set1_epi8(1));
                // 4 where the high bit is clear: the weight is low - 4.
                let minus = _mm256_slli_epi16(_mm256_xor_si256(bit, _mm256_set1_epi8(1)), 2);
                let y = load(&a.qs[128 * half + 32 * j..]);
                let p =
                    _mm256_sub_epi16(_mm256_maddubs_epi16(low, y), _mm256_maddubs_epi16(minus, y));
                let g = 8 * half + 2 * j;
                let sc = scale_pair(scales[g] as i16, scales[g + 1] as i16);
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sc));
            }
        }
        acc = _mm256_fmadd_ps(
            _mm256_set1_ps(f16(w.d) * a.d()),
            _mm256_cvtepi32_ps(sumi),
            acc,
        );
    }
    hsum_f32(acc)
}

/// A Q4_K/Q5_K block's eight group scales (byte g of the word: group g's), and its
/// eight group minimums each twice as sixteen i16 lanes (one per 16-element activation
/// sum), for [`k4_min_lanes`]. `scale_min_k4` for all eight groups at once, in general
/// registers: built a byte at a time in memory and read back as words, they stalled on
/// store forwarding.
#[inline(always)]
pub(super) unsafe fn k4_scales_mins(scales: &[u8; 12]) -> (u64, __m256i) {
    let word =
        |i: usize| u32::from_le_bytes([scales[i], scales[i + 1], scales[i + 2], scales[i + 3]]);
    let (a, b, c) = (word(0), word(4), word(8));
    // Groups 0..4: six bits of bytes 0..4 (scales) and 4..8 (minimums); groups 4..8:
    // the nibbles of bytes 8..12 below the top two bits of bytes 0..4 and 4..8.
    let sc = (a & 0x3F3F_3F3F) as u64
        | (((c & 0x0F0F_0F0F) | ((a >> 6) & 0x0303_0303) << 4) as u64) << 32;
    let mn = (b & 0x3F3F_3F3F) as u64
        | ((((c >> 4) & 0x0F0F_0F0F) | ((b >> 6) & 0x0303_0303) << 4) as u64) << 32;
    let m8 = _mm_cvtsi64_si128(mn as i64);
    (sc, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)))
}

/// Byte `g` of a word of eight scales ([`k4_scales_mins`]) as an i16.
#[inline(always)]
pub(super) fn scale_of(sc: u64, g: usize) -> i16 {
    (sc >> (8 * g)) as u8 as i16
}

/// Lane g: group g's minimum × the sum of its 32 activations (exact), from
/// [`k4_scales_mins`]'s lanes and the block's 16-element sums.
#[inline(always)]
pub(super) unsafe fn k4_min_lanes(mins16: __m256i, a: &BlockQ8K) -> __m256i {
    _mm256_madd_epi16(_mm256_loadu_si256(a.bsums.as_ptr().cast()), mins16)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    dotn_q4_k_q8_k(w, [a])[0]
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut mins = 0.0f32;
    let m4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    for (w, a) in as_blocks::<BlockQ5K>(w)
        .iter()
        .zip(as_blocks::<BlockQ8K>(a))
    {
        let (sc, mins16) = k4_scales_mins(&w.scales);
        let hbits = load_u8(&w.qh);
        let mut sumi = _mm256_setzero_si256();
        for j in 0..4 {
            let q5 = load_u8(&w.qs[32 * j..]);
            let h_lo = _mm256_slli_epi16(_mm256_and_si256(srl16(hbits, 2 * j as i32), one), 4);
            let h_hi = _mm256_slli_epi16(_mm256_and_si256(srl16(hbits, 2 * j as i32 + 1), one), 4);
            let lo = _mm256_or_si256(_mm256_and_si256(q5, m4), h_lo);
            let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q5, 4), m4), h_hi);
            let sc_lo = _mm256_set1_epi16(scale_of(sc, 2 * j));
            let sc_hi = _mm256_set1_epi16(scale_of(sc, 2 * j + 1));
            let p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load(&a.qs[64 * j..])), sc_lo);
            let p_hi =
                _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load(&a.qs[64 * j + 32..])), sc_hi);
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p_lo, p_hi));
        }
        let ((wd, wdmin), da) = (f16_pair(w.d, w.dmin), a.d());
        acc = _mm256_fmadd_ps(_mm256_set1_ps(wd * da), _mm256_cvtepi32_ps(sumi), acc);
        mins += hsum_i32(k4_min_lanes(mins16, a)) as f32 * (wdmin * da);
    }
    hsum_f32(acc) - mins
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    dotn_q6_k_q8_k(w, [a])[0]
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_k_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (w, a) in as_blocks::<BlockQ8K>(w)
        .iter()
        .zip(as_blocks::<BlockQ8K>(a))
    {
        let mut sumi = _mm256_setzero_si256();
        for j in 0..8 {
            sumi = _mm256_add_epi32(sumi, dot_i8(load(&w.qs[32 * j..]), load(&a.qs[32 * j..])));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(w.d() * a.d()), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_f32(acc)
}

/// One 32-weight group of a 2-bit codebook type: its four grid points (`point(l)`:
/// eight magnitudes and a sign byte each) against 32 activations, each half's sum times
/// its odd scale `sc` (`scale_pair`), as eight i32 lanes. The points go into the
/// vectors from general registers, one by one, rather than through an array.
#[inline(always)]
unsafe fn iq2_group(point: impl Fn(usize) -> ([u8; 8], u8), q8: &[i8], sc: __m256i) -> __m256i {
    let ((g0, s0), (g1, s1), (g2, s2), (g3, s3)) = (point(0), point(1), point(2), point(3));
    let g = i64::from_le_bytes;
    let qx = _mm256_set_epi64x(g(g3), g(g2), g(g1), g(g0));
    let signs = s0 as u32 | (s1 as u32) << 8 | (s2 as u32) << 16 | (s3 as u32) << 24;
    // -1 where the weight is negative, +1 elsewhere.
    let sign = _mm256_or_si256(bits_to_bytes(signs), _mm256_set1_epi8(1));
    let y = _mm256_sign_epi8(load(q8), sign);
    _mm256_madd_epi16(_mm256_maddubs_epi16(qx, y), sc)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_iq2_xxs_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (w, a) in as_blocks::<BlockIq2Xxs>(w)
        .iter()
        .zip(as_blocks::<BlockQ8K>(a))
    {
        let mut sumi = _mm256_setzero_si256();
        for ib32 in 0..8 {
            let group = iq2xxs_group(w, ib32);
            let ls = 2 * (group.1 >> 28) as i16 + 1;
            let point = |l| iq2xxs_point(group, l);
            let part = iq2_group(point, &a.qs[32 * ib32..], scale_pair(ls, ls));
            sumi = _mm256_add_epi32(sumi, part);
        }
        acc = _mm256_fmadd_ps(
            _mm256_set1_ps(f16(w.d) * a.d() * 0.125),
            _mm256_cvtepi32_ps(sumi),
            acc,
        );
    }
    hsum_f32(acc)
}

/// An IQ2_XS block's 32 grid indices (the low nine bits of each code) into `index` and
/// its 32 sign bytes (each code's seven bits and their parity in bit 7, `iq2_signs`, by
/// a table of nibbles) into `signs`, in a few vector operations.
#[inline(always)]
pub(super) unsafe fn iq2xs_points(b: &BlockIq2Xs, index: &mut [u16; 32], signs: &mut [u8; 32]) {
    let m511 = _mm256_set1_epi16(511);
    let m4 = _mm256_set1_epi8(0x0F);
    // Bit 7 set where a nibble has an odd number of bits.
    let odd = _mm256_broadcastsi128_si256(_mm_setr_epi8(
        0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0,
    ));
    let q0 = _mm256_loadu_si256(b.qs.as_ptr().cast());
    let q1 = _mm256_loadu_si256(b.qs.as_ptr().add(16).cast());
    _mm256_storeu_si256(index.as_mut_ptr().cast(), _mm256_and_si256(q0, m511));
    _mm256_storeu_si256(
        index.as_mut_ptr().add(16).cast(),
        _mm256_and_si256(q1, m511),
    );
    // The seven sign bits of the 32 codes as bytes, in order.
    let codes = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi16(
        _mm256_srli_epi16::<9>(q0),
        _mm256_srli_epi16::<9>(q1),
    ));
    let parity = _mm256_xor_si256(
        _mm256_shuffle_epi8(odd, _mm256_and_si256(codes, m4)),
        _mm256_shuffle_epi8(odd, _mm256_and_si256(_mm256_srli_epi16::<4>(codes), m4)),
    );
    _mm256_storeu_si256(signs.as_mut_ptr().cast(), _mm256_or_si256(codes, parity));
}

/// IQ2_XS: a block's indices and sign bytes made at once ([`iq2xs_points`]) and kept in
/// small arrays that the groups read back (each read inside one earlier store, so it is
/// forwarded), then each 32-weight group as `iq2_group` computes it: the same lanes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_iq2_xs_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut index = [0u16; 32];
    let mut signs = [0u8; 32];
    for (w, a) in as_blocks::<BlockIq2Xs>(w)
        .iter()
        .zip(as_blocks::<BlockQ8K>(a))
    {
        iq2xs_points(w, &mut index, &mut signs);
        let mut sumi = _mm256_setzero_si256();
        for ib32 in 0..8 {
            let s = w.scales[ib32];
            let sc = scale_pair(2 * (s & 0xF) as i16 + 1, 2 * (s >> 4) as i16 + 1);
            let point = |l: usize| {
                let i = 4 * ib32 + l;
                (IQ2XS_GRID[index[i] as usize].to_le_bytes(), signs[i])
            };
            sumi = _mm256_add_epi32(sumi, iq2_group(point, &a.qs[32 * ib32..], sc));
        }
        acc = _mm256_fmadd_ps(
            _mm256_set1_ps(f16(w.d) * a.d() * 0.125),
            _mm256_cvtepi32_ps(sumi),
            acc,
        );
    }
    hsum_f32(acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_iq2_s_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (w, a) in as_blocks::<BlockIq2S>(w)
        .iter()
        .zip(as_blocks::<BlockQ8K>(a))
    {
        let mut sumi = _mm256_setzero_si256();
        for ib32 in 0..8 {
            let s = w.scales[ib32];
            let sc = scale_pair(2 * (s & 0xF) as i16 + 1, 2 * (s >> 4) as i16 + 1);
            let point = |l| (iq2s_grid_point(w, ib32, l), iq2s_signs(w, ib32, l));
            sumi = _mm256_add_epi32(sumi, iq2_group(point, &a.qs[32 * ib32..], sc));
        }
        acc = _mm256_fmadd_ps(
            _mm256_set1_ps(f16(w.d) * a.d() * 0.125),
            _mm256_cvtepi32_ps(sumi),
            acc,
        );
    }
    hsum_f32(acc)
}

/// IQ3_S: each 32-weight group's eight grid points (four magnitudes each) as 32 bytes,
/// its four sign bytes applied to the activations, the products summed in pairs and
/// times the group's multiplier 2s + 1 as eight i32 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_iq3_s_q8_k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (w, a) in as_blocks::<BlockIq3S>(w)
        .iter()
        .zip(as_blocks::<BlockQ8K>(a))
    {
        let mut sumi = _mm256_setzero_si256();
        for ib32 in 0..8 {
            let g = |k: usize| i32::from_le_bytes(iq3s_grid_point(w, ib32, k));
            let qx = _mm256_set_epi32(g(7), g(6), g(5), g(4), g(3), g(2), g(1), g(0));
            let signs =
                u32::from_le_bytes(w.signs[4 * ib32..4 * ib32 + 4].try_into().expect("4 bytes"));
            // -1 where the weight is negative, +1 elsewhere.
            let sign = _mm256_or_si256(bits_to_bytes(signs), _mm256_set1_epi8(1));
            let y = _mm256_sign_epi8(load(&a.qs[32 * ib32..]), sign);
            let ls = iq3s_scale(w, ib32) as i16;
            let part = _mm256_madd_epi16(_mm256_maddubs_epi16(qx, y), scale_pair(ls, ls));
            sumi = _mm256_add_epi32(sumi, part);
        }
        acc = _mm256_fmadd_ps(
            _mm256_set1_ps(f16(w.d) * a.d()),
            _mm256_cvtepi32_ps(sumi),
            acc,
        );
    }
    hsum_f32(acc)
}

// ------------------------------------------------------------------ float weights × f32

/// Σ w·a over rows of floats, eight lanes at a time with four accumulators; `load_w`
/// turns the weight bytes of eight elements into f32 lanes.
#[inline(always)]
unsafe fn dot_floats(
    w: &[u8],
    a: &[u8],
    wsize: usize,
    load_w: impl Fn(*const u8) -> __m256,
    scalar_w: impl Fn(&[u8]) -> f32,
) -> f32 {
    let n = a.len() / 4;
    let (wp, ap) = (w.as_ptr(), a.as_ptr().cast::<f32>());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            let j = i + 8 * k;
            *acc = _mm256_fmadd_ps(load_w(wp.add(j * wsize)), _mm256_loadu_ps(ap.add(j)), *acc);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(
            load_w(wp.add(i * wsize)),
            _mm256_loadu_ps(ap.add(i)),
            acc[0],
        );
        i += 8;
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut tail = 0.0f32;
    for j in i..n {
        let x = scalar_w(&w[j * wsize..(j + 1) * wsize]);
        tail += x * f32::from_le_bytes(a[4 * j..4 * j + 4].try_into().expect("4 bytes"));
    }
    hsum_f32(sum) + tail
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32_f32(w: &[u8], a: &[u8]) -> f32 {
    dot_floats(
        w,
        a,
        4,
        |p| _mm256_loadu_ps(p.cast()),
        |b| f32::from_le_bytes(b.try_into().expect("4 bytes")),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16_f32(w: &[u8], a: &[u8]) -> f32 {
    dot_floats(
        w,
        a,
        2,
        |p| _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
        |b| F16Le([b[0], b[1]]).get(),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_bf16_f32(w: &[u8], a: &[u8]) -> f32 {
    dot_floats(
        w,
        a,
        2,
        |p| {
            _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())),
                16,
            ))
        },
        |b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16),
    )
}
