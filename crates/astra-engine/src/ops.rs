//! Row operations of the transformer on f32 activations: RMSNorm, RoPE, activation
//! functions, residual adds. Each works on one token's row, so a token gets the same
//! arithmetic whatever batch it is in.

use half::f16;
use half::slice::HalfFloatSliceExt;

/// `out = x / √(mean(x²) + eps) · w`, the sum of squares in f64 (as ggml's rms_norm).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * w;
    }
}

/// RMSNorm in place.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let sum: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for (v, &w) in x.iter_mut().zip(w) {
        *v = *v * scale * w;
    }
}

/// Rotary position embedding of every head (of `head_dim` values) of a token's row at
/// position `pos`, on each head's first `dims` values: adjacent pairs (Llama) or the
/// two halves (NeoX). The angle of pair i is pos · base^(−2i/dims), built by repeated
/// multiplication as ggml builds it, once for all the heads.
pub fn rope(row: &mut [f32], head_dim: usize, pos: usize, dims: usize, base: f32, neox: bool) {
    let theta_scale = base.powf(-2.0 / dims as f32);
    let mut theta = pos as f32;
    for i in 0..dims / 2 {
        let (sin, cos) = theta.sin_cos();
        let (a, b) = rope_pair(i, dims, neox);
        for head in row.chunks_exact_mut(head_dim) {
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * cos - x1 * sin;
            head[b] = x0 * sin + x1 * cos;
        }
        theta *= theta_scale;
    }
}

/// The two elements of a head that RoPE's pair `i` rotates together.
#[inline]
pub(crate) fn rope_pair(i: usize, dims: usize, neox: bool) -> (usize, usize) {
    if neox {
        (i, i + dims / 2)
    } else {
        (2 * i, 2 * i + 1)
    }
}

/// eˣ for the activation functions, by Cephes' single-precision method: n = round(x·log₂e),
/// r = x − n·ln 2 (ln 2 in two parts), eʳ by a degree-7 polynomial, times 2ⁿ built in
/// the exponent bits. Every step is one plain IEEE multiply or add (no fused ones), so
/// the AVX form ([`glu`]) and the CUDA kernel give these bits too. Within 2 ulp of eˣ on
/// [-87.3, 88.3]; above it +∞, below it the value at -87.3 (under 2⁻¹²⁵).
pub fn exp_approx(x: f32) -> f32 {
    if x > EXP_HI {
        return f32::INFINITY;
    }
    // min/max rather than clamp: a NaN comes out as EXP_HI, where clamp would keep it.
    #[allow(clippy::manual_clamp)]
    let x = x.min(EXP_HI).max(EXP_LO);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    let e = (p * (r * r) + r) + 1.0;
    e * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

const EXP_HI: f32 = 88.376_26;
const EXP_LO: f32 = -87.336_54;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// eˣ for the attention weights: the single-precision function of GNU libc (2.27 on) on
/// x86-64 machines with AVX2 and FMA, written out: x·32/ln 2 = k + r in double
/// precision (k an integer by the shift trick), 2^(k/32) from a 32-entry table with
/// k/32's integer part added to its exponent, 2^(r/32) by a cubic, the product rounded
/// to single once, the same operations fused. So the weights do not depend on the C
/// library's exponential, and a vector form ([`attend_rows`]) gives the same bits.
/// Inputs of magnitude 88 and more, and the non-finite, first meet the library's
/// checks: +∞ above 88.72284, 0 below −103.97208, the smallest subnormal below
/// −103.27893, NaN for NaN; the rest of them take the table too.
#[inline]
pub fn expf(x: f32) -> f32 {
    if expf_checked(x) {
        if x == f32::NEG_INFINITY {
            return 0.0;
        }
        if x.is_nan() || x == f32::INFINITY {
            return x + x;
        }
        if x > EXPF_OVERFLOW {
            return f32::INFINITY;
        }
        if x < EXPF_UNDERFLOW {
            return 0.0;
        }
        if x < EXPF_MAY_UNDERFLOW {
            return f32::from_bits(1);
        }
    }
    let xd = x as f64;
    let z = EXPF_INV_LN2_N.mul_add(xd, EXPF_SHIFT);
    let ki = z.to_bits();
    let r = EXPF_INV_LN2_N.mul_add(xd, -(z - EXPF_SHIFT));
    let s = f64::from_bits(EXPF_TABLE[(ki % 32) as usize].wrapping_add(ki << 47));
    let zc = EXPF_POLY[0].mul_add(r, EXPF_POLY[1]);
    let y = EXPF_POLY[2].mul_add(r, 1.0);
    let y = zc.mul_add(r * r, y);
    (y * s) as f32
}

/// Whether [`expf`] checks `x` against its special ranges before the table: |x| ≥ 88
/// or not finite (the top twelve bits, less the sign, above [`EXPF_MAIN_TOP`]).
#[inline(always)]
fn expf_checked(x: f32) -> bool {
    (x.to_bits() >> 20) & 0x7FF > EXPF_MAIN_TOP
}

/// The largest top twelve bits (less the sign) of an |x| below 88.
const EXPF_MAIN_TOP: u32 = 0x42A;
const EXPF_OVERFLOW: f32 = f32::from_bits(0x42B1_7217);
const EXPF_UNDERFLOW: f32 = f32::from_bits(0xC2CF_F1B4);
const EXPF_MAY_UNDERFLOW: f32 = f32::from_bits(0xC2CE_8ECF);
/// 32 / ln 2.
const EXPF_INV_LN2_N: f64 = f64::from_bits(0x4047_1547_652B_82FE);
/// 1.5 · 2⁵²: adding it rounds to an integer in the low bits.
const EXPF_SHIFT: f64 = f64::from_bits(0x4338_0000_0000_0000);
/// The cubic's coefficients (r³, r², r), scaled for r in units of ln 2 / 32.
const EXPF_POLY: [f64; 3] = [
    f64::from_bits(0x3EBC_6AF8_4B91_2394),
    f64::from_bits(0x3F2E_BFCE_50FA_C4F3),
    f64::from_bits(0x3F96_2E42_FF0C_52D6),
];
/// 2^(i/32) for i < 32, as the bits of a double less i·2⁵²/32 (the index's share of
/// the exponent, which [`expf`] adds back from k).
const EXPF_TABLE: [u64; 32] = [
    0x3FF0_0000_0000_0000,
    0x3FEF_D9B0_D315_8574,
    0x3FEF_B558_6CF9_890F,
    0x3FEF_9301_D012_5B51,
    0x3FEF_72B8_3C7D_517B,
    0x3FEF_5487_3168_B9AA,
    0x3FEF_387A_6E75_6238,
    0x3FEF_1E9D_F51F_DEE1,
    0x3FEF_06FE_0A31_B715,
    0x3FEE_F1A7_373A_A9CB,
    0x3FEE_DEA6_4C12_3422,
    0x3FEE_CE08_6061_892D,
    0x3FEE_BFDA_D536_2A27,
    0x3FEE_B42B_569D_4F82,
    0x3FEE_AB07_DD48_5429,
    0x3FEE_A47E_B03A_5585,
    0x3FEE_A09E_667F_3BCD,
    0x3FEE_9F75_E8EC_5F74,
    0x3FEE_A114_73EB_0187,
    0x3FEE_A589_994C_CE13,
    0x3FEE_ACE5_422A_A0DB,
    0x3FEE_B737_B0CD_C5E5,
    0x3FEE_C491_82A3_F090,
    0x3FEE_D503_B23E_255D,
    0x3FEE_E89F_995A_D3AD,
    0x3FEE_FF76_F2FB_5E47,
    0x3FEF_199B_DD85_529C,
    0x3FEF_3720_DCEF_9069,
    0x3FEF_5818_DCFB_A487,
    0x3FEF_7C97_337B_9B5F,
    0x3FEF_A4AF_A2A4_90DA,
    0x3FEF_D076_5B6E_4540,
];

/// SiLU: x·σ(x) = x / (1 + e⁻ˣ).
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp_approx(-x))
}

/// GELU, tanh approximation (as ggml's gelu): ½x(1 + tanh u) with
/// u = √(2/π)·x·(1 + 0.044715x²), computed as the equal x / (1 + e^(−2u)).
pub fn gelu(x: f32) -> f32 {
    x / (1.0 + exp_approx(-2.0 * gelu_inner(x)))
}

#[inline(always)]
fn gelu_inner(x: f32) -> f32 {
    GELU_SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)
}

const GELU_SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_COEF_A: f32 = 0.044715;

/// One query against a run of keys and values (rows of `q.len()` in `k` and `v`):
/// the scores `dot(q, k_r)·scale` into `weights`, their max, the weights
/// e^(score − max) ([`expf`], the C library's function, not [`exp_approx`]: with it,
/// ulp-level changes in the weights moved a SmolLM2 chat prompt's second-ranked token
/// by 2% in probability through the activation quantization downstream), and
/// `acc = Σ_r weight_r · v_r` in row order. Returns (max, Σ weights). Keys and values
/// are the cache's elements (f16 or f32), each converted exactly to f32 where it is
/// used, so the arithmetic is [`dot`] and [`axpy`]'s on the converted rows, in one AVX2
/// + F16C function where the CPU has them.
pub fn attend_rows<T: KvElem>(
    q: &[f32],
    k: &[T],
    v: &[T],
    scale: f32,
    weights: &mut [f32],
    acc: &mut [f32],
) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        // SAFETY: AVX2, FMA and F16C are present.
        return unsafe { simd::attend_rows(q, k, v, scale, weights, acc) };
    }
    attend_rows_scalar(q, k, v, scale, weights, acc)
}

/// [`attend_rows`] without SIMD: the composed scalar ops on each converted row.
fn attend_rows_scalar<T: KvElem>(
    q: &[f32],
    k: &[T],
    v: &[T],
    scale: f32,
    weights: &mut [f32],
    acc: &mut [f32],
) -> (f32, f32) {
    let hd = q.len();
    let mut scratch = vec![0.0f32; if T::IS_F32 { 0 } else { hd }];
    let mut max = f32::NEG_INFINITY;
    for (w, kr) in weights.iter_mut().zip(k.chunks_exact(hd)) {
        *w = dot_scalar(q, T::as_f32(kr, &mut scratch)) * scale;
        max = max.max(*w);
    }
    let mut sum = 0.0f32;
    for (w, vr) in weights.iter_mut().zip(v.chunks_exact(hd)) {
        let w = expf(*w - max);
        sum += w;
        axpy_scalar(acc, w, T::as_f32(vr, &mut scratch));
    }
    (max, sum)
}

/// An element of the KV cache: f16 (the default, half the memory) or f32 (keys and
/// values as computed). Every use converts it exactly to f32.
pub trait KvElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// A row of f32 stored as elements (rounded to nearest for f16).
    fn store(dst: &mut [Self], src: &[f32]);
    /// Whether the element is f32 already (rows need no conversion).
    const IS_F32: bool;
    /// The row as f32: itself, or converted into `scratch` (of the row's length).
    fn as_f32<'a>(row: &'a [Self], scratch: &'a mut [f32]) -> &'a [f32];
    /// Eight elements at `p` as f32.
    ///
    /// # Safety
    /// AVX and F16C are present; eight elements are readable at `p`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl KvElem for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn store(dst: &mut [f16], src: &[f32]) {
        dst.convert_from_f32_slice(src);
    }
    const IS_F32: bool = false;
    fn as_f32<'a>(row: &'a [f16], scratch: &'a mut [f32]) -> &'a [f32] {
        row.convert_to_f32_slice(scratch);
        scratch
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
    }
}

impl KvElem for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn store(dst: &mut [f32], src: &[f32]) {
        dst.copy_from_slice(src);
    }
    const IS_F32: bool = true;
    fn as_f32<'a>(row: &'a [f32], _: &'a mut [f32]) -> &'a [f32] {
        row
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

/// `gate[i] = act(gate[i]) · up[i]` (`gelu` selects GELU, else SiLU): eight lanes at a
/// time with AVX2 where the CPU has it, giving the scalar functions' bits.
pub fn glu(gate: &mut [f32], up: &[f32], gelu_act: bool) {
    let n = gate.len().min(up.len());
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present.
        done = unsafe { simd::glu(&mut gate[..n], &up[..n], gelu_act) };
    }
    let f = if gelu_act { gelu } else { silu };
    for (g, &u) in gate[done..n].iter_mut().zip(&up[done..n]) {
        *g = f(*g) * u;
    }
}

pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Σ a·b in eight lanes (lane l takes elements l, l+8, …, each a separate multiply and
/// add), reduced pairwise, then the tail: one fixed order, computed with AVX where the
/// CPU has it and by the scalar reference otherwise, with the same bits either way.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX is present.
        return unsafe { simd::dot(a, b) };
    }
    dot_scalar(a, b)
}

fn reduce_lanes(lanes: [f32; 8]) -> f32 {
    ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6]))
        + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))
}

/// The reference for [`dot`].
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            lanes[l] += a[8 * c + l] * b[8 * c + l];
        }
    }
    let mut tail = 0.0;
    for i in 8 * chunks..a.len() {
        tail += a[i] * b[i];
    }
    reduce_lanes(lanes) + tail
}

/// `acc += w · v`, element by element (a multiply, then an add).
#[inline]
pub fn axpy(acc: &mut [f32], w: f32, v: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: AVX is present.
        return unsafe { simd::axpy(acc, w, v) };
    }
    axpy_scalar(acc, w, v)
}

/// The reference for [`axpy`].
pub fn axpy_scalar(acc: &mut [f32], w: f32, v: &[f32]) {
    for (a, &x) in acc.iter_mut().zip(v) {
        *a += w * x;
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::KvElem;
    use std::arch::x86_64::*;

    /// [`super::exp_approx`] in eight lanes, operation for operation.
    #[inline(always)]
    unsafe fn exp_approx(x: __m256) -> __m256 {
        let big = _mm256_cmp_ps(x, _mm256_set1_ps(super::EXP_HI), _CMP_GT_OQ);
        let x = _mm256_max_ps(
            _mm256_min_ps(x, _mm256_set1_ps(super::EXP_HI)),
            _mm256_set1_ps(super::EXP_LO),
        );
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let r = _mm256_sub_ps(
            _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(super::LN2_HI))),
            _mm256_mul_ps(n, _mm256_set1_ps(super::LN2_LO)),
        );
        let mut p = _mm256_set1_ps(super::EXP_POLY[0]);
        for &c in &super::EXP_POLY[1..] {
            p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
        }
        let e = _mm256_add_ps(
            _mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r),
            _mm256_set1_ps(1.0),
        );
        let scale = _mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
            23,
        );
        _mm256_blendv_ps(
            _mm256_mul_ps(e, _mm256_castsi256_ps(scale)),
            _mm256_set1_ps(f32::INFINITY),
            big,
        )
    }

    /// [`super::expf`] of eight lanes, operation for operation in double precision four
    /// lanes at a time; lanes out of the table's range take the scalar function.
    #[inline(always)]
    pub(super) unsafe fn expf8(x: __m256) -> __m256 {
        let out = _mm256_set_m128(
            expf4(_mm256_extractf128_ps::<1>(x)),
            expf4(_mm256_castps256_ps128(x)),
        );
        let abstop = _mm256_and_si256(
            _mm256_srli_epi32::<20>(_mm256_castps_si256(x)),
            _mm256_set1_epi32(0x7FF),
        );
        let special = _mm256_cmpgt_epi32(abstop, _mm256_set1_epi32(super::EXPF_MAIN_TOP as i32));
        if _mm256_testz_si256(special, special) != 0 {
            return out;
        }
        let (mut xs, mut ys) = ([0.0f32; 8], [0.0f32; 8]);
        _mm256_storeu_ps(xs.as_mut_ptr(), x);
        _mm256_storeu_ps(ys.as_mut_ptr(), out);
        for (y, &x) in ys.iter_mut().zip(&xs) {
            if super::expf_checked(x) {
                *y = super::expf(x);
            }
        }
        _mm256_loadu_ps(ys.as_ptr())
    }

    /// [`super::expf`]'s table path for four lanes.
    #[inline(always)]
    unsafe fn expf4(x: __m128) -> __m128 {
        let xd = _mm256_cvtps_pd(x);
        let inv = _mm256_set1_pd(super::EXPF_INV_LN2_N);
        let shift = _mm256_set1_pd(super::EXPF_SHIFT);
        let z = _mm256_fmadd_pd(inv, xd, shift);
        let ki = _mm256_castpd_si256(z);
        let r = _mm256_fmsub_pd(inv, xd, _mm256_sub_pd(z, shift));
        let index = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        let t = _mm256_i64gather_epi64::<8>(super::EXPF_TABLE.as_ptr().cast(), index);
        let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
        let p = super::EXPF_POLY;
        let zc = _mm256_fmadd_pd(_mm256_set1_pd(p[0]), r, _mm256_set1_pd(p[1]));
        let y = _mm256_fmadd_pd(_mm256_set1_pd(p[2]), r, _mm256_set1_pd(1.0));
        let y = _mm256_fmadd_pd(zc, _mm256_mul_pd(r, r), y);
        _mm256_cvtpd_ps(_mm256_mul_pd(y, s))
    }

    /// [`super::attend_rows`] with AVX2, FMA and F16C, in its arithmetic: the scores
    /// eight keys at a time (the query loaded once for eight independent chains), their
    /// maximum in eight lanes (a maximum is exact in any order), the weights eight at a
    /// time ([`expf8`]), their sum in order, then the weighted values 64 elements at a
    /// time with their sums held in registers across every key (each element still
    /// takes the keys in order, a multiply then an add).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn attend_rows<T: KvElem>(
        q: &[f32],
        k: &[T],
        v: &[T],
        scale: f32,
        weights: &mut [f32],
        acc: &mut [f32],
    ) -> (f32, f32) {
        let (hd, n) = (q.len(), weights.len());
        assert!(
            k.len() >= n * hd && v.len() >= n * hd && acc.len() == hd,
            "keys, values or output do not fit"
        );
        // Rows past the last repeat it (their scores are not kept).
        let row = |r: usize| -> *const T { k[r.min(n - 1) * hd..].as_ptr() };
        // The values are asked for now, to arrive while the scores are computed, and
        // each block of keys while the block before it is.
        let line = 64 / std::mem::size_of::<T>();
        for e in (0..n * hd).step_by(line) {
            _mm_prefetch::<_MM_HINT_T0>(v.as_ptr().add(e).cast());
        }
        for r in (0..n).step_by(8) {
            for e in ((r + 8) * hd..((r + 16) * hd).min(n * hd)).step_by(line) {
                _mm_prefetch::<_MM_HINT_T0>(k.as_ptr().add(e).cast());
            }
            let s = dot8(q, std::array::from_fn(|i| row(r + i)));
            for i in 0..8.min(n - r) {
                weights[r + i] = s[i] * scale;
            }
        }
        let mut lanes = _mm256_set1_ps(f32::NEG_INFINITY);
        for r in (0..n / 8 * 8).step_by(8) {
            lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(weights.as_ptr().add(r)));
        }
        let mut max8 = [0.0f32; 8];
        _mm256_storeu_ps(max8.as_mut_ptr(), lanes);
        let max = max8
            .iter()
            .chain(&weights[n / 8 * 8..])
            .fold(f32::NEG_INFINITY, |m, &w| m.max(w));
        // The weights eight at a time, then their sum in order.
        let whole = n / 8 * 8;
        for r in (0..whole).step_by(8) {
            let p = weights.as_mut_ptr().add(r);
            _mm256_storeu_ps(
                p,
                expf8(_mm256_sub_ps(_mm256_loadu_ps(p), _mm256_set1_ps(max))),
            );
        }
        for w in &mut weights[whole..] {
            *w = super::expf(*w - max);
        }
        let sum = weights.iter().fold(0.0f32, |s, &w| s + w);
        let mut e = 0;
        while e + 64 <= hd {
            let mut a = [_mm256_setzero_ps(); 8];
            for (i, a) in a.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(acc.as_ptr().add(e + 8 * i));
            }
            for (j, &w) in weights.iter().enumerate() {
                let (wv, vr) = (_mm256_set1_ps(w), v.as_ptr().add(j * hd + e));
                for (i, a) in a.iter_mut().enumerate() {
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(wv, T::load8(vr.add(8 * i))));
                }
            }
            for (i, a) in a.iter().enumerate() {
                _mm256_storeu_ps(acc.as_mut_ptr().add(e + 8 * i), *a);
            }
            e += 64;
        }
        for e in e..hd {
            for (j, &w) in weights.iter().enumerate() {
                acc[e] += w * v[j * hd + e].to_f32();
            }
        }
        (max, sum)
    }

    /// [`dot`] of `a` with eight rows of cache elements of its length at once (each
    /// converted exactly): each row's eight lane sums as `dot` takes them, then
    /// [`super::reduce_lanes`]'s tree for the eight rows together in three vector steps
    /// that add the same pairs, then each row's tail.
    #[inline(always)]
    unsafe fn dot8<T: KvElem>(a: &[f32], b: [*const T; 8]) -> [f32; 8] {
        let chunks = a.len() / 8;
        let mut acc = [_mm256_setzero_ps(); 8];
        for c in 0..chunks {
            let x = _mm256_loadu_ps(a.as_ptr().add(8 * c));
            for (acc, b) in acc.iter_mut().zip(b) {
                *acc = _mm256_add_ps(*acc, _mm256_mul_ps(x, T::load8(b.add(8 * c))));
            }
        }
        // A row's lanes l0..l7 reduce as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 +
        // l7)). First its halves added, xi = li + l(i+4), two rows a register:
        // [x0 x1 x2 x3] of row r in the low half, of row r + 1 in the high one.
        let halves = |r0: __m256, r1: __m256| {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(r0, r1),
                _mm256_permute2f128_ps::<0x31>(r0, r1),
            )
        };
        let (h01, h23) = (halves(acc[0], acc[1]), halves(acc[2], acc[3]));
        let (h45, h67) = (halves(acc[4], acc[5]), halves(acc[6], acc[7]));
        // Then x0 + x2 and x1 + x3 of rows 0, 2 (low half) and 1, 3 (high), and so on.
        let pairs = |p: __m256, q: __m256| {
            _mm256_add_ps(
                _mm256_shuffle_ps::<0x44>(p, q),
                _mm256_shuffle_ps::<0xEE>(p, q),
            )
        };
        let (s0, s1) = (pairs(h01, h23), pairs(h45, h67));
        // Then their sum: rows 0, 2, 4, 6 in the low half, 1, 3, 5, 7 in the high one.
        let sums = _mm256_add_ps(
            _mm256_shuffle_ps::<0x88>(s0, s1),
            _mm256_shuffle_ps::<0xDD>(s0, s1),
        );
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), sums);
        std::array::from_fn(|i| {
            let mut tail = 0.0;
            for (j, &x) in a.iter().enumerate().skip(8 * chunks) {
                tail += x * (*b[i].add(j)).to_f32();
            }
            lanes[i / 2 + 4 * (i % 2)] + tail
        })
    }

    /// [`super::glu`] on whole groups of eight; returns how many elements it did.
    #[target_feature(enable = "avx2")]
    pub unsafe fn glu(gate: &mut [f32], up: &[f32], gelu: bool) -> usize {
        let n = gate.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        for i in (0..n).step_by(8) {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let arg = if gelu {
                // -2 · (√(2/π)·x·(1 + a·x·x)), in the scalar order.
                let ax = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(super::GELU_COEF_A), g), g);
                let inner = _mm256_mul_ps(
                    _mm256_mul_ps(_mm256_set1_ps(super::GELU_SQRT_2_OVER_PI), g),
                    _mm256_add_ps(one, ax),
                );
                _mm256_mul_ps(_mm256_set1_ps(-2.0), inner)
            } else {
                _mm256_sub_ps(_mm256_setzero_ps(), g)
            };
            let a = _mm256_div_ps(g, _mm256_add_ps(one, exp_approx(arg)));
            _mm256_storeu_ps(
                gate.as_mut_ptr().add(i),
                _mm256_mul_ps(a, _mm256_loadu_ps(up.as_ptr().add(i))),
            );
        }
        n
    }

    #[inline]
    #[target_feature(enable = "avx")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let chunks = n / 8;
        let mut acc = _mm256_setzero_ps();
        for c in 0..chunks {
            let x = _mm256_loadu_ps(a.as_ptr().add(8 * c));
            let y = _mm256_loadu_ps(b.as_ptr().add(8 * c));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(x, y));
        }
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        let mut tail = 0.0;
        for i in 8 * chunks..n {
            tail += a[i] * b[i];
        }
        super::reduce_lanes(lanes) + tail
    }

    #[inline]
    #[target_feature(enable = "avx")]
    pub unsafe fn axpy(acc: &mut [f32], w: f32, v: &[f32]) {
        let n = acc.len().min(v.len());
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            let a = _mm256_loadu_ps(acc.as_ptr().add(i));
            let x = _mm256_loadu_ps(v.as_ptr().add(i));
            _mm256_storeu_ps(
                acc.as_mut_ptr().add(i),
                _mm256_add_ps(a, _mm256_mul_ps(wv, x)),
            );
            i += 8;
        }
        for j in i..n {
            acc[j] += w * v[j];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_against_f64() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 30.0) / 7.0).collect();
        let w: Vec<f32> = (0..64).map(|i| 1.0 + i as f32 / 64.0).collect();
        let mut out = vec![0.0; 64];
        rms_norm(&x, &w, 1e-5, &mut out);
        let ms: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 64.0;
        for i in 0..64 {
            let want = x[i] as f64 / (ms + 1e-5).sqrt() * w[i] as f64;
            assert!((out[i] as f64 - want).abs() < 1e-5 * want.abs().max(1.0));
        }
    }

    #[test]
    fn rope_rotates_by_the_angle() {
        for neox in [false, true] {
            // Two heads of four: the second a copy of the first, rotated alike.
            let mut row = vec![1.0f32, 0.0, 0.5, 0.25, 1.0, 0.0, 0.5, 0.25];
            rope(&mut row, 4, 3, 4, 10000.0, neox);
            assert_eq!(row[..4], row[4..]);
            let h = &row[..4];
            let (a, b) = if neox { (0, 2) } else { (0, 1) };
            let (x0, x1) = if neox { (1.0f64, 0.5) } else { (1.0, 0.0) };
            let t = 3.0f64;
            assert!((h[a] as f64 - (x0 * t.cos() - x1 * t.sin())).abs() < 1e-6);
            assert!((h[b] as f64 - (x0 * t.sin() + x1 * t.cos())).abs() < 1e-6);
            // Norm is preserved.
            let n: f32 = h.iter().map(|v| v * v).sum();
            assert!((n - (1.0 + 0.25 + 0.0625)).abs() < 1e-5);
        }
    }

    /// With fewer rotated dimensions than a head has, each head of the row turns its
    /// first `dims` values as a head of `dims` alone would, and keeps the rest.
    #[test]
    fn rope_turns_the_first_dims_of_every_head() {
        for neox in [false, true] {
            let head = [0.3f32, -1.2, 0.7, 2.0, 5.0, -6.0];
            let mut alone = head[..4].to_vec();
            rope(&mut alone, 4, 9, 4, 10000.0, neox);
            let mut row = [head, head].concat();
            rope(&mut row, 6, 9, 4, 10000.0, neox);
            for h in row.chunks_exact(6) {
                assert_eq!(h[..4], alone[..]);
                assert_eq!(h[4..], head[4..]);
            }
        }
    }

    /// The AVX forms of dot and axpy give the scalar reference's bits.
    #[test]
    fn simd_dot_and_axpy_equal_the_scalar_reference() {
        let a: Vec<f32> = (0..259)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0)
            .collect();
        let b: Vec<f32> = (0..259)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 7.0)
            .collect();
        for n in [0, 5, 8, 64, 256, 259] {
            assert_eq!(
                dot(&a[..n], &b[..n]).to_bits(),
                dot_scalar(&a[..n], &b[..n]).to_bits(),
                "n = {n}"
            );
            let (mut x, mut y) = (a[..n].to_vec(), a[..n].to_vec());
            axpy(&mut x, 0.37, &b[..n]);
            axpy_scalar(&mut y, 0.37, &b[..n]);
            assert_eq!(
                x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn activations_against_f64() {
        let mut x = -20.0f32;
        while x < 20.0 {
            let xd = x as f64;
            let g = 0.5
                * xd
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd.powi(3))).tanh());
            let s = xd / (1.0 + (-xd).exp());
            assert!(
                (gelu(x) as f64 - g).abs() <= 4e-7 * g.abs().max(1.0),
                "gelu({x}) = {} want {g}",
                gelu(x)
            );
            assert!(
                (silu(x) as f64 - s).abs() <= 4e-7 * s.abs().max(1.0),
                "silu({x}) = {} want {s}",
                silu(x)
            );
            x += 0.0137;
        }
        // Far tails: the clamped exponential leaves a vanishing remainder, never a NaN.
        for (v, want) in [
            (gelu(-1e30), 0.0),
            (gelu(1e30), 1e30),
            (silu(-1e30), 0.0),
            (gelu(f32::MIN), 0.0),
        ] {
            assert!(
                (v - want).abs() <= 1e-8f32.max(want.abs() * 1e-7),
                "{v} vs {want}"
            );
        }
    }

    /// e^x within 2 ulp over the whole unclamped range, against f64.
    #[test]
    fn exp_approx_within_two_ulp() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let ulp = (want as f32).abs() * f32::EPSILON;
            worst = worst.max((exp_approx(x) as f64 - want).abs() / ulp as f64);
            x += 0.000_77;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
    }

    /// Every 997th single-precision bit pattern, the ends of each special range and
    /// their neighbours, and the infinities.
    fn expf_inputs() -> Vec<f32> {
        let mut xs: Vec<f32> = (0..=u32::MAX).step_by(997).map(f32::from_bits).collect();
        for edge in [
            EXPF_OVERFLOW,
            EXPF_UNDERFLOW,
            EXPF_MAY_UNDERFLOW,
            88.0,
            -88.0,
            0.0,
            -0.0,
        ] {
            let b = edge.to_bits();
            xs.extend((b.saturating_sub(3)..=b.saturating_add(3)).map(f32::from_bits));
        }
        xs.extend([f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN]);
        xs
    }

    /// [`expf`] is the C library's `expf` where that is GNU libc's (2.27 on) function
    /// for x86-64 with AVX2 and FMA, the form whose bits it writes out.
    #[test]
    #[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
    fn expf_is_glibcs() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            eprintln!("skipped: GNU libc picks its FMA expf only where AVX2 and FMA are");
            return;
        }
        for x in expf_inputs() {
            let (got, want) = (expf(x), x.exp());
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "expf({x:e}) = {got:e}, the library's {want:e}"
            );
        }
    }

    /// The vector form of [`expf`] gives its bits in every lane.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn expf8_equals_expf() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            eprintln!("skipped: this machine has no AVX2 and FMA");
            return;
        }
        let mut xs = expf_inputs();
        // Whole vectors: the last ones repeat the last input.
        xs.resize(xs.len().next_multiple_of(8), *xs.last().expect("inputs"));
        for chunk in xs.chunks_exact(8) {
            let mut got = [0.0f32; 8];
            // SAFETY: AVX2 and FMA are present.
            unsafe {
                use std::arch::x86_64::*;
                let y = simd::expf8(_mm256_loadu_ps(chunk.as_ptr()));
                _mm256_storeu_ps(got.as_mut_ptr(), y);
            }
            for (&x, got) in chunk.iter().zip(got) {
                let want = expf(x);
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "expf8 lane of {x:e}: {got:e}, expf {want:e}"
                );
            }
        }
    }

    /// The fused attention rows, and the fallback without SIMD, give the bits of the
    /// scalar reference ops composed, on either cache element.
    #[test]
    fn attend_rows_equals_the_composed_reference() {
        for hd in [64, 256, 20] {
            for n in [1usize, 3, 7, 9, 64] {
                composed_reference_case::<f16>(hd, n, 1.0, f16::from_f32);
                // f32 values that f16 cannot hold.
                composed_reference_case::<f32>(hd, n, 1.0, |x| x * 1.000_1);
                // Scores so far apart that most weights leave the exponential's table
                // (far below the maximum, to 0).
                composed_reference_case::<f32>(hd, n, 300.0, |x| x * 1.000_1);
            }
        }
    }

    fn composed_reference_case<T: KvElem>(hd: usize, n: usize, spread: f32, elem: fn(f32) -> T) {
        let q: Vec<f32> = (0..hd)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.7 * spread)
            .collect();
        let kc: Vec<T> = (0..n * hd)
            .map(|i| elem(((i * 53 % 17) as f32 - 8.0) * 0.31))
            .collect();
        let vc: Vec<T> = (0..n * hd)
            .map(|i| elem(((i * 29 % 13) as f32 - 6.0) * 0.53))
            .collect();
        let (k, v): (Vec<f32>, Vec<f32>) = (
            kc.iter().map(|x| x.to_f32()).collect(),
            vc.iter().map(|x| x.to_f32()).collect(),
        );
        let (mut weights, mut acc) = (vec![0.0; n], vec![0.0; hd]);
        let (max, sum) = attend_rows(&q, &kc, &vc, 0.125, &mut weights, &mut acc);
        let (mut weights_scalar, mut acc_scalar) = (vec![0.0; n], vec![0.0; hd]);
        let fallback =
            attend_rows_scalar(&q, &kc, &vc, 0.125, &mut weights_scalar, &mut acc_scalar);
        let scores: Vec<f32> = (0..n)
            .map(|r| dot_scalar(&q, &k[r * hd..(r + 1) * hd]) * 0.125)
            .collect();
        let want_max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if spread > 1.0 && n > 1 {
            let lowest = scores.iter().copied().fold(f32::INFINITY, f32::min);
            assert!(
                lowest - want_max < -104.0,
                "hd {hd} n {n}: scores not spread"
            );
        }
        let (mut want_sum, mut want_acc) = (0.0f32, vec![0.0f32; hd]);
        for r in 0..n {
            let w = expf(scores[r] - want_max);
            want_sum += w;
            axpy_scalar(&mut want_acc, w, &v[r * hd..(r + 1) * hd]);
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (got_max, got_sum, got_acc) in [(max, sum, &acc), (fallback.0, fallback.1, &acc_scalar)]
        {
            assert_eq!(
                (got_max.to_bits(), got_sum.to_bits()),
                (want_max.to_bits(), want_sum.to_bits()),
                "hd {hd} n {n}"
            );
            assert_eq!(bits(got_acc), bits(&want_acc), "hd {hd} n {n}");
        }
    }

    /// The AVX2 GLU gives the scalar functions' bits, tails included.
    #[test]
    fn glu_equals_the_scalar_functions() {
        for gelu_act in [false, true] {
            for n in [0, 7, 8, 100, 1029] {
                let mut gate: Vec<f32> = (0..n)
                    .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 97.0)
                    .collect();
                // The far tails and a NaN take the same path in both forms.
                for (i, v) in [f32::MIN, 1e30, -1e30, f32::NAN, 90.0, -90.0]
                    .into_iter()
                    .enumerate()
                {
                    if i < n {
                        gate[i * 13 % n] = v;
                    }
                }
                let up: Vec<f32> = (0..n)
                    .map(|i| ((i * 104_729 % 1009) as f32 - 504.0) / 211.0)
                    .collect();
                let mut got = gate.clone();
                glu(&mut got, &up, gelu_act);
                let f = if gelu_act { gelu } else { silu };
                for i in 0..n {
                    let want = f(gate[i]) * up[i];
                    assert!(
                        got[i].to_bits() == want.to_bits() || (got[i].is_nan() && want.is_nan()),
                        "gelu {gelu_act} n {n} i {i}"
                    );
                }
            }
        }
    }
}
